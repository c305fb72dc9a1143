"""Fault tests against the real application (Ray Serve, embedded redis-server and milvus-lite, real models
and photos): docs/architecture.md's promise "Nothing accepted is lost", checked by killing replicas, stopping
backends and restarting everything while transactions are in flight.

One service instance is shared by every test in this module (a start costs 15-25 s); the restart test
restarts it in place on the same data directory. Workers reclaim abandoned entries after
FACESEARCH_STALE_AFTER_S = 3 s here instead of 30 s, so recovery happens within the tests' deadlines.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from facesearch_client import FaceSearchClient, calls
from models.embedder import MODEL_VERSION
from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.outcomes import AgeEstimationOutcome
from serve_app.domain.transactions import (
    Transaction,
    TransactionKind,
    TransactionState,
    new_reference_id,
)
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.pipelines.reconcile import ReconcilePolicy, Reconciler, ReconcileReport
from serve_app.pipelines.transactions import upload_key
from serve_app.settings import Settings
from tests.backend_text import assert_no_backend_text
from tests.faces_dev import FacesDev
from tests.integration.api_client import (
    age_estimation,
    auth,
    face_search_json,
    reference_of,
)
from tests.integration.faults.faults_support import (
    FINAL_STATES,
    HealthProbe,
    ServiceHost,
    Stores,
    count_by_state,
    final_results,
    kill_replica,
    kill_replica_process,
    matched_faces,
    pending_entries,
    poll,
    queue_depth,
    replica_names,
    states_of,
    stores_of,
    tenant_records,
    tenant_vectors,
    transactions_of,
    wait_all_final,
    wait_one_replaced,
    wait_replaced,
    with_stores,
    without_proof_urls,
    worker_status,
)
from tests.service_harness import Client, RunningService
from tests.unit.fakes import TEST_LOCK

pytestmark = pytest.mark.service

STALE_AFTER_S = 3
FAULT_ENV = {"FACESEARCH_STALE_AFTER_S": str(STALE_AFTER_S)}
FINISH_TIMEOUT_S = 180.0  # generous: a shared 2-core machine, and a worker replica reloading the models


# -- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceHost]:
    import ray

    if ray.is_initialized():
        pytest.fail(
            "Ray is already initialised in this process (the session `service` fixture is alive?); "
            "the fault tests need their own service and must run before it"
        )
    service_host = ServiceHost(tmp_path_factory.mktemp("faults-data"), FAULT_ENV)
    service_host.start()
    try:
        yield service_host
    finally:
        service_host.stop()


@dataclass(frozen=True)
class Gallery:
    """A tenant with the first photo of each of the 10 identities enrolled under ref-<identity>."""

    client: Client
    token: str
    enrolled: dict[str, str]  # identity -> reference_id of its enrolment
    photos: dict[str, list[Path]]

    @property
    def tenant_id(self) -> str:
        return self.client.client_id

    def face_of(self, identity: str) -> str:
        return enrolled_face_id(self.enrolled[identity])


def reference_for(identity: str) -> str:
    return f"ref-{identity}"


@pytest.fixture(scope="module")
def gallery(host: ServiceHost, faces_dev: FacesDev) -> Gallery:
    service = host.current
    client = service.new_client("faults-gallery")
    token = service.token_for(client)
    photos = {
        identity: [image.path for image in images] for identity, images in faces_dev.by_identity().items()
    }
    assert len(photos) == 10 and all(len(paths) >= 3 for paths in photos.values())
    with service.http() as http:
        enrolled = {
            identity: reference_of(
                face_search_json(http, token, paths[0], client_reference=reference_for(identity))
            )
            for identity, paths in photos.items()
        }
    finished = wait_all_final(service, enrolled.values(), FINISH_TIMEOUT_S)
    assert {tx.state for tx in finished.values()} == {TransactionState.COMPLETED}
    assert len(tenant_records(service, client.client_id)) == 10
    return Gallery(client=client, token=token, enrolled=enrolled, photos=photos)


@pytest.fixture(scope="module")
def age_baseline(host: ServiceHost, gallery: Gallery, faces_dev: FacesDev) -> dict[Path, dict[str, Any]]:
    """Age results for 10 photos computed with nothing failing, to compare results after faults with."""
    baseline: dict[Path, dict[str, Any]] = {}
    with host.current.http() as http:
        for image in faces_dev.of_kind("age")[:10]:
            response = age_estimation(http, gallery.token, image.path, enroll_face=0, wait_for_result=1)
            assert response.status_code == 200, response.text
            data = dict(response.json()["result"]["data"])
            data.pop("reference_id")
            assert isinstance(data["age"], int)
            baseline[image.path] = data
    return baseline


# -- 1, 2: a replica killed while transactions are in flight ---------------------------------------------


@dataclass(frozen=True)
class Job:
    kind: TransactionKind
    photo: Path
    identity: str | None  # face search: whose enrolled face must be the best match


def _burst(gallery: Gallery, age_baseline: dict[Path, dict[str, Any]]) -> list[Job]:
    """30 jobs: searches of photos 2 and 3 of each identity (not enrolled), with an age estimation after
    every second search."""
    searches = [
        Job(TransactionKind.FACE_SEARCH, paths[index], identity)
        for index in (1, 2)
        for identity, paths in gallery.photos.items()
    ]
    ages = [Job(TransactionKind.AGE_ESTIMATION, path, None) for path in age_baseline]
    jobs: list[Job] = []
    for number, search in enumerate(searches):
        jobs.append(search)
        if number % 2 == 1:
            jobs.append(ages[number // 2])
    assert len(jobs) == 30
    return jobs


def _submit(http: httpx.Client, token: str, job: Job) -> str:
    if job.kind is TransactionKind.FACE_SEARCH:
        return reference_of(face_search_json(http, token, job.photo, enroll_face=0))
    return reference_of(age_estimation(http, token, job.photo, enroll_face=0))


def _submit_alone(service: RunningService, token: str, job: Job) -> str:
    """Submit with a client of its own, so that several threads can submit at once."""
    with service.http() as http:
        return _submit(http, token, job)


def _submit_all(service: RunningService, token: str, jobs: list[Job], threads: int = 6) -> dict[str, Job]:
    """Submit every job, several at a time, so they arrive as one burst; reference_id -> job."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        references = list(pool.map(lambda job: _submit_alone(service, token, job), jobs))
    submitted = dict(zip(references, jobs, strict=True))
    assert len(submitted) == len(jobs)
    return submitted


