"""The service-wide minimum score set on the running service (`facesearch calibrate --apply default`,
`facesearch clients update default`): where it stands among the others, on the fake stores."""

from __future__ import annotations

import asyncio

from tests.unit.fakes import TEST_POLICY, World, at_cosine, embedding, face
from tests.unit.test_processing import RED, matched, submit_search


def test_the_run_time_default_comes_after_a_tenants_own_and_before_the_setting() -> None:
    async def scenario() -> None:
        world = World()  # FACESEARCH_MATCH_MIN_SCORE: 0.5
        calibration = TEST_POLICY.calibration
        tenant, _ = await world.clients.create("tenant")
        probe = embedding(1)
        world.analysis.faces_by_color[RED] = [face(probe)]
        for index, score in enumerate((0.3, 0.35, 0.9, 0.95)):
            vector = at_cosine(probe, calibration.cosine_for_score(score), index)
            await world.enrol(tenant.client_id, f"face-{round(score * 100)}", vector)

        async def search() -> list[object]:
            tx = await submit_search(world, RED, tenant_id=tenant.client_id, enroll_face=False)
            await world.processor().process(tx.reference_id)
            return [entry[0] for entry in await matched(world, tx)]

        assert await search() == ["face-95", "face-90"]  # the setting
        await world.clients.set_default_min_score(0.25)
        assert await search() == ["face-95", "face-90", "face-35", "face-30"]  # the run-time default
        await world.clients.update_search_settings(tenant.client_id, min_score=0.92, max_matches=None)
        assert await search() == ["face-95"]  # the tenant's own
        await world.clients.update_search_settings(tenant.client_id, min_score=None, max_matches=None)
        assert await search() == ["face-95", "face-90", "face-35", "face-30"]
        await world.clients.set_default_min_score(None)
        assert await search() == ["face-95", "face-90"]

    asyncio.run(scenario())


def test_a_running_processor_takes_the_new_default_within_its_tenant_cache() -> None:
    """Set on the running service, no restart: the processor re-reads a tenant's settings after
    tenant_cache_s (5 s in the service; 0 here)."""

    async def scenario() -> None:
        world = World()
        calibration = TEST_POLICY.calibration
        probe = embedding(1)
        world.analysis.faces_by_color[RED] = [face(probe)]
        await world.enrol("tenant-a", "near", at_cosine(probe, calibration.cosine_for_score(0.45), 0))
        processor = world.processor()

        async def search() -> list[object]:
            tx = await submit_search(world, RED, tenant_id="tenant-a", enroll_face=False)
            await processor.process(tx.reference_id)
            return [entry[0] for entry in await matched(world, tx)]

        assert await search() == []
        await world.clients.set_default_min_score(0.4)
        assert await search() == ["near"]

    asyncio.run(scenario())
