"""The match-score metrics' source (serve_app/pipelines/score_watch.py): each face search the processor makes
final reaches the observer once, with its tenant, whatever else happens to the transaction; and the
metrics' tenant label stays bounded (serve_app/deployments/metrics.py)."""

from __future__ import annotations

import asyncio

from serve_app.deployments.metrics import ALL_TENANTS, OTHER_TENANTS, ScoreMetrics
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.pipelines.processing import TransactionProcessor
from serve_app.pipelines.score_watch import OutcomeReporting, best_score
from tests.unit.fakes import TEST_POLICY, World, at_cosine, embedding, face
from tests.unit.test_processing import BLUE, GREEN, RED, submit_age, submit_search


def test_each_final_face_search_is_reported_once_with_its_tenant() -> None:
    async def scenario() -> None:
        world = World()
        seen: list[tuple[str, FaceSearchOutcome]] = []
        processor = TransactionProcessor(
            OutcomeReporting(world.transactions, lambda tenant, outcome: seen.append((tenant, outcome))),
            world.record_store,
            world.gallery,
            world.blobs,
            world.analysis,
            world.policy,
            clients=world.clients,
        )
        probe = embedding(1)
        world.analysis.faces_by_color[RED] = [face(probe)]
        world.analysis.faces_by_color[GREEN] = [face(embedding(2))]
        world.analysis.faces_by_color[BLUE] = []
        near = TEST_POLICY.calibration.cosine_for_score(0.9)
        await world.enrol("tenant-a", "mate", at_cosine(probe, near, 0))

        matched = await submit_search(world, RED, tenant_id="tenant-a", enroll_face=False)
        unmatched = await submit_search(world, GREEN, tenant_id="tenant-b", enroll_face=False)
        faceless = await submit_search(world, BLUE, tenant_id="tenant-a", enroll_face=False)
        age = await submit_age(world, RED)
        for tx in (matched, unmatched, faceless, age):
            await processor.process(tx.reference_id)
        await processor.process(matched.reference_id)  # a duplicate delivery: final already, not again

        assert [tenant for tenant, _ in seen] == ["tenant-a", "tenant-b", "tenant-a"]
        scores = [best_score(outcome) for _, outcome in seen]
        assert scores[0] is not None and scores[0] >= 0.9 - 1e-6
        assert scores[1:] == [None, None]
        assert [outcome.is_face_found for _, outcome in seen] == [True, True, False]

    asyncio.run(scenario())


def test_the_tenant_label_is_bounded() -> None:
    metrics = ScoreMetrics(max_tenants=2)
    labels = [metrics.tenant_label(tenant) for tenant in ("a", "b", "c", "a", "d", "b")]
    assert labels == ["a", "b", OTHER_TENANTS, "a", OTHER_TENANTS, "b"]
    assert {ScoreMetrics(max_tenants=0).tenant_label(tenant) for tenant in "abc"} == {ALL_TENANTS}