def _check_result(
    body: dict[str, Any], job: Job, gallery: Gallery, age_baseline: dict[Path, dict[str, Any]]
) -> None:
    assert body["status"] is True, body
    data = body["result"]["data"]
    if job.kind is TransactionKind.AGE_ESTIMATION:
        assert {key: value for key, value in data.items() if key != "reference_id"} == age_baseline[job.photo]
        return
    assert job.identity is not None
    assert data["face_search_response"]["result"]["is_face_found"] is True
    matches = matched_faces(body)
    assert matches, f"no match for {job.identity} ({job.photo.name})"
    best = matches[0]
    assert best[0] == gallery.face_of(job.identity), (job.photo.name, matches)
    assert best[3] == reference_for(job.identity)


def _kill_mid_flight(
    host: ServiceHost, gallery: Gallery, age_baseline: dict[Path, dict[str, Any]], deployment: str
) -> None:
    service = host.current
    jobs = _burst(gallery, age_baseline)
    consumer_before = str(worker_status()["consumer"])
    started = time.monotonic()

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(_submit_alone, service, gallery.token, job) for job in jobs]

        # Kill once the worker is visibly busy with several transactions (or with any, once the whole
        # burst is in), usually while the rest of the burst is still arriving.
        def processing_seen() -> dict[str, str] | None:
            done = [future.result() for future in futures if future.done()]
            states = states_of(service, done)
            processing = sum(state == "processing" for state in states.values())
            return states if processing >= 8 or (processing and len(done) == len(futures)) else None

        states_at_kill = poll(processing_seen, 60, "a transaction of the burst to be processing", 0.02)
        killed = kill_replica(deployment)
        # Entries the worker had claimed and not acknowledged right after the kill: its work in flight.
        held_after_kill = pending_entries(service).get(consumer_before, 0)
        submitted = {future.result(): job for future, job in zip(futures, jobs, strict=True)}
    assert len(submitted) == 30
    unfinished_at_kill = len(submitted) - sum(state in FINAL_STATES for state in states_at_kill.values())
    processing_at_kill = sum(state == "processing" for state in states_at_kill.values())
    assert processing_at_kill >= 1 and held_after_kill >= 1

    replacement = wait_replaced(deployment, killed, 120)
    assert replacement != killed
    if deployment == "TransactionWorker":
        # A new consumer took over; the dead one's entries were reclaimed (checked by the drained queue).
        assert worker_status()["consumer"] != consumer_before

    finished = wait_all_final(service, submitted, FINISH_TIMEOUT_S)
    elapsed = time.monotonic() - started
    completed = [ref for ref, tx in finished.items() if tx.state is TransactionState.COMPLETED]
    failed = {ref: tx.error for ref, tx in finished.items() if tx.state is not TransactionState.COMPLETED}
    assert not failed, f"{len(completed)}/{len(submitted)} completed; failed: {failed}"
    bodies = final_results(service, gallery.token, submitted)
    for reference_id, job in submitted.items():
        _check_result(bodies[reference_id], job, gallery, age_baseline)
    retried = sum(tx.attempts > 1 for tx in finished.values())
    # Every entry was acknowledged in the end, the dead consumer's included: nothing is left pending.
    poll(lambda: queue_depth(service) == 0, 30, "the work queue to drain")
    assert sum(pending_entries(service).values()) == 0
    print(
        f"FAULTS {deployment} killed: {len(completed)}/{len(submitted)} completed correctly in "
        f"{elapsed:.1f} s; at the kill {len(states_at_kill)} submitted, {unfinished_at_kill}/30 unfinished, "
        f"{processing_at_kill} processing, {held_after_kill} claimed entries unacknowledged; "
        f"{retried} processed more than once"
    )


