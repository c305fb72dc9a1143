"""Helpers for the fault tests: a restartable service, direct access to the real stores, replica kills,
and deadline-bounded polling. Nothing here sleeps to assert; every wait is a poll with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from models.embedder import FUSED_DIM, MODEL_VERSION
from serve_app.domain.faces import FaceRecord
from serve_app.domain.transactions import Transaction
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_reconcile import RedisReconcileState
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.integration.api_client import auth
from tests.service_harness import RunningService, running_service

T = TypeVar("T")
APP_NAME = "facesearch"
FINAL_STATES = frozenset({"completed", "failed"})


def poll(
    check: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.25,
) -> T:
    """Call check() until it returns something other than None (or False); fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while True:
        last = check()
        if last is not None and last is not False:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval_s)


# -- the service under test --------------------------------------------------------------------------------


class ServiceHost:
    """One application on one data directory that tests can stop and start again (a full restart:
    Serve, Ray and the embedded Redis and Milvus all go down and come back on the same data)."""

    def __init__(self, data_dir: Path, env: dict[str, str]) -> None:
        self.data_dir = data_dir
        self.env = dict(env)
        self._stack: contextlib.ExitStack | None = None
        self._current: RunningService | None = None
        self.starts = 0

    @property
    def current(self) -> RunningService:
        if self._current is None:
            raise RuntimeError("the service is not running")
        return self._current

    def start(self) -> RunningService:
        if self._current is not None:
            return self._current
        stack = contextlib.ExitStack()
        try:
            self._current = stack.enter_context(running_service(self.data_dir, env=self.env))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self.starts += 1
        return self._current

    def stop(self) -> None:
        stack, self._stack, self._current = self._stack, None, None
        if stack is not None:
            stack.close()

    def restart(self, while_down: Callable[[Path], None] | None = None) -> RunningService:
        """Stop everything, run while_down(data_dir) with nothing running, start everything again."""
        self.stop()
        if while_down is not None:
            while_down(self.data_dir)
        return self.start()


# -- the real stores, from the test process ------------------------------------------------------------------


@dataclass(frozen=True)
class Stores:
    transactions: RedisTransactionStore
    records: RedisFaceRecordStore
    gallery: MilvusGalleryStore
    blobs: LocalBlobStore
    reconcile_state: RedisReconcileState


def with_stores(
    redis_url: str,
    milvus_uri: str | None,
    settings: Settings,
    operation: Callable[[Stores], Awaitable[T]],
) -> T:
    """Run operation against fresh clients of the given backends (closed afterwards). Without a
    milvus_uri the gallery points nowhere and must not be used (it connects only when first used)."""

    async def main() -> T:
        redis = connect_redis(redis_url)
        gallery = MilvusGalleryStore(
            milvus_uri or "http://127.0.0.1:1",
            token=settings.milvus.token,
            model_version=MODEL_VERSION,  # the service's gallery: same collection, same version
            dimension=FUSED_DIM,
        )
        stores = Stores(
            transactions=RedisTransactionStore(redis, prefix=settings.redis.key_prefix),
            records=RedisFaceRecordStore(redis, prefix=settings.redis.key_prefix),
            gallery=gallery,
            blobs=LocalBlobStore(settings.blobs),
            reconcile_state=RedisReconcileState(redis, prefix=settings.redis.key_prefix),
        )
        try:
            return await operation(stores)
        finally:
            await gallery.close()
            await redis.aclose()

    return asyncio.run(main())


def stores_of(service: RunningService, operation: Callable[[Stores], Awaitable[T]]) -> T:
    assert service.settings.redis.url is not None
    return with_stores(service.settings.redis.url, service.settings.milvus.uri, service.settings, operation)


def transactions_of(service: RunningService, reference_ids: Iterable[str]) -> dict[str, Transaction]:
    wanted = list(reference_ids)

    async def read(stores: Stores) -> dict[str, Transaction]:
        found = {}
        for ref in wanted:  # one at a time: a burst of gets would need a connection each
            tx = await stores.transactions.get(ref)
            if tx is not None:
                found[ref] = tx
        return found

    return stores_of(service, read)


