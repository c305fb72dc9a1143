"""The gallery at scale, on milvus-lite and on a Milvus server (the `gallery_backend` fixture) through the
store interface: tenants never see each other's faces (on the server through the tenant partition key), and
the index-switch job (pipelines/index_switch.py, run here as a worker's loop runs it) switches a server's
collection FLAT -> IVF_FLAT exactly past its threshold, one replica at a time, while search results stay
those of exact search (milvus-lite stays FLAT); a switch whose holder died is taken over within the lease.
(The recall of approximate indexes on large collections is bench/vector_search.py's business.)"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from redis.asyncio import Redis

from serve_app.domain.faces import GalleryEntry
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.index_switch import IndexSwitch, SwitchPolicy, SwitchReport, lease_name
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_tenant_clock import RedisTenantClock
from tests.integration import switch_holder
from tests.integration.conftest import GalleryBackend
from tests.integration.gallery_support import gallery_rows

DIM = 32
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
THRESHOLD = 900  # rows; small so the test stays quick, the mechanism is the one used at millions
NLIST = 16
# A switch waits out the writes other replicas began before it; where the switching store is the only
# writer there are none, and the default wait (tens of seconds) would only slow the test. The tests with
# several writers keep the default.
SINGLE_WRITER_WINDOW_S = 1.0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("gallery-scale-redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def fresh(name: str) -> str:
    return f"{name}_{uuid.uuid4().hex[:8]}"


def clustered(rng: np.random.Generator, count: int, centres: np.ndarray) -> np.ndarray:
    """Unit vectors around a few centres, like several photos of each of many people."""
    picks = centres[rng.integers(0, len(centres), count)]
    vectors = picks + rng.standard_normal((count, DIM)).astype(np.float32) * 0.3
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def large_index(backend: GalleryBackend) -> str:
    """The index a policy asking for IVF_FLAT gives past its threshold: milvus-lite stays FLAT."""
    return "IVF_FLAT" if backend.server else "FLAT"


def switch_job(store: MilvusGalleryStore, redis: Redis) -> IndexSwitch:
    """The index-switch job on `store`, as a worker's loop builds it, looking at the size at every pass."""
    lease = RedisLease(redis, lease_name(store), prefix=f"{store.collection}:")
    return IndexSwitch(store, lease, SwitchPolicy(lease_s=30.0, every_s=0.0, poll_s=0.2))


async def switch_pass(
    store: MilvusGalleryStore, redis: Redis, holder: str = "replica"
) -> SwitchReport | None:
    """One pass of the job, as a worker's loop runs it (None: another replica holds the switch)."""
    return await switch_job(store, redis).run_once(holder)


def exact_top(vectors: np.ndarray, ids: list[str], probe: np.ndarray, k: int) -> list[str]:
    scores = vectors @ probe
    return [ids[i] for i in np.argsort(-scores)[:k]]