def test_worker_replica_killed_mid_flight_loses_nothing(
    host: ServiceHost, gallery: Gallery, age_baseline: dict[Path, dict[str, Any]]
) -> None:
    # The worker owns the models (config/serve.yaml): this is the replica running them, killed while
    # several transactions are inside it, most of them in a model batch.
    _kill_mid_flight(host, gallery, age_baseline, "TransactionWorker")


def _submit_as_a_client_does(
    service: RunningService, token: str, job: Job, statuses: list[int], broken: list[str]
) -> str:
    """Through the client library with its retries on: an answer the front door gives itself (503 with
    Retry-After, when the replica that had the request died) is sent again with the same Idempotency-Key,
    and so is a request whose connection broke without an answer (the replica died while the client was
    still sending, and the front door's answer was lost with the connection): it may have been created, and
    the key makes sending it again safe. Every status seen goes to `statuses`; each request that got no
    answer adds to `broken`."""
    if job.kind is TransactionKind.FACE_SEARCH:
        call = calls.face_search(job.photo, as_json=True, extra={"enroll_face": 0})
    else:
        call = calls.age_estimation(job.photo, extra={"enroll_face": 0})
    sent: list[str] = []
    answered: list[int] = []
    with service.http() as http:
        http.event_hooks["request"] = [lambda request: sent.append(request.url.path)]
        http.event_hooks["response"] = [lambda response: answered.append(response.status_code)]
        try:
            return reference_of(FaceSearchClient(token=token, http=http).send(call))
        finally:
            statuses.extend(answered)
            broken.extend(["no answer"] * (len(sent) - len(answered)))


def test_ingress_replica_killed_mid_burst_the_port_keeps_answering_and_loses_nothing(
    host: ServiceHost, gallery: Gallery, age_baseline: dict[Path, dict[str, Any]]
) -> None:
    """Two ingress replicas behind the front door (HAProxy on the public port, config/serve.yaml). One is
    SIGKILLed while a burst of creates arrives and /healthz is polled every 0.2 s. The port keeps answering:
    no poll finds it refusing, and no two polls in a row go unanswered (HAProxy sends a refused request to the
    other replica). The creates the dead replica had are answered 503 by the front door (or, if the client
    was still sending, cut off) and sent again with their Idempotency-Key: every create gets its
    reference_id, every transaction becomes final with the right answer, and none is made twice."""
    service = host.current
    jobs = _burst(gallery, age_baseline)
    before = replica_names("ApiIngress")
    assert len(before) == 2, before
    transactions_before = sum(count_by_state(service).values())
    statuses: list[int] = []
    cut_off: list[str] = []
    with HealthProbe(service.base_url) as probe:
        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [
                pool.submit(_submit_as_a_client_does, service, gallery.token, job, statuses, cut_off)
                for job in jobs
            ]
            poll(lambda: sum(future.done() for future in futures) >= 6, 60, "the burst to be arriving", 0.01)
            killed_at = time.monotonic()
            kill_replica_process("ApiIngress")
            accepted = {future.result(): job for future, job in zip(futures, jobs, strict=True)}
        # The probe goes on until the replacement serves: HAProxy takes it in by a reload of its own.
        replacement = wait_one_replaced("ApiIngress", before, 120)
        replaced_after = time.monotonic() - killed_at
    assert replacement not in before
    assert len(accepted) == len(jobs), "a create was answered twice with one reference_id"
    # The front door never went away: no refused or broken connection, at most isolated unanswered polls.
    broken = [outcome for outcome in probe.failures if not outcome.isdigit()]
    assert probe.outcomes and not broken, probe.failures
    assert probe.most_failures_in_a_row() <= 1, probe.outcomes
    finished = wait_all_final(service, accepted, FINISH_TIMEOUT_S)
    failed = {ref: tx.error for ref, tx in finished.items() if tx.state is not TransactionState.COMPLETED}
    assert not failed, failed
    bodies = final_results(service, gallery.token, accepted)
    for reference_id, job in accepted.items():
        _check_result(bodies[reference_id], job, gallery, age_baseline)
    # One transaction per create, whatever the retries: nothing else wrote transactions meanwhile.
    made = sum(count_by_state(service).values()) - transactions_before
    assert made == len(jobs), f"{made} transactions for {len(jobs)} creates"
    print(
        f"FAULTS ApiIngress 1 of 2 SIGKILLed mid-burst: /healthz polled {len(probe.outcomes)} times "
        f"every 0.2 s, {len(probe.failures)} unanswered, longest gap between answers "
        f"{probe.longest_gap_s():.2f} s; {len(jobs)} creates, {len(accepted)} accepted "
        f"({statuses.count(503)} answered 503 and {len(cut_off)} cut off, each sent again with its key), "
        f"{len(finished)} final, 0 lost, {made - len(jobs)} duplicates; replacement serving after "
        f"{replaced_after:.1f} s"
    )


