"""Work that cannot starve other work: a Milvus that hangs, or long jobs that hang on a file, must not delay
the transactions that need neither. The worker's stores are built as serve_app.wiring.worker builds them
(each with its own bounded thread pool, serve_app.wiring.stores.ThreadPools) on redis-server and milvus-lite
(serve_app.launch.embedded) and a real blob directory; only the models are scripted, their inference run
as a replica runs it (InferenceLane: a blocking call in the event loop's default pool, as image decoding).

The event loop's default pool is sized as on a 2-core replica (6 threads: Python's min(32, cores + 4)), and
the test hangs 6 calls: searches on a milvus-lite server stopped with SIGSTOP (a server that no longer
answers), or walks of the blob directory stuck opening a FIFO (a shared volume that no longer answers). An
age estimation, which decodes its image and runs the model and needs neither, must reach its final result
while every one of those calls is still hanging. When every blocking call shared the default pool, the
hung calls held all 6 of its threads, and the age estimation waited for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from models.types import AnalyzedFace
from serve_app.deployments.lanes import InferenceLane
from serve_app.domain.transactions import TransactionState
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.commands import AgeEstimationCommand
from serve_app.pipelines.transactions import TransactionService
from serve_app.settings import (
    AuthSettings,
    HttpSettings,
    MilvusSettings,
    RedisSettings,
    Settings,
    ThreadSettings,
)
from serve_app.wiring.worker import WorkerStores, build_worker
from tests.unit.fakes import Color, ScriptedAnalysis, embedding, face, solid_png

TENANT = "tenant-pools"
GREY: Color = (120, 120, 120)
DEFAULT_POOL = 6  # the event loop's default pool on a 2-core replica
HUNG = DEFAULT_POOL  # calls hung at once: as many as the default pool has threads


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("thread-pools"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


class LaneAnalysis(ScriptedAnalysis):
    """Scripted faces, reached as a replica reaches its model: a blocking call in the inference lane."""

    def __init__(self) -> None:
        super().__init__({GREY: [face(embedding(1), age=34)]})
        self._lane = InferenceLane(runs=2)

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        await self._lane.run(np.mean, image)  # the blocking part: computed in a thread of the default pool
        return await super().analyze(image, embed=embed, estimate_age=estimate_age)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP): its sockets stay open, nothing answers."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def hung_walks(stores: WorkerStores, directory: Path) -> AsyncIterator[list[asyncio.Task[object]]]:
    """HUNG walks of the blob directory (the blob sweep's scan), each stuck opening a FIFO where a blob's
    type file should be (as a read from a shared volume that stopped answering); released on exit."""
    fan_out = directory / "00" / "00"
    fan_out.mkdir(parents=True, exist_ok=True)
    (fan_out / ("0" * 64)).write_bytes(b"an old upload")
    fifo = fan_out / ("0" * 64 + ".type")
    os.mkfifo(fifo)
    walks: list[asyncio.Task[object]] = [
        asyncio.create_task(stores.blobs.scan_old(None, 0.0, 100)) for _ in range(HUNG)
    ]
    await asyncio.sleep(0.05)  # each walk reaches the FIFO (or waits for a thread of its pool)
    try:
        yield walks
    finally:
        # A writer that opens and closes the FIFO ends every read with an end of file; repeated, as each
        # walk opens it in turn.
        while not all(walk.done() for walk in walks):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            await asyncio.sleep(0.01)
        fifo.unlink()


@pytest.mark.parametrize("what_hangs", ["milvus", "long jobs"])
def test_a_hung_milvus_or_hung_long_jobs_never_delay_a_transaction_that_needs_neither(
    servers: EmbeddedServices, tmp_path: Path, what_hangs: str
) -> None:
    assert servers.milvus is not None and servers.milvus.pid is not None
    milvus_pid = servers.milvus.pid
    settings = Settings(
        data_dir=tmp_path,
        blob_dir=tmp_path / "blobs",
        redis=RedisSettings(url=servers.redis_url, key_prefix=f"p{uuid.uuid4().hex[:8]}:"),
        # Strong: a search goes straight to Milvus (no read of the tenant's write clock first); a call
        # of the stopped server would end at its deadline, long after the test.
        milvus=MilvusSettings(uri=servers.milvus_uri, token="", timeout_s=120, consistency_level="Strong"),
        auth=AuthSettings(secret_key="thread-pools-test-secret-0123456789"),
        http=HttpSettings(public_base_url=None),
        threads=ThreadSettings(milvus=2, blobs=2, jobs=2),  # fewer than the calls that hang
    )

    async def scenario() -> None:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(DEFAULT_POOL, thread_name_prefix="default")
        )
        stores = WorkerStores.build(settings)
        worker, _ = build_worker(settings, LaneAnalysis(), "pools-worker", stores=stores)
        service = TransactionService(
            stores.redis.transactions, stores.blobs, settings.limits.max_image_pixels
        )
        stop = asyncio.Event()
        running: asyncio.Task[None] | None = None
        try:
            await stores.gallery.page_ids(TENANT, None, 1)  # connected, its collection ready
            # Accepted by the ingress before anything hangs; the worker starts once everything does.
            tx = await service.create_age_estimation(
                AgeEstimationCommand(TENANT, solid_png(GREY), enroll_face=False)
            )
            async with contextlib.AsyncExitStack() as hanging:
                if what_hangs == "milvus":
                    hanging.enter_context(stopped(milvus_pid))
                    hung: list[asyncio.Task[object]] = [
                        asyncio.create_task(stores.gallery.search(TENANT, embedding(1), 5, -1.0))
                        for _ in range(HUNG)
                    ]
                    await asyncio.sleep(0.05)  # every search is in its call (or waits for a thread)
                else:
                    hung = await hanging.enter_async_context(hung_walks(stores, settings.blobs))
                assert not any(call.done() for call in hung)

                running = asyncio.create_task(worker.run(stop))
                final = asyncio.create_task(stores.redis.transactions.wait_final(tx.reference_id, 60))
                # A hang guard (the old wiring waited here for the hung calls, which never end).
                await asyncio.wait({final, *hung}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                assert final.done(), "the age estimation waited for the hung calls"
                result = final.result()
                assert result is not None and result.state is TransactionState.COMPLETED
                assert result.result is not None and getattr(result.result, "age", None) == 34
                assert not any(call.done() for call in hung), "a hung call ended first"
            # Released (the server resumed, the FIFO answered): the hung calls end.
            await asyncio.wait_for(asyncio.gather(*hung, return_exceptions=True), 120)
        finally:
            stop.set()
            if running is not None:
                await asyncio.wait_for(running, 60)
            await stores.close()

    asyncio.run(scenario())