def test_tenants_never_mix_and_index_switches_at_threshold(
    gallery_backend: GalleryBackend, redis_url: str
) -> None:
    rng = np.random.default_rng(12)
    centres = rng.standard_normal((40, DIM)).astype(np.float32)
    # Every tenant draws from the same centres, and tenant-b holds exact twins of tenant-a's first
    # vectors: a search that leaked across tenants would rank a foreign twin first.
    per_tenant = {tenant: clustered(rng, THRESHOLD // 3, centres) for tenant in TENANTS}
    per_tenant["tenant-b"][:50] = per_tenant["tenant-a"][:50]
    extra = clustered(rng, 30, centres)  # tenant-a's rows that cross the threshold
    policy = IndexPolicy(
        flat_max_rows=THRESHOLD,
        large_index="IVF_FLAT",  # asked for explicitly; milvus-lite keeps FLAT all the same
        build_params={"nlist": NLIST},
        search_params={"nprobe": NLIST},  # all lists probed: IVF must then agree with exact search
    )

    def entries(tenant: str, vectors: np.ndarray, first: int) -> list[GalleryEntry]:
        return [
            GalleryEntry(f"{tenant}-{first + i}", tenant, "v1", vector, time.time())
            for i, vector in enumerate(vectors)
        ]

    async def check_search(store: MilvusGalleryStore, stored: dict[str, np.ndarray]) -> None:
        for tenant, vectors in stored.items():
            ids = [f"{tenant}-{i}" for i in range(len(vectors))]
            for row in rng.integers(0, len(vectors), 12):
                probe = vectors[row] + rng.standard_normal(DIM).astype(np.float32) * 0.05
                probe /= np.linalg.norm(probe)
                matches = await store.search(tenant, probe, 10, -1.0)
                assert all(match.face_id.startswith(f"{tenant}-") for match in matches), matches
                assert [m.face_id for m in matches] == exact_top(vectors, ids, probe, 10)
                expected = float(vectors[ids.index(matches[0].face_id)] @ probe)
                assert matches[0].similarity == pytest.approx(expected, abs=1e-4)

    collection = fresh("scale")

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store = MilvusGalleryStore(
            gallery_backend.uri, collection=collection, model_version="v1", dimension=DIM,
            index_policy=policy, write_window_s=SINGLE_WRITER_WINDOW_S,
        )  # fmt: skip
        try:
            for tenant, vectors in per_tenant.items():
                await store.add(entries(tenant, vectors, 0))
            assert len(await gallery_rows(gallery_backend.uri, store.collection)) == THRESHOLD
            assert await switch_pass(store, redis) == SwitchReport(False)
            assert store.index_type == "FLAT"  # at the threshold: still exact
            # milvus-lite has no partitions (the store noticed and kept the plain layout); a server's
            # collection has tenant_id as its partition key.
            assert store.partitioned is gallery_backend.server
            await check_search(store, per_tenant)

            # A second process (replica) that does not enforce the policy, opened before the switch.
            bystander = MilvusGalleryStore(
                gallery_backend.uri, collection=collection, model_version="v1", dimension=DIM
            )
            await bystander.page_ids("tenant-a", None, 1)  # connected
            assert bystander.index_type == "FLAT"

            await store.add(entries("tenant-a", extra, THRESHOLD // 3))
            rows = await gallery_rows(gallery_backend.uri, store.collection)
            assert len(rows) == len(set(rows)) == THRESHOLD + len(extra)
            # Past the threshold: the next pass switches (on a server).
            report = await switch_pass(store, redis)
            assert report is not None and report.switched is gallery_backend.server
            assert store.index_type == large_index(gallery_backend)
            grown = {**per_tenant, "tenant-a": np.vstack([per_tenant["tenant-a"], extra])}
            await check_search(store, grown)

            # The bystander searches the new index with the policy-free defaults (nprobe 32 > nlist):
            # still exact, still within its tenant.
            await check_search(bystander, grown)
            await bystander.close()

            # A store opened later sees the switched index; deleting below the threshold keeps it.
            reopened = MilvusGalleryStore(
                gallery_backend.uri,
                collection=collection,
                model_version="v1",
                dimension=DIM,
                index_policy=policy,
            )
            await reopened.page_ids("tenant-a", None, 1)  # connected
            assert reopened.index_type == large_index(gallery_backend)
            await reopened.delete(
                "tenant-a", [f"tenant-a-{i}" for i in range(THRESHOLD // 3, len(grown["tenant-a"]))]
            )
            await check_search(reopened, per_tenant)
            await reopened.close()
        finally:
            await store.close()
            await redis.aclose()

    asyncio.run(scenario())


def test_existing_collection_without_partition_key_keeps_serving(gallery_backend: GalleryBackend) -> None:
    """A collection created without the partition key (the layout before it, or milvus-lite's) is read
    and written as it is by a store that would create new collections with one."""
    rng = np.random.default_rng(5)
    vectors = clustered(rng, 20, rng.standard_normal((4, DIM)).astype(np.float32))

    collection = fresh("legacy")

    async def scenario() -> None:
        old = MilvusGalleryStore(
            gallery_backend.uri, collection=collection, model_version="v1", dimension=DIM, partition_key=False
        )
        await old.add([GalleryEntry(f"old-{i}", "tenant-a", "v1", v, 0.0) for i, v in enumerate(vectors)])
        await old.close()
        new = MilvusGalleryStore(
            gallery_backend.uri, collection=collection, model_version="v1", dimension=DIM
        )
        try:
            await new.page_ids("tenant-a", None, 1)  # connected
            assert new.partitioned is False
            assert [m.face_id for m in await new.search("tenant-a", vectors[3], 1, -1.0)] == ["old-3"]
            await new.add([GalleryEntry("new-0", "tenant-b", "v1", vectors[3], 0.0)])
            assert [m.face_id for m in await new.search("tenant-b", vectors[3], 5, -1.0)] == ["new-0"]
            assert len(await gallery_rows(gallery_backend.uri, new.collection)) == 21
        finally:
            await new.close()

    asyncio.run(scenario())


def test_default_policy_is_ivf_on_a_server_and_exact_on_milvus_lite(
    gallery_backend: GalleryBackend, redis_url: str
) -> None:
    """Without an explicit large index, a Milvus server switches to IVF_FLAT past the threshold, and
    milvus-lite stays FLAT: its IVF_FLAT ignores nprobe, so switching would trade recall for speed without a
    way to buy recall back."""
    rng = np.random.default_rng(9)
    vectors = clustered(rng, 40, rng.standard_normal((4, DIM)).astype(np.float32))

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store = MilvusGalleryStore(
            gallery_backend.uri, collection=fresh("default"), model_version="v1", dimension=DIM,
            index_policy=IndexPolicy(flat_max_rows=10), write_window_s=SINGLE_WRITER_WINDOW_S,
        )  # fmt: skip
        try:
            await store.add([GalleryEntry(f"f{i}", "tenant-a", "v1", v, 0.0) for i, v in enumerate(vectors)])
            assert len(await gallery_rows(gallery_backend.uri, store.collection)) == 40
            await switch_pass(store, redis)
            assert store.index_type == ("IVF_FLAT" if gallery_backend.server else "FLAT")
            assert [m.face_id for m in await store.search("tenant-a", vectors[7], 1, -1.0)] == ["f7"]
        finally:
            await store.close()
            await redis.aclose()

    asyncio.run(scenario())


def test_index_switch_waits_for_the_cluster_wide_lease(
    gallery_backend: GalleryBackend, redis_url: str
) -> None:
    """Replicas switch the index one at a time: while another holds the lease (it is switching), a pass
    past the threshold leaves the index alone; the next pass after the lease is given back switches. Two
    replicas inserting across the threshold and running their passes at once end with one switch, one
    index, every row and exact results on both. (milvus-lite stays FLAT: an index build there lost rows the
    other replica inserted meanwhile.)"""
    rng = np.random.default_rng(31)
    centres = rng.standard_normal((8, DIM)).astype(np.float32)
    vectors = clustered(rng, 60, centres)
    policy = IndexPolicy(
        flat_max_rows=20, large_index="IVF_FLAT", build_params={"nlist": 4}, search_params={"nprobe": 4}
    )
    collection = fresh("lease")
    ids = [f"f{i}" for i in range(len(vectors))]
    entries = [
        GalleryEntry(face_id, "tenant-a", "v1", v, 0.0) for face_id, v in zip(ids, vectors, strict=True)
    ]

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        replicas = [
            MilvusGalleryStore(
                gallery_backend.uri,
                collection=collection,
                model_version="v1",
                dimension=DIM,
                index_policy=policy,
            )
            for _ in range(2)
        ]
        first, second = replicas
        lease = RedisLease(redis, lease_name(first), prefix=f"{first.collection}:")
        try:
            assert await lease.acquire("another-replica", 60)  # another replica "is switching"
            await first.add(entries[:25])  # past the threshold
            assert await switch_pass(first, redis, "replica-1") is None  # the lease is taken
            assert first.index_type == "FLAT"
            await lease.release("another-replica")
            # Both replicas cross again at once and run their passes at once: one switches, the other
            # finds the lease taken or the switch done.
            await asyncio.gather(first.add(entries[25:40]), second.add(entries[40:]))
            reports = await asyncio.gather(
                switch_pass(first, redis, "replica-1"), switch_pass(second, redis, "replica-2")
            )
            switched = [report for report in reports if report is not None and report.switched]
            assert len(switched) == (1 if gallery_backend.server else 0), reports
            for replica in replicas:
                await switch_pass(replica, redis)  # the replica that lost the race notices now
            expected = large_index(gallery_backend)
            assert (first.index_type, second.index_type) == (expected, expected)
            rows = await gallery_rows(gallery_backend.uri, first.collection)
            assert sorted(rows) == sorted(("tenant-a", face_id) for face_id in ids)
            for replica in replicas:
                for row in (3, 30, 55):
                    matches = await replica.search("tenant-a", vectors[row], 5, -1.0)
                    assert [m.face_id for m in matches] == exact_top(vectors, ids, vectors[row], 5)
        finally:
            for replica in replicas:
                await replica.close()
            await redis.aclose()

    asyncio.run(scenario())


def test_index_switch_serves_every_search_and_keeps_every_enrolment(
    milvus_server: str, redis_url: str
) -> None:
    """On a Milvus server (milvus-lite never switches), a switch runs while two replicas search and enrol
    and remove faces: no search fails or misses, each enrolled face is found at once by the other replica
    (read-your-enrolment across replicas, through the tenants' write clock), and at the end the served
    collection holds every enrolled face exactly once and none of the removed ones, under its new index."""
    rng = np.random.default_rng(77)
    centres = rng.standard_normal((40, DIM)).astype(np.float32)
    threshold = 3000
    policy = IndexPolicy(
        flat_max_rows=threshold, large_index="IVF_FLAT", build_params={"nlist": NLIST},
        search_params={"nprobe": NLIST},  # all lists probed: the switch must not change any result
    )  # fmt: skip
    collection = fresh("switch")
    base = clustered(rng, threshold, centres)
    base_faces = {f"b{i}": (TENANTS[i % 3], base[i]) for i in range(threshold)}

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        clock = RedisTenantClock(redis, prefix=f"{collection}:")
        writer, reader = (
            MilvusGalleryStore(
                milvus_server,
                collection=collection,
                model_version="v1",
                dimension=DIM,
                index_policy=policy,
                write_clock=clock,
            )
            for _ in range(2)
        )
        failures: list[str] = []
        enrolled: dict[str, tuple[str, np.ndarray]] = {}
        removed: set[str] = set()
        switching = asyncio.Event()
        stop = asyncio.Event()

        async def search_load() -> int:
            done = 0
            ids = list(base_faces)
            while not stop.is_set():
                face_id = ids[int(rng.integers(len(ids)))]
                tenant, vector = base_faces[face_id]
                try:
                    matches = await reader.search(tenant, vector, 3, -1.0)
                except Exception as error:  # every failure is the finding
                    failures.append(f"search {face_id}: {error!r}")
                    continue
                if not matches or matches[0].face_id != face_id:
                    failures.append(f"search {face_id}: {matches[:1]}")
                done += 1
            return done

        async def enrol_load() -> int:
            number = 0
            while not stop.is_set() or number < 3:
                tenant = TENANTS[number % 3]
                face_id = f"e{number}"
                vector = clustered(rng, 1, centres)[0]
                stores = (writer, reader) if number % 2 == 0 else (reader, writer)
                try:
                    await stores[0].add([GalleryEntry(face_id, tenant, "v1", vector, time.time())])
                    enrolled[face_id] = (tenant, vector)
                    switching.set()
                    matches = await stores[1].search(tenant, vector, 1, -1.0)
                    if [m.face_id for m in matches] != [face_id]:
                        failures.append(f"enrolled {face_id} not found at once: {matches}")
                    if number % 5 == 4:
                        gone = f"e{number - 3}"
                        await stores[1].delete(enrolled[gone][0], [gone])
                        removed.add(gone)
                except Exception as error:
                    failures.append(f"enrol {face_id}: {error!r}")
                number += 1
            return number

        try:
            for start in range(0, threshold, 1000):
                chunk = list(base_faces.items())[start : start + 1000]
                await writer.add([GalleryEntry(f, t, "v1", v, 0.0) for f, (t, v) in chunk])
            assert writer.index_type == "FLAT"
            loads = [asyncio.create_task(search_load()), asyncio.create_task(enrol_load())]
            await switching.wait()  # the first enrolment crossed the threshold: the switch runs meanwhile
            assert writer.index_type == "FLAT"
            report = await switch_pass(writer, redis)
            assert report is not None and report.switched
            assert writer.index_type == "IVF_FLAT"
            await asyncio.sleep(2)  # searches and enrolments after the switch too
            stop.set()
            searches, enrolments = await asyncio.gather(*loads)
            assert failures == [], failures
            assert searches > 0 and enrolments >= 3
            assert await switch_pass(reader, redis) == SwitchReport(False)  # finds the switch done
            assert reader.index_type == "IVF_FLAT"
            rows = await gallery_rows(milvus_server, writer.collection)
            assert len(rows) == len(set(rows))  # no face twice
            expected = {(t, f) for f, (t, _) in base_faces.items()}
            expected |= {(t, f) for f, (t, _) in enrolled.items() if f not in removed}
            assert set(rows) == expected
        finally:
            for store in (writer, reader):
                await store.close()
            await redis.aclose()

    asyncio.run(scenario())


def test_a_switch_whose_holder_died_is_taken_over_within_its_lease_and_completes(
    milvus_server: str, redis_url: str
) -> None:
    """A replica (a process of its own) starts the switch, copies its first page and hangs: alive, it keeps
    the switch past the lease's ttl (another replica's pass finds the lease taken). Then it is killed
    mid-switch: its lease is never given back, only no longer renewed. Within the lease's ttl (seconds
    here, a minute by default; the switch's lease used to last about an hour) another replica's pass takes
    the switch over, goes on from the dead holder's cursor, and completes: the large index serves every
    row, once."""
    rng = np.random.default_rng(53)
    rows = 6 * switch_holder.PAGE_ROWS  # twice the threshold
    vectors = clustered(rng, rows, rng.standard_normal((20, switch_holder.DIM)).astype(np.float32))
    ids = [f"f{i}" for i in range(rows)]
    collection = fresh("takeover")

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        replica = switch_holder.store(milvus_server, collection)
        holder = None
        try:
            await replica.add(
                [GalleryEntry(f, TENANTS[0], "v1", v, 0.0) for f, v in zip(ids, vectors, strict=True)]
            )
            holder = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.integration.switch_holder", milvus_server, redis_url, collection,
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert holder.stdout is not None
            said = await asyncio.wait_for(holder.stdout.readline(), 300)  # a hang guard
            assert said.strip() == b"holding", said
            job = switch_holder.job(replica, redis)
            # Alive though stuck, the holder keeps renewing its lease in the background: past its ttl, the
            # switch is still its own.
            await asyncio.sleep(1.5 * switch_holder.LEASE_S)
            assert await job.run_once("replica-b") is None
            holder.kill()  # dies mid-switch
            await holder.wait()
            killed = time.monotonic()
            report = None
            while report is None:
                assert time.monotonic() - killed < 30 * switch_holder.LEASE_S, "never taken over"
                await asyncio.sleep(0.2)
                started = time.monotonic() - killed
                report = await job.run_once("replica-b")
            print(
                f"\ntaken over by the pass started {started:.1f} s after the holder died (lease "
                f"{switch_holder.LEASE_S:.0f} s); switched {time.monotonic() - killed:.1f} s after it died"
            )
            assert report.switched and report.resumed
            assert 0 < report.copied < rows  # from the dead holder's cursor on, not from the start
            assert replica.index_type == "IVF_FLAT"
            served = await gallery_rows(milvus_server, replica.collection)
            assert sorted(served) == sorted((TENANTS[0], face_id) for face_id in ids)
            for row in (5, 250, 590):
                matches = await replica.search(TENANTS[0], vectors[row], 5, -1.0)
                assert [m.face_id for m in matches] == exact_top(vectors, ids, vectors[row], 5)
        finally:
            if holder is not None and holder.returncode is None:
                holder.kill()
                await holder.wait()
            await replica.close()
            await redis.aclose()

    asyncio.run(scenario())


def test_an_enrolled_face_is_found_at_once_by_another_replica(
    gallery_backend: GalleryBackend, redis_url: str
) -> None:
    """The documented contract (a face is searchable once its enrolment is answered) at the "Tenant"
    consistency level: each enrolment is searched for at once by a second replica, many times in a row, and
    is found; the search waited for the tenant's write timestamp in Redis, not for Strong (on a server;
    milvus-lite searches Strong)."""
    rng = np.random.default_rng(41)
    centres = rng.standard_normal((8, DIM)).astype(np.float32)
    collection = fresh("ryw")

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        clock = RedisTenantClock(redis, prefix=f"{collection}:")
        writer, reader = (
            MilvusGalleryStore(
                gallery_backend.uri,
                collection=collection,
                model_version="v1",
                dimension=DIM,
                write_clock=clock,
            )
            for _ in range(2)
        )
        try:
            stamps = []
            for number in range(40):
                tenant = TENANTS[number % 2]
                vector = clustered(rng, 1, centres)[0]
                await writer.add([GalleryEntry(f"f{number}", tenant, "v1", vector, time.time())])
                matches = await reader.search(tenant, vector, 1, -1.0)
                assert [m.face_id for m in matches] == [f"f{number}"], number
                stamps.append(await clock.read(tenant))
            if gallery_backend.server:
                # Each tenant's clock moved with each of its writes.
                assert all(later > earlier > 0 for earlier, later in zip(stamps, stamps[2:], strict=False))
        finally:
            for store in (writer, reader):
                await store.close()
            await redis.aclose()

    asyncio.run(scenario())