def test_behind_the_front_door_each_client_keeps_its_own_login_allowance(host: ServiceHost) -> None:
    """Every request reaches a replica from HAProxy, so the ingress must count failed logins by the client's
    address (which HAProxy hands over in X-Forwarded-For), not by HAProxy's: a client that keeps failing
    from one address is throttled, another address logs in, and a forged X-Forwarded-For moves nothing."""
    service = host.current
    client = service.new_client("front-door-sources")
    body = {"client_id": client.client_id, "client_secret": "wrong"}

    def from_address(address: str) -> httpx.Client:
        transport = httpx.HTTPTransport(local_address=address)
        return httpx.Client(base_url=service.base_url, transport=transport, timeout=30)

    with from_address("127.0.0.3") as attacker, from_address("127.0.0.4") as other:
        statuses = [attacker.post("/request-access-token", json=body).status_code for _ in range(30)]
        assert 429 in statuses and set(statuses) <= {401, 429}, statuses
        forged = attacker.post("/request-access-token", json=body, headers={"X-Forwarded-For": "192.0.2.77"})
        assert forged.status_code == 429
        good = {"client_id": client.client_id, "client_secret": client.client_secret}
        assert other.post("/request-access-token", json=good).status_code == 200


def _new_transaction(tenant_id: str, kind: TransactionKind, **fields: Any) -> Transaction:
    """A queued transaction as a create call would persist it (fields override the defaults)."""
    now = time.time()
    reference_id = new_reference_id()
    values: dict[str, Any] = {
        "reference_id": reference_id,
        "tenant_id": tenant_id,
        "kind": kind,
        "state": TransactionState.QUEUED,
        "created_at": now,
        "updated_at": now,
        "image_key": upload_key(tenant_id, reference_id),
        "enroll_face": False,
        **fields,
    }
    return Transaction(**values)


async def _enqueue(stores: Stores, tx: Transaction, photo: Path) -> None:
    """What a create call does: the image first, then the transaction and its queue entry."""
    content_type = "image/png" if photo.suffix.lower() == ".png" else "image/jpeg"
    await stores.blobs.put(tx.image_key, await asyncio.to_thread(photo.read_bytes), content_type)
    await stores.transactions.create_and_enqueue(tx)


# -- 5: concurrent overrides of one client_reference ------------------------------------------------------


def test_concurrent_overrides_leave_exactly_one_image(host: ServiceHost, faces_dev: FacesDev) -> None:
    service = host.current
    client = service.new_client("faults-override")
    tenant_id = client.client_id
    token = service.token_for(client)
    reference = "race-subject"
    people = list(faces_dev.by_identity().items())[:7]
    stale_person = list(faces_dev.by_identity().items())[7]
    first_photos = people[0][1]
    contenders = people[1:]
    assert len(contenders) == 6

    with service.http() as http:
        initial = reference_of(
            face_search_json(http, token, first_photos[0].path, client_reference=reference)
        )
    assert wait_all_final(service, [initial], FINISH_TIMEOUT_S)[initial].state is TransactionState.COMPLETED

    barrier = threading.Barrier(len(contenders))

    def override(photo: Path) -> str:
        with service.http() as own_http:
            barrier.wait(timeout=30)
            return reference_of(
                face_search_json(own_http, token, photo, client_reference=reference, allow_override=1)
            )

    with ThreadPoolExecutor(max_workers=len(contenders)) as pool:
        references = list(pool.map(override, [photos[0].path for _, photos in contenders]))
    by_reference = {ref: identity for ref, (identity, _) in zip(references, contenders, strict=True)}
    assert len(by_reference) == 6

    finished = wait_all_final(service, references, FINISH_TIMEOUT_S)
    assert {tx.state for tx in finished.values()} == {TransactionState.COMPLETED}
    # The latest submission wins, whatever order the worker finished them in.
    winner = max(references, key=lambda ref: finished[ref].created_at)
    winner_face = enrolled_face_id(winner)

    superseded = sum(tx.result is None or not tx.result.enrolled for tx in finished.values())

    # An override older than all of them that is processed only now (as one reclaimed from a worker that
    # died holding it would be) must not bring its image back.
    def enqueue_stale(stores: Stores) -> Awaitable[None]:
        return _enqueue(stores, stale_tx, stale_photo)

    stale_photo = stale_person[1][0].path
    stale_tx = _new_transaction(
        tenant_id,
        TransactionKind.FACE_SEARCH,
        created_at=min(tx.created_at for tx in finished.values()) - 1.0,
        enroll_face=True,
        allow_override=True,
        client_reference=reference,
    )
    stores_of(service, enqueue_stale)
    stale = stale_tx.reference_id
    stale_final = wait_all_final(service, [stale], FINISH_TIMEOUT_S)[stale]
    assert stale_final.state is TransactionState.COMPLETED
    assert stale_final.result is not None and stale_final.result.enrolled is False

    records = tenant_records(service, tenant_id)
    with_reference = [record for record in records if record.client_reference == reference]
    assert [record.face_id for record in with_reference] == [winner_face]
    assert {record.face_id for record in records} == {winner_face}
    assert tenant_vectors(service, tenant_id) == {winner_face}

    async def latest_and_blobs(stores: Stores) -> tuple[FaceRecord | None, set[str]]:
        latest = await stores.records.latest_for_reference(tenant_id, reference)
        kept = set()
        for ref in [initial, *references, stale]:
            if await stores.blobs.get(upload_key(tenant_id, ref)) is not None:
                kept.add(ref)
        return latest, kept

    latest, kept_uploads = stores_of(service, latest_and_blobs)
    assert latest is not None and latest.face_id == winner_face
    assert kept_uploads == {winner}, "only the surviving face's image may be kept"

    # Over HTTP: the reference is returned at most once by any search, and only for the winner's face.
    with service.http() as http:
        probes = {
            identity: reference_of(face_search_json(http, token, photos[1].path, enroll_face=0))
            for identity, photos in people
        }
    wait_all_final(service, probes.values(), FINISH_TIMEOUT_S)
    bodies = final_results(service, token, probes.values())
    winner_identity = by_reference[winner]
    for identity, probe in probes.items():
        returned = [match for match in matched_faces(bodies[probe]) if match[3] == reference]
        assert len(returned) == (1 if identity == winner_identity else 0), (identity, returned)
        if returned:
            assert returned[0][0] == winner_face
            proof = httpx.get(returned[0][2], timeout=30)
            assert proof.status_code == 200
            assert proof.content == dict(people)[winner_identity][0].path.read_bytes()
    print(
        f"FAULTS override race: 6/6 completed ({superseded} found a newer image already there and kept "
        f"out), 1 face left for the reference (winner {winner_identity}); a stale override replayed "
        f"afterwards changed nothing; {len(records)} record and "
        f"{len(tenant_vectors(service, tenant_id))} vector for the tenant"
    )