def states_of(service: RunningService, reference_ids: Iterable[str]) -> dict[str, str]:
    return {ref: tx.state.value for ref, tx in transactions_of(service, reference_ids).items()}


def queue_depth(service: RunningService) -> int:
    async def read(stores: Stores) -> int:
        return await stores.transactions.depth()

    return stores_of(service, read)


def tenant_records(service: RunningService, tenant_id: str) -> list[FaceRecord]:
    async def read(stores: Stores) -> list[FaceRecord]:
        ids = sorted(face_id for _, face_id in await stores.records.all_face_ids(tenant_id))
        found = await stores.records.get_many(tenant_id, ids)
        return [found[face_id] for face_id in ids if face_id in found]

    return stores_of(service, read)


def tenant_vectors(service: RunningService, tenant_id: str) -> set[str]:
    async def read(stores: Stores) -> set[str]:
        face_ids, after = await stores.gallery.page_ids(tenant_id, None, 1000)
        while after is not None:
            more, after = await stores.gallery.page_ids(tenant_id, after, 1000)
            face_ids += more
        return set(face_ids)

    return stores_of(service, read)


def pending_entries(service: RunningService) -> dict[str, int]:
    """Delivered but unacknowledged stream entries, per consumer (XPENDING summary)."""
    settings = service.settings

    async def read() -> dict[str, int]:
        redis = connect_redis(str(settings.redis.url))
        try:
            summary = await redis.xpending(f"{settings.redis.key_prefix}sys:tx-queue", "workers")
        finally:
            await redis.aclose()
        return {str(row["name"]): int(row["pending"]) for row in summary.get("consumers") or []}

    return asyncio.run(read())


def count_by_state(service: RunningService) -> dict[str, int]:
    async def read(stores: Stores) -> dict[str, int]:
        return await stores.transactions.count_by_state()

    return stores_of(service, read)


# -- HTTP ----------------------------------------------------------------------------------------------------


def result_of(http: httpx.Client, token: str, reference_id: str) -> httpx.Response:
    return http.post("/result", headers=auth(token), json={"reference_id": reference_id})


def wait_all_final(
    service: RunningService, reference_ids: Iterable[str], timeout_s: float
) -> dict[str, Transaction]:
    """Poll Redis (cheap, one round trip per transaction) until every transaction is final."""
    wanted = list(reference_ids)

    def all_final() -> dict[str, Transaction] | None:
        found = transactions_of(service, wanted)
        missing = [ref for ref in wanted if ref not in found]
        assert not missing, f"transactions vanished: {missing}"
        if all(tx.state.value in FINAL_STATES for tx in found.values()):
            return found
        return None

    return poll(all_final, timeout_s, f"{len(wanted)} transactions to become final", interval_s=0.5)


def final_results(
    service: RunningService, token: str, reference_ids: Iterable[str]
) -> dict[str, dict[str, Any]]:
    """The /result bodies of transactions that are already final (asserts HTTP 200 for each)."""
    bodies: dict[str, dict[str, Any]] = {}
    with service.http() as http:
        for reference_id in reference_ids:
            response = result_of(http, token, reference_id)
            assert response.status_code == 200, response.text
            bodies[reference_id] = response.json()
    return bodies


def matched_faces(body: dict[str, Any]) -> list[list[Any]]:
    result = body["result"]["data"]["face_search_response"]["result"]
    assert isinstance(result["matched_faces"], list)
    return list(result["matched_faces"])


def without_proof_urls(body: dict[str, Any]) -> dict[str, Any]:
    """A /result body with each match's proof URL left out (URLs are minted per read and expire)."""
    data = dict(body["result"]["data"])
    if "face_search_response" in data:
        result = dict(data["face_search_response"]["result"])
        result["matched_faces"] = [[m[0], m[1], m[3]] for m in result["matched_faces"]]
        data["face_search_response"] = {"result": result}
    return {**body, "result": {"data": data}}


# -- Ray Serve replicas --------------------------------------------------------------------------------------


def replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    return sorted(
        str(actor["name"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if str(actor["name"]).startswith(prefix)
    )


def worker_status() -> dict[str, Any]:
    """The TransactionWorker replica's own report: its consumer name, in-flight and processed counts."""
    from ray import serve

    handle = serve.get_deployment_handle("TransactionWorker", app_name=APP_NAME)
    status: dict[str, Any] = handle.status.remote().result(timeout_s=30)
    return status


def kill_replica(deployment: str) -> str:
    """Kill the deployment's (only) replica actor without letting Ray restart it; Serve must replace it."""
    import ray

    names = replica_names(deployment)
    assert len(names) == 1, f"expected one {deployment} replica, found {names}"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"] == names[0]:
            ray.kill(ray.get_actor(names[0], namespace=actor["namespace"]), no_restart=True)
            return names[0]
    raise AssertionError(f"replica {names[0]} vanished before it could be killed")


def wait_replaced(deployment: str, killed: str, timeout_s: float) -> str:
    """Wait until Serve runs a new, healthy replica of the deployment; returns its actor name."""
    from ray import serve

    def replaced() -> str | None:
        names = replica_names(deployment)
        if killed in names or len(names) != 1:
            return None
        app = serve.status().applications.get(APP_NAME)
        if app is None or app.status != "RUNNING":
            return None
        if app.deployments[deployment].status != "HEALTHY":
            return None
        return names[0]

    return poll(replaced, timeout_s, f"Serve to replace the killed {deployment} replica", interval_s=0.5)


def kill_replica_process(deployment: str) -> int:
    """SIGKILL the process of one replica of the deployment (the first found), as the kernel's OOM killer or
    a crash would end it: no Ray call, no chance to clean up. Only this test process' own Ray is searched."""
    import os
    import signal

    import psutil

    title = f"ServeReplica:{APP_NAME}:{deployment}"
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if title in " ".join(process.cmdline()):
                found.append(process.pid)
    assert found, f"no {deployment} replica process found"
    os.kill(found[0], signal.SIGKILL)
    return found[0]


def wait_one_replaced(deployment: str, before: list[str], timeout_s: float) -> str:
    """Wait until Serve runs as many healthy replicas of the deployment as `before` named, one of them new
    (the replacement of one that was killed); returns the new one's actor name."""
    from ray import serve

    def replaced() -> str | None:
        names = replica_names(deployment)
        new = sorted(set(names) - set(before))
        if len(names) != len(before) or len(new) != 1:
            return None
        app = serve.status().applications.get(APP_NAME)
        if app is None or app.status != "RUNNING" or app.deployments[deployment].status != "HEALTHY":
            return None
        return new[0]

    return poll(replaced, timeout_s, f"Serve to replace the killed {deployment} replica", interval_s=0.5)


class HealthProbe:
    """Polls GET /healthz every interval_s from a thread of its own, on one kept-alive connection as a client
    would, recording when each answer came and what it was: "200", another status, or the transport error's
    name (a refused or broken connection)."""

    def __init__(self, base_url: str, interval_s: float = 0.2, timeout_s: float = 10.0) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.outcomes: list[tuple[float, str]] = []  # (monotonic time of the answer, outcome)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    outcome = str(http.get("/healthz").status_code)
                except httpx.TransportError as error:
                    outcome = type(error).__name__
                self.outcomes.append((time.monotonic(), outcome))
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    @property
    def failures(self) -> list[str]:
        return [outcome for _, outcome in self.outcomes if outcome != "200"]

    def most_failures_in_a_row(self) -> int:
        longest = current = 0
        for _, outcome in self.outcomes:
            current = current + 1 if outcome != "200" else 0
            longest = max(longest, current)
        return longest

    def longest_gap_s(self) -> float:
        """The longest time between two successive successful answers (reported, never asserted: a busy
        test machine stretches it)."""
        answered = [at for at, outcome in self.outcomes if outcome == "200"]
        return max((later - earlier for earlier, later in itertools.pairwise(answered)), default=0.0)


def close_connections_from_the_server(base_url: str, count: int) -> None:
    """Requests that ask the server to close their connection after the answer. The server closes first,
    so each connection stays in TIME_WAIT on the server's port for a minute, as the idle keep-alive
    connections a server times out do under real traffic; a listener started on that port while they
    last must still be able to bind it."""
    for _ in range(count):
        with httpx.Client(base_url=base_url, timeout=30) as http:
            response = http.get("/healthz", headers={"Connection": "close"})
            assert response.status_code == 200
