"""1:N search on the gallery at 1 M and 10 M faces: latency, recall@10 against exact search, memory.

    python -m bench.vector_search [--backend lite|server] [--sizes 1000000 10000000] [--queries 200]
                                  [--indexes HNSW IVF_SQ8 IVF_FLAT] [--nprobe 16 32 64] [--ef 64 128]
                                  [--small-share 0.01] [--consistency Bounded] [--flat-max-rows N]
                                  [--skip-flat] [--switch-early] [--nlist N] [--data-dir DIR]

Backends: `lite` is milvus-lite 2.5.1 (the default install; its IVF_FLAT ignores nprobe and it has no
HNSW); `server` is the standalone Milvus 2.3.5 of the `milvus` wheel (a dev dependency), started in a
network namespace of its own (tests/milvus_server.py; needs root), where HNSW, IVF_SQ8, nprobe and the
tenant partition key are real. On the server the rows are searched at --consistency (default Bounded;
the service's default Strong waits for a time tick, ~200 ms a search: one extra row per index shows it).
The server runs with a few settings of its own (SERVER_SETTINGS: garbage collection within minutes, a
bounded message log, segments sealed at 90 % of their size so each is indexed once), which a 10 M fill
needs on one disk and two cores.

Data: 256-d unit vectors (face model v2's dimension) from a fixed seed, shaped like the service's fused
embeddings. Every chunk of 10,000 rows is 2,000 people with 5 photos each; a photo is normalise(mean +
centre + noise): `mean` is one direction every face shares (norm MEAN_NORM), a person's `centre` is
Gaussian with a decaying spectrum (variance of the k-th of 256 random orthogonal directions ~
k^-SPECTRUM_DECAY, total CENTRE_VARIANCE), and `noise` is isotropic (NOISE_VARIANCE), scaled per photo by
a log-normal factor (NOISE_SPREAD). Fitted to faces-calib's 1,489 identity photos (2026-11-25): their
stranger-pair cosines have mean 0.639, sd 0.040, p99 / p99.9 / p99.99 0.732 / 0.762 / 0.784 (1.1 M pairs),
same-person cosines mean 0.872, p5 0.802 (1,504 pairs); the generator gives 0.643, 0.043, 0.732 / 0.756 /
0.774 and 0.872, 0.809. So a query's top 10 is its own person's photos and realistic look-alikes. Every
100th chunk (--small-share) belongs to a small tenant, the rest to one big tenant. Queries are new photos of
enrolled people, half of each tenant; the exact top 10 is computed in numpy chunk by chunk while inserting,
so the bench never holds the whole gallery in memory.

Two recalls per row: recall@10 against the exact top 10, and "match recall", the share of the matches the
service would return that the index finds: exact neighbours in the top 10 at or above the service's match
bar for the searched tenant's size (the calibration's min_score_for_gallery at the default FPIR 1 %, as
cosine; printed under the table), found by the index with the same bar. "matches/q" is the mean number of
such exact matches per query (the rest of a person's photos fall below the bar, as ~half of real
same-person pairs do at a 1 M gallery).

Inserts go through MilvusGalleryStore (the service's code path) under exact FLAT search; unless
--skip-flat the queries are timed on it. Then a store whose index policy names the first of --indexes
finds the collection past --flat-max-rows and switches it (one pass of the workers' index-switch job,
serve_app/pipelines/index_switch.py, its lease in an embedded Redis). With --switch-early (a 10 M fill: a
switch at its end would hold every float and the build at once) the inserting store itself carries that
policy and the job runs beside the fill once it crosses the threshold, as a worker's loop would, so the
server indexes each segment as it seals; after the fill the bench times the wait until the index covers
every row. The queries are then
timed once per --nprobe (IVF) or --ef (HNSW) value, and, when the rows use another consistency, once at
the service's default Strong. Each further index replaces the previous one (release, drop, build, load).
Searches run one at a time, as the worker does, after 10 untimed warm-up queries. Memory: the Milvus
process's RSS at its peak during the fill and once each index is loaded, and its data directory's size.
One server per size. Cores may be shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import format_table, percentile
from models.calibration import FaceScoreCalibration
from models.embedder import FUSED_DIM
from serve_app.domain.faces import GalleryEntry
from serve_app.launch.embedded import EmbeddedMilvus, EmbeddedRedis
from serve_app.pipelines.index_switch import IndexSwitch, SwitchPolicy, lease_name
from serve_app.settings import MilvusSettings
from serve_app.stores.milvus_gallery import (
    CONSISTENCY_LEVELS,
    LARGE_INDEXES,
    IndexPolicy,
    MilvusGalleryStore,
)
from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_support import connect_redis

DIM = FUSED_DIM  # face model v2
CHUNK = 10_000
PHOTOS_PER_PERSON = 5
# Generator parameters, fitted to the real embeddings' summary statistics (module docstring).
MEAN_NORM = 0.8  # the direction every face shares: stranger cosines centre on ~0.64
CENTRE_VARIANCE = 0.23  # between people: same-person cosine ~0.64 + 0.23
SPECTRUM_DECAY = 0.6  # centre variance along the k-th direction ~ k^-0.6
NOISE_VARIANCE = 1.0 - MEAN_NORM**2 - CENTRE_VARIANCE  # within a person; unit norm on average
NOISE_SPREAD = 0.2  # sd of the log of a photo's noise scale
BIG, SMALL = "tenant-big", "tenant-small"
MODEL_VERSION = "bench"
SEED = 20261123
K = 10


SMALL_EVERY = 100  # every 100th chunk is the small tenant's (1 % of the rows); --small-share sets it


def chunk_tenant(index: int) -> str:
    return SMALL if index % SMALL_EVERY == SMALL_EVERY - 1 else BIG


@functools.cache
def face_space() -> tuple[np.ndarray, np.ndarray]:
    """The shared mean direction (norm MEAN_NORM) and the centres' scaled principal directions (rows)."""
    rng = np.random.default_rng([SEED, 99])
    mean = rng.standard_normal(DIM)
    mean *= MEAN_NORM / np.linalg.norm(mean)
    basis = np.linalg.qr(rng.standard_normal((DIM, DIM)))[0]
    variances = np.arange(1, DIM + 1, dtype=np.float64) ** -SPECTRUM_DECAY
    variances *= CENTRE_VARIANCE / variances.sum()
    return mean.astype(np.float32), (basis * np.sqrt(variances)).T.astype(np.float32)


