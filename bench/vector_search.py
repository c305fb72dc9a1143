"""1:N search speed of the gallery on the embedded milvus-lite server.

    python -m bench.vector_search [--sizes 100000 1000000] [--queries 200] [--index FLAT|IVF_FLAT]
                                  [--data-dir DIR]

For each size N: a fresh collection gets N random unit 256-d vectors (face model v2) of one tenant plus 1%
more spread over three other tenants, inserted through MilvusGalleryStore (the service's code path, batches
of 10,000); then `--queries` searches (top 10, near copies of stored vectors, after 10 untimed warm-up
queries) run one at a time through the same store, as the worker does. Also timed: the same searches for a
small tenant (N/300 faces) to show the cost of a selective tenant filter. The server runs in a temporary
directory unless --data-dir is given, and is stopped at the end. Cores may be shared: compare rows of one
run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import format_table
from models.embedder import FUSED_DIM
from serve_app.domain.faces import GalleryEntry
from serve_app.embedded import EmbeddedMilvus
from serve_app.stores.milvus_gallery import MilvusGalleryStore

DIM = FUSED_DIM  # face model v2
INSERT_BATCH = 10_000
OTHER_TENANTS = ("tenant-b", "tenant-c", "tenant-d")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def fill(store: MilvusGalleryStore, rng: np.random.Generator, tenant: str, count: int) -> np.ndarray:
    """Insert `count` vectors for `tenant`; returns a sample of them to build queries from."""
    sample = np.empty((0, DIM), np.float32)
    now = time.time()
    for start in range(0, count, INSERT_BATCH):
        size = min(INSERT_BATCH, count - start)
        vectors = rng.standard_normal((size, DIM), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # unit vectors, inner product
        entries = [
            GalleryEntry(f"{tenant}-{start + i}", tenant, "bench", vectors[i], now) for i in range(size)
        ]
        await store.add(entries)
        if len(sample) < 1000:
            sample = np.vstack([sample, vectors[: 1000 - len(sample)]])
    return sample


async def time_searches(
    store: MilvusGalleryStore, tenant: str, sample: np.ndarray, queries: int, rng: np.random.Generator
) -> list[float]:
    probes = sample[rng.integers(0, len(sample), queries + 10)]
    probes = probes + rng.standard_normal(probes.shape, dtype=np.float32) * 0.01
    probes /= np.linalg.norm(probes, axis=1, keepdims=True)
    timings = []
    for index, probe in enumerate(probes):
        started = time.perf_counter()
        matches = await store.search(tenant, probe, 10, -1.0)
        elapsed = (time.perf_counter() - started) * 1000
        assert matches, "a near copy of a stored vector must be found"
        if index >= 10:  # the first ones warm up caches and threads
            timings.append(elapsed)
    return timings


async def bench_size(uri: str, size: int, queries: int, index: str) -> list[list[str]]:
    rng = np.random.default_rng(size)
    store = MilvusGalleryStore(
        uri,
        collection=f"bench_{size}_{index.lower()}",
        index_type=index,
        timeout_s=120,
        model_version="bench",
        dimension=DIM,
    )
    try:
        await store.ensure_ready()
        started = time.perf_counter()
        sample = await fill(store, rng, "tenant-a", size)
        small = max(1, size // 300)
        small_sample = await fill(store, rng, OTHER_TENANTS[0], small)
        for tenant in OTHER_TENANTS[1:]:
            await fill(store, rng, tenant, max(1, (size // 100 - small) // 2))
        total = await store.count()
        insert_s = time.perf_counter() - started
        big = await time_searches(store, "tenant-a", sample, queries, rng)
        few = await time_searches(store, OTHER_TENANTS[0], small_sample, queries, rng)
    finally:
        await store.close()

    def row(label: str, timings: list[float]) -> list[str]:
        return [
            f"{size:,}",
            label,
            f"{statistics.median(timings):.1f}",
            f"{percentile(timings, 0.95):.1f}",
            f"{total / insert_s:,.0f}",
        ]

    return [row(f"tenant with {size:,}", big), row(f"tenant with {small:,}", few)]


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-milvus-") as scratch:
        server = EmbeddedMilvus(Path(args.data_dir or scratch))
        server.start()
        try:
            rows: list[list[str]] = []
            for size in args.sizes:
                rows += await bench_size(server.uri, size, args.queries, args.index)
                print(f"done N={size:,}", flush=True)
        finally:
            server.stop()
    header = ["N (tenant-a)", "searched tenant", "p50 ms", "p95 ms", "insert rows/s"]
    print(
        f"\nmilvus-lite 2.5.1 server, index {args.index}, L2, top 10, {args.queries} queries, one at a time"
    )
    print(format_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--index", choices=["FLAT", "IVF_FLAT"], default="FLAT")
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the server's data here")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
