"""Retention against the real stores: redis-server and milvus-lite (serve_app.launch.embedded) and a blob
directory, wired by serve_app.wiring.worker exactly as the deployments wire them; only the models are
scripted.

Round after round of transactions (overrides of the same few references, searches and age estimations
that do not enrol, an orphaned upload each round) must leave Redis and the blob directory the same size
once the short retention has passed and the reconcile pass every worker runs has swept.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.domain.transactions import TransactionState
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.commands import AgeEstimationCommand, FaceSearchCommand
from serve_app.pipelines.transactions import TransactionService
from serve_app.settings import (
    AuthSettings,
    HttpSettings,
    MilvusSettings,
    RedisSettings,
    RetentionSettings,
    Settings,
)
from serve_app.wiring.worker import WorkerStores, build_reconciler, build_worker
from tests.unit.fakes import Color, ScriptedAnalysis, embedding, face, solid_png

TENANT = "tenant-retention"
RETENTION_S = 1
REFERENCES: dict[str, Color] = {
    "customer-0001": (200, 0, 0),
    "顧客-0002": (0, 200, 0),
    "😀-0003": (0, 0, 200),
}
ROUNDS = 5


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("retention"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


def blob_files(directory: Path) -> int:
    return sum(1 for path in directory.rglob("*") if path.is_file() and path.suffix != ".type")


def test_redis_keys_and_blob_files_stay_bounded_over_many_transactions(
    servers: EmbeddedServices, tmp_path: Path
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        blob_dir=tmp_path / "blobs",
        redis=RedisSettings(url=servers.redis_url, key_prefix=f"r{uuid.uuid4().hex[:8]}:"),
        milvus=MilvusSettings(uri=servers.milvus_uri, token=""),
        auth=AuthSettings(secret_key="retention-test-secret-0123456789"),
        http=HttpSettings(public_base_url=None),
        retention=RetentionSettings(transaction_retention_s=RETENTION_S, orphan_upload_grace_s=0),
    )
    analysis = ScriptedAnalysis()
    for index, color in enumerate(REFERENCES.values()):
        analysis.faces_by_color[color] = [face(embedding(index), age=30)]

    async def scenario() -> list[tuple[int, int]]:
        worker_stores = WorkerStores.build(settings)
        stores = worker_stores.redis
        redis = stores.redis
        blobs = worker_stores.blobs
        gallery = worker_stores.gallery
        reconciler = build_reconciler(settings, "retention-test", worker_stores)
        service = TransactionService(stores.transactions, blobs, settings.limits.max_image_pixels)
        worker, _ = build_worker(settings, analysis, "retention-worker", stores=worker_stores)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))

        async def redis_keys() -> int:
            keys = [key async for key in redis.scan_iter(match=f"{settings.redis.key_prefix}*", count=1000)]
            # EXISTS expires a key whose time has come even before Redis' background cycle gets to it.
            return sum([int(await redis.exists(key)) for key in keys])

        sizes: list[tuple[int, int]] = []
        try:
            for round_ in range(ROUNDS):
                submitted = []
                for reference, color in REFERENCES.items():
                    submitted.append(
                        await service.create_face_search(
                            FaceSearchCommand(TENANT, solid_png(color), reference, True, True)
                        )
                    )
                for color in list(REFERENCES.values())[:2]:
                    submitted.append(
                        await service.create_face_search(
                            FaceSearchCommand(TENANT, solid_png(color), None, False, False)
                        )
                    )
                    submitted.append(
                        await service.create_age_estimation(
                            AgeEstimationCommand(TENANT, solid_png(color), enroll_face=False)
                        )
                    )
                # All waiting at once: a final transaction is gone RETENTION_S after it completed.
                finals = await asyncio.gather(
                    *(stores.transactions.wait_final(tx.reference_id, 30) for tx in submitted)
                )
                assert [tx.state if tx else None for tx in finals] == [TransactionState.COMPLETED] * 7
                # An upload whose transaction was never created (the ingress died in between).
                await blobs.put(f"uploads/{TENANT}/orphan-{round_}", b"\x89PNG", "image/png")
                await asyncio.sleep(RETENTION_S + 0.5)
                report = await reconciler.run_pass()
                assert report is not None and report.completed
                assert report.blobs_removed == 1  # this round's orphan
                sizes.append((await redis_keys(), blob_files(settings.blobs)))
            records = await stores.records.all_face_ids(TENANT)
            assert len(records) == len(REFERENCES)  # every override replaced the face before it
            # Every transaction record and completion signal expired (fs:txn:<id>, fs:txn-done:<id>).
            expired = [key async for key in redis.scan_iter(match=f"{settings.redis.key_prefix}txn*")]
            assert expired == []
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
            await gallery.close()
        return sizes

    sizes = asyncio.run(scenario())
    print(f"\n(redis keys, blob files) after each of {ROUNDS} rounds: {sizes}")
    assert sizes == [sizes[0]] * ROUNDS
    assert sizes[0][1] == len(REFERENCES)  # one proof per reference, no upload, no replaced proof