def chunk_centres(index: int, chunk: int) -> np.ndarray:
    """The people of a chunk: mean plus a centre drawn from the decaying spectrum (not unit length)."""
    rng = np.random.default_rng([SEED, chunk, index, 0])
    mean, directions = face_space()
    return mean + rng.standard_normal((chunk // PHOTOS_PER_PERSON, DIM), dtype=np.float32) @ directions


def photos(centres: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One unit vector per centre row: the centre plus this photo's noise."""
    scale = np.exp(rng.standard_normal((len(centres), 1)) * NOISE_SPREAD - NOISE_SPREAD**2)  # E[scale^2] = 1
    noise = rng.standard_normal(centres.shape, dtype=np.float32) * np.sqrt(NOISE_VARIANCE / DIM) * scale
    vectors = (centres + noise).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def chunk_vectors(index: int, chunk: int) -> np.ndarray:
    rng = np.random.default_rng([SEED, chunk, index, 1])
    return photos(np.repeat(chunk_centres(index, chunk), PHOTOS_PER_PERSON, axis=0), rng)


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
        probes[q] = photos(centres[rng.integers(0, len(centres))][None], rng)[0]
    return Queries(tenant, probes, np.full((count, K), -np.inf, np.float32), np.zeros((count, K), np.int64))


@dataclass
class Fill:
    rate: float  # rows per second, the whole fill (a switch during it included)
    switch: tuple[int, float] | None  # (rows when it started, seconds it ran) of a switch beside the fill
    peak_rss_mib: float  # the server's largest RSS seen between chunks


async def fill(
    store: MilvusGalleryStore,
    size: int,
    chunk: int,
    queries: list[Queries],
    server: Server,
    switch_job: tuple[IndexSwitch, int] | None = None,
) -> Fill:
    """Insert `size` rows, a chunk per call of store.add; switch_job: (the job, rows past which it runs
    beside the inserts, as a worker's loop starts it)."""
    started = time.perf_counter()
    now = time.time()
    switch: tuple[int, float] | None = None
    running: tuple[asyncio.Task[Any], int, float] | None = None
    peak = 0.0
    for index in range(size // chunk):
        tenant, vectors = chunk_tenant(index), chunk_vectors(index, chunk)
        first = index * chunk
        await store.add(
            [GalleryEntry(f"f{first + i}", tenant, MODEL_VERSION, vectors[i], now) for i in range(chunk)]
        )
        if switch_job is not None and running is None and first + chunk > switch_job[1]:
            running = (
                asyncio.create_task(switch_job[0].run_once("bench")),
                first + chunk,
                time.perf_counter(),
            )
        if running is not None and running[0].done() and switch is None:
            running[0].result()
            switch = (running[1], time.perf_counter() - running[2])
            print(
                f"  switched to {store.index_type} from {switch[0]:,} rows in {switch[1]:.0f} s", flush=True
            )
        for query in queries:
            if query.tenant == tenant:
                query.update(first, vectors)
        peak = max(peak, rss_mib(server.pid))
        if index % 50 == 49:
            print(f"  inserted {first + chunk:,} rows ({time.perf_counter() - started:.0f} s); "
                  f"{machine_state(server)}", flush=True)  # fmt: skip
    if running is not None and switch is None:
        await running[0]
        switch = (running[1], time.perf_counter() - running[2])
    return Fill(size / (time.perf_counter() - started), switch, peak)


def machine_state(server: Server) -> str:
    """The server's RSS and data directory, and the machine's available memory and load (for the log)."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available_gib = int(meminfo["MemAvailable"].split()[0]) / 2**20
    return (f"server RSS {rss_mib(server.pid):,.0f} MiB, data dir {dir_mib(server.data_dir) / 1024:,.1f} "
            f"GiB, available {available_gib:.1f} GiB, load {os.getloadavg()[0]:.1f}")  # fmt: skip


def wait_indexed(uri: str, collection: str, server: Server) -> str:
    """Flush, then wait until the index covers every row and the query node serves only indexed sealed
    segments (a server indexes sealed segments in the background; growing ones are searched by brute
    force). Returns what the query node holds then."""
    from pymilvus import MilvusClient

    client = MilvusClient(uri=uri, timeout=3600)
    try:
        client.flush(collection, timeout=3600)
        last_print = 0.0
        while True:
            index = client.describe_index(collection, "embedding")
            segments = client.list_loaded_segments(collection)
            loaded = sum(segment.num_rows for segment in segments)
            unindexed = sum(segment.index_id == 0 or segment.state_name != "Sealed" for segment in segments)
            total, indexed = int(index["total_rows"]), int(index["indexed_rows"])
            done = indexed >= total and not index["pending_index_rows"] and loaded >= total and not unindexed
            if done or time.monotonic() - last_print > 60:
                last_print = time.monotonic()
                print(f"  index {index['state']}: {indexed:,} of {total:,} rows indexed; query node: "
                      f"{len(segments)} segments, {loaded:,} rows, {unindexed} not (yet) indexed; "
                      f"{machine_state(server)}", flush=True)  # fmt: skip
            if done:
                sizes = sorted(segment.num_rows for segment in segments)
                return f"{len(segments)} sealed segments of {sizes[0]:,} to {sizes[-1]:,} rows"
            time.sleep(10)
    finally:
        client.close()


def match_bar(tenant_rows: int) -> float:
    """The cosine the service's matches must reach in a gallery of this size (default FPIR)."""
    calibration = FaceScoreCalibration.load()
    return calibration.cosine_for_score(calibration.min_score_for_gallery(tenant_rows))


@dataclass(frozen=True)
class Recall:
    at_k: float  # recall@10 against the exact top 10
    matches: float  # share of the exact matches (top 10 at or above the bar) the index returned
    matches_per_query: float  # mean number of exact matches per query


async def time_searches(
    store: MilvusGalleryStore, queries: Queries, bar: float
) -> tuple[list[float], Recall]:
    """Latencies (ms, warm-up excluded) and recalls of the queries, one search at a time."""
    for warm in queries.probes[:10]:
        await store.search(queries.tenant, warm, K, -1.0)
    timings: list[float] = []
    hits = found_matches = matches_total = 0
    for probe, truth, scores in zip(queries.probes, queries.best_ids, queries.best_scores, strict=True):
        exact = {int(t) for t, score in zip(truth, scores, strict=True) if score >= bar}
        matches_total += len(exact)
        started = time.perf_counter()
        matches = await store.search(queries.tenant, probe, K, -1.0)
        timings.append((time.perf_counter() - started) * 1000)
        hits += len({int(m.face_id[1:]) for m in matches} & {int(t) for t in truth})
        found_matches += len({int(m.face_id[1:]) for m in matches if m.similarity >= bar} & exact)
    count = len(queries.probes)
    return timings, Recall(hits / (K * count), found_matches / max(1, matches_total), matches_total / count)


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def dir_mib(path: Path) -> float:
    total = 0
    for file in path.rglob("*"):
        with contextlib.suppress(OSError):  # the server may remove a file meanwhile
            if file.is_file() and not file.is_symlink():
                total += file.stat().st_size
    return total / 2**20


@dataclass
class Server:
    uri: str
    pid: int | None
    data_dir: Path
    name: str


# The server's settings that differ from the wheel's. Bounds on its disk (its defaults suit a service, not
# a 10 M fill on one disk): files of compacted-away segments and dropped indexes go after a minute rather
# than 3 h, and the message log (rocksmq, the write-ahead log) keeps at most 2 GiB / 30 min.
SERVER_SETTINGS: dict[str, str | int | float] = {
    "dataCoord.gc.interval": 60,
    "dataCoord.gc.dropTolerance": 60,
    "rocksmq.retentionSizeInMB": 2048,
    "rocksmq.retentionTimeInMinutes": 30,
    "rocksmq.compactionInterval": 600,
    # Segments seal at 90 % of their 512 MB rather than 23 %: each is indexed once at its full size,
    # instead of once small and again when compaction merges the small ones (a k-means per build).
    "dataCoord.segment.sealProportion": 0.9,
}


@contextlib.contextmanager
def milvus(backend: str, scratch: Path) -> Iterator[Server]:
    """One fresh server per size: its RSS and data directory figures are that size's alone."""
    if backend == "lite":
        lite = EmbeddedMilvus(scratch)
        lite.start()
        try:
            yield Server(lite.uri, lite.pid, scratch, "milvus-lite 2.5.1")
        finally:
            lite.stop()
        return
    from tests import netns
    from tests.milvus_server import MilvusServerProcess

    why = netns.available()
    if why:
        raise SystemExit(f"--backend server: {why}")
    tag = os.getpid() % 250
    link = netns.Link(None, f"fsbv{os.getpid() % 100000}", f"10.252.{tag}.1", f"10.252.{tag}.2", prefix=30)
    link.create()
    server = MilvusServerProcess(scratch, 19530, host=link.address_b, netns=link.b, settings=SERVER_SETTINGS)
    try:
        server.start()
        yield Server(server.uri, server.binary_pid, scratch, "Milvus 2.3.5 standalone (milvus wheel)")
    finally:
        server.stop()
        link.teardown()


def rebuild(uri: str, collection: str, index: str, params: dict[str, int]) -> None:
    """Replace the collection's index (release, drop, build, load), as the store's switch does."""
    from pymilvus import MilvusClient

    client = MilvusClient(uri=uri, timeout=3600)
    try:
        client.release_collection(collection)
        client.drop_index(collection, "embedding")
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="embedding", index_type=index, metric_type="IP", params=params)
        client.create_index(collection, index_params, timeout=3600)
        client.load_collection(collection, timeout=3600)
    finally:
        client.close()


async def bench_size(
    server: Server, redis_url: str, size: int, args: argparse.Namespace
) -> tuple[list[list[str]], list[str]]:
    """redis_url: where the index switch's lease is kept."""
    chunk = min(CHUNK, size // SMALL_EVERY)  # at least SMALL_EVERY chunks: the small tenant gets its share
    chunks = size // chunk
    queries = [
        make_queries(BIG, [c for c in range(chunks) if chunk_tenant(c) == BIG], chunk, args.queries),
        make_queries(SMALL, [c for c in range(chunks) if chunk_tenant(c) == SMALL], chunk, args.queries),
    ]
    bars = {
        tenant: match_bar(chunk * sum(chunk_tenant(c) == tenant for c in range(chunks)))
        for tenant in (BIG, SMALL)
    }
    notes = [f"match bar: cosine {bars[BIG]:.4f} ({BIG}), {bars[SMALL]:.4f} ({SMALL})"]
    print(f"  {notes[0]}", flush=True)
    collection = f"bench_{size}"
    common: dict[str, Any] = {
        "collection": collection, "model_version": MODEL_VERSION, "dimension": DIM, "timeout_s": 600,
        "consistency_level": args.consistency,
    }  # fmt: skip
    build_params = {"nlist": args.nlist} if args.nlist else {}

    def policy_for(index: str) -> IndexPolicy:
        return IndexPolicy(min(args.flat_max_rows, size - 1), index, build_params=build_params)

    # Filled under exact search and switched once at the end, or (--switch-early) switched beside the fill
    # once it crosses --flat-max-rows, as the service's workers do.
    store = MilvusGalleryStore(
        server.uri, index_policy=policy_for(args.indexes[0]) if args.switch_early else None, **common
    )
    redis = connect_redis(redis_url)

    def switch_job(gallery: MilvusGalleryStore) -> IndexSwitch:
        lease = RedisLease(redis, lease_name(gallery), prefix="bench:")
        return IndexSwitch(gallery, lease, SwitchPolicy(every_s=0))

    rows: list[list[str]] = []

    def row(label: str, index: str, params: str, timings: list[float], recall: Recall) -> list[str]:
        return [f"{size:,}", label, index, params, f"{statistics.median(timings):.1f}",
                f"{percentile(timings, 95):.1f}", f"{recall.at_k:.4f}", f"{recall.matches:.4f}",
                f"{recall.matches_per_query:.2f}"]  # fmt: skip

    async def time_index(index: str, policy: IndexPolicy, key: str, values: list[int]) -> None:
        for value in values:
            tuned = MilvusGalleryStore(
                server.uri, index_policy=dataclasses.replace(policy, search_params={key: value}), **common
            )
            try:
                for query in queries:
                    timings, recall = await time_searches(tuned, query, bars[query.tenant])
                    rows.append(row(query.tenant, index, f"{key}={value}", timings, recall))
            finally:
                await tuned.close()
        if args.consistency != "Strong":  # what the service's default consistency adds
            strong = MilvusGalleryStore(
                server.uri, index_policy=dataclasses.replace(policy, search_params={key: values[0]}),
                **{**common, "consistency_level": "Strong"},
            )  # fmt: skip
            try:
                short = dataclasses.replace(queries[0], probes=queries[0].probes[:60],
                                            best_ids=queries[0].best_ids[:60],
                                            best_scores=queries[0].best_scores[:60])  # fmt: skip
                timings, recall = await time_searches(strong, short, bars[BIG])
                rows.append(row(BIG, index, f"{key}={values[0]}, Strong", timings, recall))
            finally:
                await strong.close()

    try:
        early = (switch_job(store), policy_for(args.indexes[0]).flat_max_rows) if args.switch_early else None
        filled = await fill(store, size, chunk, queries, server, early)
        insert_rate = filled.rate
        print(f"  {size:,} rows at {insert_rate:,.0f} rows/s", flush=True)
        notes.append(f"insert {insert_rate:,.0f} rows/s, server RSS peak {filled.peak_rss_mib:,.0f} MiB")
        if filled.switch is not None:
            rows_at, seconds = filled.switch
            notes.append(f"{store.index_type}: switch at {rows_at:,} rows {seconds:.0f} s")
        if args.switch_early:
            started = time.perf_counter()
            held = await asyncio.to_thread(wait_indexed, server.uri, store.collection, server)
            waited = time.perf_counter() - started
            notes.append(f"{store.index_type}: flush and index wait after the fill {waited:.0f} s ({held}), "
                         f"RSS {rss_mib(server.pid):,.0f} MiB loaded")  # fmt: skip
            print(f"  {notes[-1]}", flush=True)
        elif not args.skip_flat:
            for query in queries:
                timings, recall = await time_searches(store, query, bars[query.tenant])
                rows.append(row(query.tenant, "FLAT", "-", timings, recall))
            notes.append(f"RSS {rss_mib(server.pid):,.0f} MiB with FLAT")
    finally:
        await store.close()

    for position, index in enumerate(args.indexes):
        policy = policy_for(index)
        started = time.perf_counter()
        if position == 0 and args.switch_early:
            assert store.index_type == index, store.index_type
        elif position == 0 and args.backend == "server":
            switched = MilvusGalleryStore(server.uri, index_policy=policy, **common)
            await switch_job(switched).run_once("bench")  # finds the collection past its threshold, switches
            assert switched.index_type == index, switched.index_type
            await switched.close()
        else:
            # Built directly on milvus-lite, whose collections the store keeps FLAT: this bench is the
            # only client writing, so the build loses no concurrent insert.
            build = {"HNSW": {"M": 16, "efConstruction": 200}}.get(index, {"nlist": args.nlist or 1024})
            await asyncio.to_thread(rebuild, server.uri, store.collection, index, build)
        if not (position == 0 and args.switch_early):
            build_s = time.perf_counter() - started
            notes.append(f"{index}: build+load {build_s:.0f} s, RSS {rss_mib(server.pid):,.0f} MiB loaded")
            print(f"  {notes[-1]}", flush=True)
        key, values = ("ef", args.ef) if index == "HNSW" else ("nprobe", args.nprobe)
        await time_index(index, policy, key, values)
    await redis.aclose()
    notes.append(f"data dir {dir_mib(server.data_dir):,.0f} MiB")
    notes.append(f"1-min load average at the end: {os.getloadavg()[0]:.1f}")
    print(f"  N={size:,}: " + "; ".join(notes), flush=True)
    return rows, notes


async def main_async(args: argparse.Namespace) -> None:
    rows: list[list[str]] = []
    notes: list[str] = []
    name = ""
    for size in args.sizes:
        with (
            tempfile.TemporaryDirectory(prefix="bench-milvus-", dir=args.data_dir) as scratch,
            milvus(args.backend, Path(scratch)) as server,
            EmbeddedRedis(Path(scratch) / "redis") as redis_server,  # the index switch's lease
        ):
            name = server.name
            size_rows, size_notes = await bench_size(server, redis_server.url, size, args)
            rows += size_rows
            notes.append(f"N={size:,}: " + "; ".join(size_notes))
    header = ["N", "searched tenant", "index", "search", "p50 ms", "p95 ms", "recall@10", "match recall"]
    header.append("matches/q")
    print(
        f"\n{name}, {DIM}-d face-like unit vectors, IP, top {K}, {args.queries} queries per row, one at a "
        f"time, consistency {args.consistency}; small tenant {1 / SMALL_EVERY:.1%} of the rows"
    )
    print(format_table(header, rows))
    for note in notes:
        print(note)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["lite", "server"], default="lite")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    parser.add_argument(
        "--indexes", nargs="+", choices=LARGE_INDEXES, default=None,
        help="default: IVF_FLAT on lite (no HNSW there), HNSW IVF_SQ8 on a server",
    )  # fmt: skip
    parser.add_argument("--ef", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--small-share", type=float, default=0.01, help="the small tenant's share of rows")
    parser.add_argument(
        "--consistency", choices=CONSISTENCY_LEVELS, default=None,
        help="of the timed searches; default Bounded on a server, Strong on lite",
    )  # fmt: skip
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--flat-max-rows", type=int, default=MilvusSettings().flat_max_rows)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--skip-flat", action="store_true", help="skip the exact-search timings")
    parser.add_argument(
        "--switch-early", action="store_true",
        help="the inserting store switches to the first of --indexes at --flat-max-rows (as the service "
        "does), so the server indexes segments as they seal; the wait for the rest is timed after the fill",
    )  # fmt: skip
    parser.add_argument(
        "--nlist", type=int, default=None, help="IVF build parameter (default: the store's, 1024)"
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="where the servers keep their data")
    args = parser.parse_args()
    global SMALL_EVERY
    if not 0 < args.small_share <= 0.5:
        parser.error("--small-share must be in (0, 0.5]")
    SMALL_EVERY = round(1 / args.small_share)
    server = args.backend == "server"
    args.indexes = args.indexes or (["HNSW", "IVF_SQ8"] if server else ["IVF_FLAT"])
    args.consistency = args.consistency or ("Bounded" if server else "Strong")
    if args.switch_early and args.skip_flat is False:
        parser.error("--switch-early times no exact search: add --skip-flat")
    if args.switch_early and not server:
        parser.error("--switch-early needs --backend server: the gallery store keeps milvus-lite FLAT")
    if any(size % min(CHUNK, size // SMALL_EVERY) or size < 100 * SMALL_EVERY for size in args.sizes):
        parser.error(f"sizes must be multiples of {CHUNK} (or of the small share of the size)")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
