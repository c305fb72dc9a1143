"""The gallery's index switch under load, and what read-your-enrolment costs a search, on a Milvus server.

    python -m bench.index_switch [--sizes 200000 1000000] [--searches 200] [--data-dir DIR]

Needs root (the Milvus 2.3.5 server of the `milvus` wheel runs in a network namespace of its own, as in
bench/vector_search.py, with its SERVER_SETTINGS) and an embedded Redis. Per size, on a fresh server:

1. Fill: `size` face-like 256-d vectors (bench.vector_search's generator; 10 % of the rows in a small
   tenant) through MilvusGalleryStore, whose policy switches FLAT -> IVF_FLAT (nlist 1024, nprobe 64) past
   `size` rows, so the collection is FLAT and exactly at its threshold.
2. Switch: two searching clients (each a replica's store, one query at a time, known vectors of both
   tenants) and one enrolling client (an enrolment, then at once a search for it from the other replica)
   run throughout; the first enrolment crosses the threshold and starts the switch in the background.
   Timed: from that enrolment until the new index serves (the served name moved), and until the switch is
   done (a write's window later the old collection is dropped). Memory: the server's RSS before the switch and
   its peak during it (sampled every 0.5 s). Counted: searches and enrolments, failed searches (an error,
   or a known face not found first), enrolments not found at once by the other replica, and, after the
   switch, rows missing or twice in the served collection (lost enrolments), all rows read back.
3. Search p50 on the switched collection, the small tenant's queries, one at a time, the levels
   interleaved query by query: Strong (the service's default before), "Tenant" (the tenant's last write
   timestamp as the guarantee, read from Redis: what the service does now) a while after the tenant's last
   enrolment, "Tenant" straight after an enrolment of that tenant (the one case that waits for a time
   tick), and Bounded (no guarantee; a new face is searchable only after up to gracefulTime, 5 s).

Runtime is bounded by the sizes: ~1 min per 100,000 rows on 2 shared cores for fill and switch (the
IVF_FLAT build dominates past 200,000). Cores may be shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import format_table
from bench.vector_search import BIG, DIM, SMALL, chunk_vectors, milvus, rss_mib
from serve_app.domain.faces import GalleryEntry
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_lease import RedisLeases
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_tenant_clock import RedisTenantClock
from tests.integration.gallery_support import gallery_rows

CHUNKS = 100  # rows are made in 100 chunks of people; every 10th chunk is the small tenant's (10 %)
VERSION = "bench"


def tenant_of(chunk: int) -> str:
    return SMALL if chunk % 10 == 9 else BIG


class PeakRss:
    """The largest RSS of a process seen every 0.5 s while running (a context manager)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def bench_size(uri: str, pid: int | None, redis_url: str, size: int, searches: int) -> dict[str, str]:
    redis = connect_redis(redis_url)
    leases = RedisLeases(redis, prefix=f"bench{size}:")
    clock = RedisTenantClock(redis, prefix=f"bench{size}:")
    policy = IndexPolicy(flat_max_rows=size, large_index="IVF_FLAT")

    def open_store(**options: Any) -> MilvusGalleryStore:
        return MilvusGalleryStore(
            uri, collection=f"switch{size}", model_version=VERSION, dimension=DIM, **options
        )

    writer, reader = (
        open_store(index_policy=policy, switch_leases=leases, write_clock=clock) for _ in range(2)
    )
    known: dict[str, list[tuple[str, np.ndarray]]] = {BIG: [], SMALL: []}
    chunk_rows = size // CHUNKS
    started = time.perf_counter()
    for chunk in range(CHUNKS):
        tenant, vectors = tenant_of(chunk), chunk_vectors(chunk, chunk_rows)
        entries = [GalleryEntry(f"c{chunk}-{i}", tenant, VERSION, v, 0.0) for i, v in enumerate(vectors)]
        for start in range(0, chunk_rows, 2000):
            await writer.add(entries[start : start + 2000])
        known[tenant] += [(entries[i].face_id, entries[i].embedding) for i in (0, chunk_rows // 2)]
    fill_s = time.perf_counter() - started
    assert writer.index_type == "FLAT", writer.index_type
    rss_before = rss_mib(pid)
    failed: list[str] = []
    failed_enrolments: list[str] = []
    missed: list[str] = []
    enrolled: dict[str, str] = {}
    counts = {"searches": 0}
    stop, first_enrolment = asyncio.Event(), asyncio.Event()
    rng = np.random.default_rng(size)

    async def search_load(store: MilvusGalleryStore) -> None:
        while not stop.is_set():
            tenant = BIG if rng.random() < 0.5 else SMALL
            face_id, vector = known[tenant][int(rng.integers(len(known[tenant])))]
            try:
                matches = await store.search(tenant, vector, 10, -1.0)
            except Exception as error:  # a failed search is the finding
                failed.append(repr(error)[:200])
                continue
            counts["searches"] += 1
            if not matches or matches[0].face_id != face_id:
                failed.append(f"{face_id} not first: {matches[:1]}")

    async def enrol_load() -> None:
        number = 0
        while not stop.is_set():
            tenant = SMALL if number % 2 else BIG
            vector = chunk_vectors(10_000 + number, 10)[0]
            face_id = f"e{number}"
            number += 1
            try:
                await writer.add([GalleryEntry(face_id, tenant, VERSION, vector, time.time())])
            except Exception as error:  # a client would retry: the finding is that it had to
                failed_enrolments.append(repr(error)[:200])
                continue
            enrolled[face_id] = tenant
            first_enrolment.set()
            try:
                matches = await reader.search(tenant, vector, 1, -1.0)
            except Exception as error:
                failed.append(repr(error)[:200])
                continue
            if [m.face_id for m in matches] != [face_id]:
                missed.append(face_id)
            await asyncio.sleep(0.05)

    with PeakRss(pid) as peak:
        switch_started = time.perf_counter()
        coroutines = (search_load(writer), search_load(reader), enrol_load())
        loads = [asyncio.create_task(coroutine) for coroutine in coroutines]
        await first_enrolment.wait()  # it crossed the threshold: the switch runs in the background
        switching = asyncio.create_task(writer.switch_index_if_due())
        while not switching.done():
            if writer.index_type != "FLAT":
                break
            await asyncio.sleep(0.1)
        serving_s = time.perf_counter() - switch_started  # the served name names the new collection
        await switching
        switch_s = time.perf_counter() - switch_started
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*loads)
    assert writer.index_type == "IVF_FLAT", writer.index_type
    rows = await gallery_rows(uri, writer.collection)
    expected = {(tenant_of(c), f"c{c}-{i}") for c in range(CHUNKS) for i in range(chunk_rows)}
    expected |= {(tenant, face_id) for face_id, tenant in enrolled.items()}
    lost = len(expected - set(rows)) + (len(rows) - len(set(rows)))  # missing, or there twice

    # Search p50 by consistency level on the switched collection (the small tenant, interleaved).
    strong, bounded = (open_store(consistency_level=level) for level in ("Strong", "Bounded"))
    timings: dict[str, list[float]] = {"Strong": [], "Tenant": [], "Tenant after enrol": [], "Bounded": []}
    probes = known[SMALL]
    for store in (strong, bounded, reader):
        await store.search(SMALL, probes[0][1], 10, -1.0)  # connected
    await asyncio.sleep(1)
    for number in range(searches):
        vector = probes[number % len(probes)][1]
        for label, store in (("Strong", strong), ("Tenant", reader), ("Bounded", bounded)):
            began = time.perf_counter()
            await store.search(SMALL, vector, 10, -1.0)
            timings[label].append((time.perf_counter() - began) * 1000)
        if number % 4 == 0:  # fewer: each makes the tenant's next searches wait too
            new = chunk_vectors(20_000 + number, 10)[0]
            await writer.add([GalleryEntry(f"p{number}", SMALL, VERSION, new, time.time())])
            began = time.perf_counter()
            await reader.search(SMALL, new, 10, -1.0)
            timings["Tenant after enrol"].append((time.perf_counter() - began) * 1000)
            await asyncio.sleep(1)  # the tenant's last write is a while ago again
    for store in (writer, reader, strong, bounded):
        await store.close()
    await redis.aclose()
    return {
        "rows": f"{size:,}",
        "fill s": f"{fill_s:.0f}",
        "new index serves after s": f"{serving_s:.0f}",
        "switch done after s": f"{switch_s:.0f}",
        "RSS before MiB": f"{rss_before:,.0f}",
        "RSS peak MiB": f"{peak.peak:,.0f}",
        "RSS after MiB": f"{rss_mib(pid):,.0f}",
        "searches": str(counts["searches"]),
        "failed searches": str(len(failed)),
        "enrolments": str(len(enrolled)),
        "failed enrolments": str(len(failed_enrolments)),
        "not found at once": str(len(missed)),
        "lost enrolments": str(lost),
        **{f"p50 {label} ms": f"{statistics.median(values):.1f}" for label, values in timings.items()},
        "failures": "; ".join((failed + failed_enrolments)[:3]),
    }


async def main_async(args: argparse.Namespace) -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-switch-", dir=args.data_dir) as scratch:
        redis = EmbeddedRedis(Path(scratch) / "redis")
        redis.start()
        try:
            for size in args.sizes:
                with milvus("server", Path(scratch) / f"milvus-{size}") as server:
                    result = await bench_size(server.uri, server.pid, redis.url, size, args.searches)
                    print(result, flush=True)
                    results.append(result)
        finally:
            redis.stop()
    switch = ["rows", "fill s", "new index serves after s", "switch done after s",
              "RSS before MiB", "RSS peak MiB", "RSS after MiB", "searches",
              "failed searches", "enrolments", "failed enrolments", "not found at once",
              "lost enrolments"]  # fmt: skip
    print("\nIndex switch FLAT -> IVF_FLAT under load (Milvus 2.3.5 server, 256-d, nlist 1024):")
    print(format_table(switch, [[r[key] for key in switch] for r in results]))
    p50 = ["rows", *(key for key in results[0] if key.startswith("p50"))]
    print(f"\nSearch p50 by consistency, small tenant, IVF_FLAT nprobe 64, {args.searches} searches each:")
    print(format_table(p50, [[r[key] for key in p50] for r in results]))
    for result in results:
        if result["failures"]:
            print(f"{result['rows']}: {result['failures']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--searches", type=int, default=200, help="per consistency level, for the p50 table")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the servers keep their data")
    args = parser.parse_args()
    if any(size % (CHUNKS * 10) for size in args.sizes):
        parser.error(f"sizes must be multiples of {CHUNKS * 10}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
