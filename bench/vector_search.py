"""1:N search on the gallery at 1 M and 10 M faces: latency, recall@10 against exact search, memory.

    python -m bench.vector_search [--sizes 1000000 10000000] [--queries 200] [--flat-max-rows N]
                                  [--nprobe 16 32 64] [--skip-flat] [--data-dir DIR]

Data: 256-d unit vectors (face model v2's dimension) from a fixed seed, clustered like a face gallery:
every chunk of 10,000 rows is 2,000 people with 5 photos each (a random unit centre per person plus
noise giving a same-person cosine of about 0.7; different people are near orthogonal). 99 % of the rows
belong to one tenant, 1 % (every 100th chunk) to a small tenant. Queries are new photos (fresh noise) of
enrolled people, half of each tenant. Exact top 10 is computed in numpy chunk by chunk while inserting, so
the bench never holds the whole gallery in memory (10 M x 256 floats is 10 GB).

Inserts go through MilvusGalleryStore (the service's code path) under exact FLAT search; unless
--skip-flat the queries are timed on it. Then a store with an index policy naming IVF_FLAT (the service's
default keeps FLAT on milvus-lite, whose IVF_FLAT ignores nprobe) opens the collection, finds it past
--flat-max-rows and switches it, as the insert crossing the threshold would; the queries are timed again
once per --nprobe value. Searches run one
at a time, as the worker does, after 10 untimed warm-up queries. Memory: the RSS of the milvus-lite server
process (with FLAT, then with IVF_FLAT) and the size of its data directory. One server per size. Cores
may be shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import format_table
from models.embedder import FUSED_DIM
from serve_app.domain.faces import GalleryEntry
from serve_app.embedded import EmbeddedMilvus
from serve_app.settings import MilvusSettings
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore

DIM = FUSED_DIM  # face model v2
CHUNK = 10_000
PHOTOS_PER_PERSON = 5
NOISE = 0.064  # per-dimension; |noise|^2 ~ 256 * 0.064^2 ~ 1.05, so same-person cosine ~ 0.7
SMALL_EVERY = 100  # every 100th chunk is the small tenant's: 1 % of the rows
BIG, SMALL = "tenant-big", "tenant-small"
SEED = 20261123
K = 10


def chunk_tenant(index: int) -> str:
    return SMALL if index % SMALL_EVERY == SMALL_EVERY - 1 else BIG


def chunk_centres(index: int, chunk: int) -> np.ndarray:
    rng = np.random.default_rng([SEED, chunk, index, 0])
    centres = rng.standard_normal((chunk // PHOTOS_PER_PERSON, DIM), dtype=np.float32)
    return centres / np.linalg.norm(centres, axis=1, keepdims=True)


def chunk_vectors(index: int, chunk: int) -> np.ndarray:
    rng = np.random.default_rng([SEED, chunk, index, 1])
    vectors = np.repeat(chunk_centres(index, chunk), PHOTOS_PER_PERSON, axis=0)
    vectors += rng.standard_normal(vectors.shape, dtype=np.float32) * NOISE
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@dataclass
class Queries:
    tenant: str
    probes: np.ndarray  # (q, DIM)
    best_scores: np.ndarray  # (q, K) running exact top-k, filled while inserting
    best_ids: np.ndarray  # (q, K) global row numbers

    def update(self, first_row: int, vectors: np.ndarray) -> None:
        scores = self.probes @ vectors.T  # (q, CHUNK)
        top = np.argpartition(-scores, K, axis=1)[:, :K]
        merged_scores = np.hstack([self.best_scores, np.take_along_axis(scores, top, axis=1)])
        merged_ids = np.hstack([self.best_ids, top + first_row])
        keep = np.argsort(-merged_scores, axis=1)[:, :K]
        self.best_scores = np.take_along_axis(merged_scores, keep, axis=1)
        self.best_ids = np.take_along_axis(merged_ids, keep, axis=1)


def make_queries(tenant: str, chunks: list[int], chunk: int, count: int) -> Queries:
    rng = np.random.default_rng([SEED, 7, len(chunks)])
    probes = np.empty((count, DIM), np.float32)
    for q in range(count):
        centres = chunk_centres(chunks[rng.integers(0, len(chunks))], chunk)
        probe = centres[rng.integers(0, len(centres))] + rng.standard_normal(DIM, dtype=np.float32) * NOISE
        probes[q] = probe / np.linalg.norm(probe)
    return Queries(tenant, probes, np.full((count, K), -np.inf, np.float32), np.zeros((count, K), np.int64))


async def fill(store: MilvusGalleryStore, size: int, chunk: int, queries: list[Queries]) -> float:
    """Insert `size` rows; returns rows per second."""
    started = time.perf_counter()
    now = time.time()
    for index in range(size // chunk):
        tenant, vectors = chunk_tenant(index), chunk_vectors(index, chunk)
        first = index * chunk
        await store.add(
            [GalleryEntry(f"f{first + i}", tenant, "bench", vectors[i], now) for i in range(chunk)]
        )
        for query in queries:
            if query.tenant == tenant:
                query.update(first, vectors)
        if index % 50 == 49:
            print(f"  inserted {first + chunk:,} rows", flush=True)
    return size / (time.perf_counter() - started)


async def time_searches(store: MilvusGalleryStore, queries: Queries) -> tuple[list[float], float]:
    """Latencies (ms, warm-up excluded) and mean recall@10 against the exact top 10."""
    timings: list[float] = []
    hits = 0
    for warm in queries.probes[:10]:
        await store.search(queries.tenant, warm, K, -1.0)
    for probe, truth in zip(queries.probes, queries.best_ids, strict=True):
        started = time.perf_counter()
        matches = await store.search(queries.tenant, probe, K, -1.0)
        timings.append((time.perf_counter() - started) * 1000)
        hits += len({int(m.face_id[1:]) for m in matches} & {int(t) for t in truth})
    return timings, hits / (K * len(queries.probes))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


async def bench_size(
    server: EmbeddedMilvus, data_dir: Path, size: int, args: argparse.Namespace
) -> list[list[str]]:
    chunk = min(CHUNK, size // SMALL_EVERY)  # at least 100 chunks: the small tenant gets 1 %
    chunks = size // chunk
    queries = [
        make_queries(BIG, [c for c in range(chunks) if chunk_tenant(c) == BIG], chunk, args.queries),
        make_queries(SMALL, [c for c in range(chunks) if chunk_tenant(c) == SMALL], chunk, args.queries),
    ]
    collection = f"bench_{size}"
    # Filled under exact search: the switch to the large index is made once, at the end, as the
    # policy would when the next insert crosses the threshold.
    store = MilvusGalleryStore(
        server.uri, collection=collection, model_version="bench", dimension=DIM, timeout_s=600
    )
    rows: list[list[str]] = []

    def row(label: str, index: str, params: str, timings: list[float], recall: float) -> list[str]:
        return [f"{size:,}", label, index, params, f"{statistics.median(timings):.1f}",
                f"{percentile(timings, 0.95):.1f}", f"{recall:.4f}"]  # fmt: skip

    try:
        insert_rate = await fill(store, size, chunk, queries)
        print(f"  {size:,} rows at {insert_rate:,.0f} rows/s", flush=True)
        if not args.skip_flat:
            for query in queries:
                timings, recall = await time_searches(store, query)
                rows.append(row(query.tenant, "FLAT", "-", timings, recall))
        flat_rss = rss_mib(server.pid)
    finally:
        await store.close()

    # IVF_FLAT named explicitly: the service's default keeps FLAT on milvus-lite (see IndexPolicy).
    policy = IndexPolicy(flat_max_rows=min(args.flat_max_rows, size - 1), large_index="IVF_FLAT")
    switched = MilvusGalleryStore(
        server.uri,
        collection=collection,
        model_version="bench",
        dimension=DIM,
        timeout_s=600,
        index_policy=policy,
    )
    started = time.perf_counter()
    await switched.ensure_ready()  # finds the collection past its threshold and builds the index
    build_s = time.perf_counter() - started
    index = switched.index_type
    await switched.close()
    for nprobe in args.nprobe:
        tuned = MilvusGalleryStore(
            server.uri, collection=collection, model_version="bench", dimension=DIM, timeout_s=600,
            index_policy=dataclasses.replace(policy, search_params={"nprobe": nprobe}),
        )  # fmt: skip
        try:
            for query in queries:
                timings, recall = await time_searches(tuned, query)
                rows.append(row(query.tenant, index, f"nprobe={nprobe}", timings, recall))
        finally:
            await tuned.close()
    print(
        f"  N={size:,}: insert {insert_rate:,.0f} rows/s; {index} build {build_s:.0f} s; milvus-lite RSS "
        f"{flat_rss:,.0f} MiB with FLAT, {rss_mib(server.pid):,.0f} MiB with {index}; data dir "
        f"{dir_mib(data_dir):,.0f} MiB",
        flush=True,
    )
    return rows


async def main_async(args: argparse.Namespace) -> None:
    rows: list[list[str]] = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-milvus-", dir=args.data_dir) as scratch:
            # One server per size: the RSS and data directory figures are that size's alone.
            server = EmbeddedMilvus(Path(scratch))
            server.start()
            try:
                rows += await bench_size(server, Path(scratch), size, args)
            finally:
                server.stop()
    header = ["N", "searched tenant", "index", "search", "p50 ms", "p95 ms", "recall@10"]
    print(
        f"\nmilvus-lite 2.5.1, {DIM}-d clustered unit vectors, IP, top {K}, "
        f"{args.queries} queries per row, one at a time"
    )
    print(format_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--flat-max-rows", type=int, default=MilvusSettings().flat_max_rows)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--skip-flat", action="store_true", help="skip the exact-search timings")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the servers keep their data")
    args = parser.parse_args()
    if any(size % min(CHUNK, size // SMALL_EVERY) or size < 10_000 for size in args.sizes):
        parser.error(f"sizes must be at least 10,000 and multiples of {CHUNK} (or of 1 % of the size)")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