# -- 4: Redis and Milvus outages ---------------------------------------------------------------------------


def _assert_unavailable(response: httpx.Response, redis_port: int) -> None:
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] is False
    # One fixed message for the class; what Redis or the socket said stays in the log.
    assert body["message"] == BackendUnavailable.public_message, body["message"]
    assert body["errors"] == {}
    assert_no_backend_text(response.text, ports=[redis_port])
    assert int(response.headers["Retry-After"]) > 0


def test_redis_outage_is_refused_quickly_and_recovers_without_restart(
    host: ServiceHost, faces_dev: FacesDev
) -> None:
    service = host.current
    redis = service.embedded.redis
    assert redis is not None
    client = service.new_client("faults-redis")
    token = service.token_for(client)
    identity, photos = next(iter(faces_dev.by_identity().items()))
    age_photo = faces_dev.of_kind("age")[0].path

    with service.http() as http:
        # Accepted right before the outage and not waited for: finished or not when Redis goes down,
        # they must end completed.
        accepted = [
            reference_of(face_search_json(http, token, photos[0].path, client_reference="redis-subject")),
            reference_of(age_estimation(http, token, age_photo, enroll_face=0)),
        ]
        unfinished_at_stop = sum(state not in FINAL_STATES for state in states_of(service, accepted).values())
        redis.stop()
        try:
            calls = {
                "face-search": lambda: face_search_json(http, token, photos[1].path, enroll_face=0),
                "age-estimation": lambda: age_estimation(
                    http, token, age_photo, enroll_face=0, wait_for_result=1
                ),
                "result": lambda: http.post(
                    "/result", headers=auth(token), json={"reference_id": accepted[0]}
                ),
                "request-access-token": lambda: http.post(
                    "/request-access-token",
                    json={"client_id": client.client_id, "client_secret": client.client_secret},
                ),
            }
            timings = {}
            for name, call in calls.items():
                started = time.monotonic()
                response = call()
                timings[name] = time.monotonic() - started
                _assert_unavailable(response, redis.port)  # a hung call fails on the client's timeout instead
        finally:
            redis.start()

        # No restart: the same ingress and worker reconnect by themselves.
        def created() -> str | None:
            response = face_search_json(http, token, photos[1].path, enroll_face=0)
            if response.status_code == 503:
                return None
            return reference_of(response)

        started = time.monotonic()
        after = poll(created, 60, "a create call to succeed after Redis came back", 0.5)
        recovered_s = time.monotonic() - started

    finished = wait_all_final(service, [*accepted, after], FINISH_TIMEOUT_S)
    assert {tx.state for tx in finished.values()} == {TransactionState.COMPLETED}
    age_result = finished[accepted[1]].result
    assert isinstance(age_result, AgeEstimationOutcome) and isinstance(age_result.age, int)
    # The enrolment accepted just before the outage completed: a search now finds it.
    with service.http() as http:
        check = reference_of(face_search_json(http, token, photos[2].path, enroll_face=0))
    assert wait_all_final(service, [check], FINISH_TIMEOUT_S)[check].state is TransactionState.COMPLETED
    best = matched_faces(final_results(service, token, [check])[check])[0]
    assert best[0] == enrolled_face_id(accepted[0]) and best[3] == "redis-subject", (identity, best)
    print(
        "FAULTS redis down: "
        + ", ".join(f"{name} 503 in {seconds:.2f} s" for name, seconds in timings.items())
        + f"; first create accepted {recovered_s:.1f} s after Redis was back; 3/3 transactions completed "
        + f"({unfinished_at_stop}/2 accepted before the outage were unfinished when it began)"
    )


