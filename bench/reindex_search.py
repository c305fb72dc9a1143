"""What a face search costs while a tenant's gallery moves to another face model version (`facesearch
reindex` onto an operator's model): searches go to the serving version's collection only, but the old
version's collection stays in Milvus beside it, and the re-index writes the new one while searches run.

    python -m bench.reindex_search [--faces 20000] [--queries 200] [--reindex-rate 40]

On the service's own stores (embedded redis-server and milvus-lite, MilvusGalleryStore wired as
serve_app.wiring.stores does, the tenant write clock included): one tenant of --faces faces enrolled under
face model v2 (256-d), then a 512-d operator version. Searches run one at a time, as the worker's are, with
the service's search (the tenant's 11 best at the gallery-size default bar), timed in each state:

1. before: v2 alone (the v2 service searching its own gallery);
2. half-way, paused: the new version's collection holds half the faces (a re-index interrupted);
3. half-way, re-index writing: the same, while the re-index adds faces one at a time at --reindex-rate a
   second (a re-index on this machine's CPU analyses about that many proofs a second);
4. after, old kept: the new version full, v2's collection still there (until dropped by hand);
5. after, old dropped.

Vectors are random unit vectors from a fixed seed: the latency of an exact (FLAT) search does not depend on
what the vectors look like. Also: the Milvus process's resident memory in each state.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import psutil

from bench.common import format_table, percentile
from models.calibration import FaceScoreCalibration
from models.embedder import FUSED_DIM, MODEL_VERSION
from serve_app.domain.faces import GalleryEntry
from serve_app.launch.embedded import EmbeddedServices
from serve_app.settings import Settings
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_tenant_clock import RedisTenantClock
from serve_app.wiring.stores import index_policy

TENANT = "bench-tenant"
NEW_VERSION = "arcface_bench0000000000"
NEW_DIM = 512
BATCH = 500


def store(settings: Settings, redis_url: str, milvus_uri: str, version: str, dim: int) -> MilvusGalleryStore:
    """As serve_app.wiring.stores.gallery_store builds it, for a given version."""
    redis = connect_redis(redis_url, max_connections=8)
    milvus = settings.milvus
    return MilvusGalleryStore(
        milvus_uri,
        model_version=version,
        dimension=dim,
        timeout_s=60,
        index_policy=index_policy(milvus),
        consistency_level=milvus.consistency_level,
        write_clock=RedisTenantClock(redis, prefix="bench:"),
    )


def unit(rng: np.random.Generator, count: int, dim: int) -> np.ndarray:
    vectors = rng.normal(size=(count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def entries(vectors: np.ndarray, version: str, first: int) -> list[GalleryEntry]:
    now = time.time()
    return [
        GalleryEntry(f"f{first + i:08d}", TENANT, version, vector, now) for i, vector in enumerate(vectors)
    ]


async def fill(gallery: MilvusGalleryStore, vectors: np.ndarray, version: str, first: int = 0) -> None:
    for start in range(first, len(vectors), BATCH):
        await gallery.add(entries(vectors[start : start + BATCH], version, start))


async def timed_searches(gallery: MilvusGalleryStore, queries: np.ndarray, min_cosine: float) -> list[float]:
    for query in queries[:10]:  # warm-up
        await gallery.search(TENANT, query, 11, min_cosine)
    seconds = []
    for query in queries[10:]:
        started = time.perf_counter()
        await gallery.search(TENANT, query, 11, min_cosine)
        seconds.append(time.perf_counter() - started)
    return seconds


async def reindex_writer(
    gallery: MilvusGalleryStore, vectors: np.ndarray, rate: float, stop: asyncio.Event, first: int
) -> int:
    """One face at a time at `rate` a second, as the re-index writes them; how many it wrote."""
    written = 0
    while not stop.is_set() and written < len(vectors):
        started = time.perf_counter()
        await gallery.add(entries(vectors[written : written + 1], NEW_VERSION, first + written))
        written += 1
        await asyncio.sleep(max(0.0, 1.0 / rate - (time.perf_counter() - started)))
    return written


def drop(uri: str, collection: str) -> None:
    """What the operator does once every tenant is re-indexed (docs/models.md)."""
    from pymilvus import MilvusClient

    client = MilvusClient(uri)
    try:
        client.drop_collection(collection)
    finally:
        client.close()


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    process = psutil.Process(pid)
    total = process.memory_info().rss + sum(child.memory_info().rss for child in process.children(True))
    return total / 2**20


async def run(faces: int, queries: int, rate: float, folder: Path) -> list[list[str]]:
    services = EmbeddedServices(folder)
    services.start()
    try:
        assert services.redis_url is not None and services.milvus_uri is not None
        milvus_pid = services.milvus.pid if services.milvus is not None else None
        settings = Settings(data_dir=folder)
        old = store(settings, services.redis_url, services.milvus_uri, MODEL_VERSION, FUSED_DIM)
        new = store(settings, services.redis_url, services.milvus_uri, NEW_VERSION, NEW_DIM)
        rng = np.random.default_rng(20261129)
        bar = FaceScoreCalibration.load().min_score_for_gallery(faces)
        old_bar = FaceScoreCalibration.load().cosine_for_score(bar)
        await fill(old, unit(rng, faces, FUSED_DIM), MODEL_VERSION)
        rows = []

        def add_row(state: str, seconds: Sequence[float], note: str) -> None:
            ms = [1000 * s for s in seconds]
            rows.append(
                [
                    state,
                    f"{statistics.median(ms):.2f}",
                    f"{percentile(ms, 95):.2f}",
                    f"{rss_mib(milvus_pid):.0f}",
                    note,
                ]
            )

        add_row(
            "before: v2 alone",
            await timed_searches(old, unit(rng, queries, FUSED_DIM), old_bar),
            f"{faces:,} v2",
        )
        new_vectors = unit(rng, faces, NEW_DIM)
        new_queries = unit(rng, queries, NEW_DIM)
        half = faces // 2
        await fill(new, new_vectors[:half], NEW_VERSION)
        both = f"{faces:,} v2 + {half:,} new"
        add_row("half-way, paused", await timed_searches(new, new_queries, 0.3), both)
        stop = asyncio.Event()
        writer = asyncio.create_task(reindex_writer(new, new_vectors[half:], rate, stop, half))
        during = await timed_searches(new, new_queries, 0.3)
        stop.set()
        written = half + await writer
        add_row("half-way, re-index writing", during, f"{both} (+{written - half}), {rate:g} writes/s")
        await fill(new, new_vectors, NEW_VERSION, first=written)
        add_row(
            "after: new full, v2 kept",
            await timed_searches(new, new_queries, 0.3),
            f"{faces:,} v2 + {faces:,} new",
        )
        await old.close()
        await asyncio.to_thread(drop, services.milvus_uri, f"faces_{MODEL_VERSION}")
        add_row("after: v2 dropped", await timed_searches(new, new_queries, 0.3), f"{faces:,} new")
        await new.close()
        return rows
    finally:
        services.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reindex_search", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--faces", type=int, default=20_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--reindex-rate", type=float, default=40.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = asyncio.run(run(args.faces, args.queries + 10, args.reindex_rate, Path(folder)))
    print(format_table(["state", "search p50 ms", "p95 ms", "Milvus RSS MiB", "collections"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