def test_milvus_outage_delays_but_loses_nothing_and_leaves_no_half_state(
    host: ServiceHost, faces_dev: FacesDev
) -> None:
    service = host.current
    milvus = service.embedded.milvus
    assert milvus is not None
    client = service.new_client("faults-milvus")
    tenant_id = client.client_id
    token = service.token_for(client)
    identities = list(faces_dev.by_identity().items())
    people, newcomer = identities[:5], identities[5][1][0].path
    age_photo = faces_dev.of_kind("age")[1].path

    with service.http() as http:
        first = {
            identity: reference_of(
                face_search_json(http, token, photos[0].path, client_reference=f"mv-{identity}")
            )
            for identity, photos in people
        }
    assert {tx.state for tx in wait_all_final(service, first.values(), FINISH_TIMEOUT_S).values()} == {
        TransactionState.COMPLETED
    }

    # A burst of searches that enrol (a record, then a vector to write) and searches that do not; Milvus
    # is stopped while it is being processed, so some enrolments are cut between their two writes.
    burst = [(photos[1].path, identity, True) for identity, photos in people] + [
        (photos[2].path, identity, False) for identity, photos in people
    ]

    def submit(photo: Path, identity: str, enrols: bool) -> str:
        fields: dict[str, Any] = {"client_reference": f"mv2-{identity}"} if enrols else {"enroll_face": 0}
        with service.http() as http:
            return reference_of(face_search_json(http, token, photo, **fields))

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(submit, *job) for job in burst]

            def busy() -> bool:
                done = [future.result() for future in futures if future.done()]
                processing = sum(state == "processing" for state in states_of(service, done).values())
                return processing >= 3 or (processing >= 1 and len(done) == len(futures))

            poll(busy, 60, "the burst to be processing", 0.02)
            milvus.stop()
            during = {
                future.result(): (identity, enrols)
                for future, (_, identity, enrols) in zip(futures, burst, strict=True)
            }
        with service.http() as http:
            # Age estimation without enrolment needs no Milvus: it completes during the outage.
            age_ref = reference_of(age_estimation(http, token, age_photo, enroll_face=0))
            # An enrolment accepted during the outage, whose record is then written as a worker that died
            # between the record and the vector write would have left it.
            cut = reference_of(face_search_json(http, token, newcomer, client_reference="mv-newcomer"))
        assert wait_all_final(service, [age_ref], 60)[age_ref].state is TransactionState.COMPLETED
        cut_tx = transactions_of(service, [cut])[cut]

        async def write_record_only(stores: Stores) -> None:
            await stores.records.put(
                FaceRecord(
                    face_id=enrolled_face_id(cut),
                    tenant_id=tenant_id,
                    client_reference="mv-newcomer",
                    proof_key=cut_tx.image_key,
                    model_version=MODEL_VERSION,
                    created_at=cut_tx.created_at,
                    reference_id=cut,
                )
            )

        stores_of(service, write_record_only)
        during[cut] = ("", True)

        def retried() -> dict[str, Transaction] | None:
            unfinished = {
                ref: tx for ref, tx in transactions_of(service, during).items() if not tx.state.is_final
            }
            assert unfinished, "the whole burst finished before Milvus went down"
            assert not any(
                tx.state is TransactionState.FAILED for tx in transactions_of(service, during).values()
            )
            # Every unfinished one was attempted, and at least one was reclaimed and attempted again.
            if all(tx.attempts >= 1 for tx in unfinished.values()) and any(
                tx.attempts >= 2 for tx in unfinished.values()
            ):
                return unfinished
            return None

        during_outage = poll(retried, 60, "the worker to attempt and retry the transactions", 0.5)
        # Enrolments cut between their two writes: a record exists while its transaction is unfinished.
        recorded = {record.reference_id for record in tenant_records(service, tenant_id)}
        half_written = len(recorded & set(during_outage)) - 1  # the injected one aside
    finally:
        milvus.start()
    attempts_during_outage = max(tx.attempts for tx in during_outage.values())

    finished = wait_all_final(service, during, FINISH_TIMEOUT_S)
    failed = {ref: tx.error for ref, tx in finished.items() if tx.state is not TransactionState.COMPLETED}
    assert not failed, f"transactions failed by a Milvus outage: {failed}"
    bodies = final_results(service, token, during)
    assert bodies[cut]["result"]["data"]["face_search_response"]["result"]["is_face_found"] is True
    for reference_id, (identity, _enrols) in during.items():
        if reference_id == cut:
            continue
        references = [match[3] for match in matched_faces(bodies[reference_id])]
        assert references and references[0] in (f"mv-{identity}", f"mv2-{identity}"), (identity, references)
        assert f"mv-{identity}" in references

    expected_faces = {enrolled_face_id(ref) for ref in first.values()} | {
        enrolled_face_id(ref) for ref, (_, enrols) in during.items() if enrols
    }
    assert {record.face_id for record in tenant_records(service, tenant_id)} == expected_faces
    assert tenant_vectors(service, tenant_id) == expected_faces

    # Nothing anywhere is in flight any more, so records and vectors must agree exactly.
    def idle() -> bool:
        counts = count_by_state(service)
        return counts["queued"] == 0 and counts["processing"] == 0 and queue_depth(service) == 0

    poll(idle, 60, "every transaction in the service to be final")

    async def repair(stores: Stores) -> tuple[ReconcileReport, set[tuple[str, str]], set[tuple[str, str]]]:
        reconciler = Reconciler(
            stores.records, stores.gallery, stores.transactions, stores.reconcile_state, "faults-test",
            ReconcilePolicy(TEST_LOCK, model_version=MODEL_VERSION), stores.blobs,
        )  # fmt: skip
        report = None
        while report is None:  # a worker's own periodic pass may hold the lease for a moment
            report = await reconciler.run_pass()
            await asyncio.sleep(0 if report is not None else 1)
        vectors = set()
        for tenant_id in await stores.records.tenant_ids():  # the gallery has no listing of all tenants
            face_ids, _ = await stores.gallery.page_ids(tenant_id, None, 100_000)
            vectors |= {(tenant_id, face_id) for face_id in face_ids}
        return report, await stores.records.all_face_ids(), vectors

    report, record_ids, vector_ids = stores_of(service, repair)
    assert (report.vectors_removed, report.records_removed, report.suspects) == (0, 0, 0), report
    assert record_ids == vector_ids
    assert report.records == report.vectors == len(record_ids)
    print(
        f"FAULTS milvus down mid-burst: {len(during)}/{len(during)} completed after it came back "
        f"({len(during_outage)} unfinished during the outage; {half_written} cut between record and "
        f"vector by the outage itself, 1 injected; up to {attempts_during_outage} attempts); reconcile "
        f"over {report.records} faces found nothing to repair"
    )


class FailedDuringOutage(AssertionError):
    """A transaction became final (failed) while a backend was down."""


def test_a_long_milvus_outage_fails_no_transaction(host: ServiceHost, faces_dev: FacesDev) -> None:
    """A Milvus outage outlasting max_deliveries retries (about 25 s here, about 2.5 min with the default
    FACESEARCH_STALE_AFTER_S) must still leave the transactions queued or processing, not failed."""
    service = host.current
    milvus = service.embedded.milvus
    assert milvus is not None
    client = service.new_client("faults-long-outage")
    token = service.token_for(client)
    photos = [images[1].path for images in faces_dev.by_identity().values()][:2]
    # Long enough for max_deliveries + 3 reclaim rounds (a round: stale_after_s, checked every 5 s).
    outage_s = (service.settings.worker.max_deliveries + 3) * max(float(STALE_AFTER_S), 5.0)

    milvus.stop()
    try:
        with service.http() as http:
            references = [
                reference_of(face_search_json(http, token, photo, enroll_face=0)) for photo in photos
            ]
        outage_ends = time.monotonic() + outage_s

        def outage_over() -> bool:
            failed = {
                ref: (tx.attempts, tx.error)
                for ref, tx in transactions_of(service, references).items()
                if tx.state.is_final
            }
            if failed:
                raise FailedDuringOutage(f"failed during a {outage_s:.0f} s Milvus outage: {failed}")
            return time.monotonic() >= outage_ends

        poll(outage_over, outage_s + 30, "the end of the Milvus outage", 0.5)
    finally:
        milvus.start()
    finished = wait_all_final(service, references, FINISH_TIMEOUT_S)
    assert {tx.state for tx in finished.values()} == {TransactionState.COMPLETED}


# -- 3: a full restart on the same data directory ---------------------------------------------------------


@dataclass(frozen=True)
class Injected:
    reference_id: str
    job: Job


def _inject(
    settings: Settings, redis_url: str, tenant_id: str, jobs: list[Job], dead_consumer: str | None
) -> list[Injected]:
    """Write transactions straight into the stores, as create calls would have; with dead_consumer, every
    entry not yet delivered is then claimed by a consumer that will never come back (a crashed worker)."""

    async def write(stores: Stores) -> list[Injected]:
        injected = []
        for job in jobs:
            tx = _new_transaction(tenant_id, job.kind)
            await _enqueue(stores, tx, job.photo)
            injected.append(Injected(tx.reference_id, job))
        if dead_consumer is not None:
            claimed = await stores.transactions.claim(dead_consumer, 1000, 0)
            assert claimed
            for entry in claimed:
                await stores.transactions.mark_processing(entry.reference_id)
        return injected

    return with_stores(redis_url, None, settings, write)


async def _read_all(stores: Stores, reference_ids: list[str]) -> dict[str, Transaction]:
    found = {}
    for reference_id in reference_ids:
        tx = await stores.transactions.get(reference_id)
        assert tx is not None, f"transaction {reference_id} lost by the shutdown"
        found[reference_id] = tx
    return found


def test_full_restart_keeps_data_and_finishes_unfinished_work(
    host: ServiceHost, gallery: Gallery, age_baseline: dict[Path, dict[str, Any]]
) -> None:
    service = host.current
    identities = list(gallery.photos)
    subject = identities[0]

    # Finished before the restart: a search whose match carries a proof URL, and the enrolments.
    with service.http() as http:
        probe = reference_of(face_search_json(http, gallery.token, gallery.photos[subject][1], enroll_face=0))
    wait_all_final(service, [probe], FINISH_TIMEOUT_S)
    finished_before = final_results(service, gallery.token, [probe, *gallery.enrolled.values()])
    old_proof_url = matched_faces(finished_before[probe])[0][2]
    assert httpx.get(old_proof_url, timeout=30).content == gallery.photos[subject][0].read_bytes()
    records_before = {record.face_id for record in tenant_records(service, gallery.tenant_id)}

    # Accepted right before shutdown and still in the worker's hands when it goes down: Milvus is stopped
    # first, so these searches cannot finish before the shutdown (the worker has claimed and tried each).
    milvus = service.embedded.milvus
    assert milvus is not None
    milvus.stop()
    late_jobs = [Job(TransactionKind.FACE_SEARCH, gallery.photos[i][2], i) for i in identities[:6]]
    late = _submit_all(service, gallery.token, late_jobs)

    def all_attempted() -> bool:
        found = transactions_of(service, late)
        assert not any(tx.state.is_final for tx in found.values()), "finished without Milvus"
        return all(tx.attempts >= 1 for tx in found.values())

    poll(all_attempted, 60, "the worker to claim and attempt the late transactions")

    settings = service.settings
    age_photos = list(age_baseline)
    down: dict[str, Any] = {}

    def while_down(data_dir: Path) -> None:
        with EmbeddedServices(data_dir, milvus=False) as backends:
            assert backends.redis_url is not None
            unfinished = [
                ref
                for ref, tx in with_stores(
                    backends.redis_url, None, settings, lambda stores: _read_all(stores, list(late))
                ).items()
                if not tx.state.is_final
            ]
            down["unfinished_late"] = len(unfinished)
            assert len(unfinished) == len(late), "work in flight at the shutdown was finished or lost"
            # One transaction held by a worker that crashed (with every entry not yet delivered), then
            # two queued while the application was down.
            stranded = _inject(
                settings,
                backends.redis_url,
                gallery.tenant_id,
                [Job(TransactionKind.FACE_SEARCH, gallery.photos[identities[6]][2], identities[6])],
                dead_consumer="crashed-worker",
            )
            queued = _inject(
                settings,
                backends.redis_url,
                gallery.tenant_id,
                [
                    Job(TransactionKind.FACE_SEARCH, gallery.photos[identities[7]][2], identities[7]),
                    Job(TransactionKind.AGE_ESTIMATION, age_photos[0], None),
                ],
                dead_consumer=None,
            )
            down["injected"] = stranded + queued

    started = time.monotonic()
    service = host.restart(while_down)
    restart_s = time.monotonic() - started
    injected: list[Injected] = down["injected"]
    pending = {**late, **{item.reference_id: item.job for item in injected}}

    finished = wait_all_final(service, pending, FINISH_TIMEOUT_S)
    failed = {ref: tx.error for ref, tx in finished.items() if tx.state is not TransactionState.COMPLETED}
    assert not failed, failed
    # The access token issued before the restart is still valid (the signing key lives in the data dir).
    bodies = final_results(service, gallery.token, pending)
    for reference_id, job in pending.items():
        _check_result(bodies[reference_id], job, gallery, age_baseline)

    # Finished results read the same (proof URLs are minted per read, so they are compared by content).
    finished_after = final_results(service, gallery.token, finished_before)
    for reference_id, body in finished_before.items():
        assert without_proof_urls(finished_after[reference_id]) == without_proof_urls(body)
    new_proof_url = matched_faces(finished_after[probe])[0][2]
    assert new_proof_url.startswith(service.base_url)
    assert httpx.get(new_proof_url, timeout=30).content == gallery.photos[subject][0].read_bytes()
    # A proof URL handed out before the restart still works against the restarted service.
    old_token = old_proof_url.rsplit("/get-proof/", 1)[1]
    old_again = httpx.get(f"{service.base_url}/get-proof/{old_token}", timeout=30)
    assert old_again.status_code == 200 and old_again.content == gallery.photos[subject][0].read_bytes()

    # Enrolled faces still match: every identity's second photo finds its own enrolled face first.
    search_jobs = [Job(TransactionKind.FACE_SEARCH, gallery.photos[i][1], i) for i in identities]
    with service.http() as http:
        searches = {_submit(http, gallery.token, job): job for job in search_jobs}
    wait_all_final(service, searches, FINISH_TIMEOUT_S)
    search_bodies = final_results(service, gallery.token, searches)
    for reference_id, job in searches.items():
        _check_result(search_bodies[reference_id], job, gallery, age_baseline)
    assert {record.face_id for record in tenant_records(service, gallery.tenant_id)} == records_before
    assert tenant_vectors(service, gallery.tenant_id) == records_before
    poll(lambda: queue_depth(service) == 0, 30, "the work queue to drain")
    print(
        f"FAULTS restart: {len(pending)}/{len(pending)} completed after the restart "
        f"({down['unfinished_late']}/{len(late)} accepted before the shutdown and unfinished, "
        f"{len(injected)} injected while down, 1 of them stranded on a dead consumer); "
        f"{len(searches)}/{len(searches)} identities still matched; restart took {restart_s:.1f} s"
    )
