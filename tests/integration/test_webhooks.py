"""Completion webhooks on a real Redis (embedded redis-server on 127.0.0.1) against a real HTTP receiver on
127.0.0.1, which each test's policy allows explicitly: the pipeline objects directly, no Ray."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest
from pydantic import SecretStr

from facesearch_client import WebhookVerificationError, verify_webhook
from serve_app.api.app import create_app
from serve_app.api.results import result_response
from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import ValidationFailed
from serve_app.domain.keys import WEBHOOK_SECRETS, KeyRing
from serve_app.domain.outcomes import AgeEstimationOutcome
from serve_app.domain.transactions import Transaction
from serve_app.domain.webhooks import SecretUnreadable, secret_key
from serve_app.launch.cli import _clients, _webhooks
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.commands import AgeEstimationCommand
from serve_app.pipelines.processing import TransactionProcessor
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.webhooks import WebhookService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import AuthSettings, MilvusSettings, RedisSettings, Settings, WebhookSettings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis, text
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.redis_webhooks import RedisWebhookStore, SecretCipher
from serve_app.wiring.api import build_api_services
from serve_app.wiring.stores import gallery_store, redis_stores, result_archive
from serve_app.wiring.webhooks import build_deliverer, webhook_policy, webhook_store
from tests.integration.webhook_support import (
    KEY,
    TENANT,
    Pipeline,
    Receiver,
    finish,
    free_port,
    pipeline,
    policy,
)
from tests.unit.fakes import TEST_POLICY, ScriptedAnalysis, embedding, face, solid_png

T = TypeVar("T")
RED = (200, 30, 30)
REPO = Path(__file__).resolve().parents[2]
# Hang guard, not a speed bound: each attempt has its own timeouts of seconds.
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("webhooks-redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(scenario(), HANG_GUARD_S)

    return asyncio.run(guarded())


def fresh(redis_url: str, **overrides: Any) -> Pipeline:
    return pipeline(redis_url, f"t{uuid.uuid4().hex[:8]}:", policy(**overrides))


def reference() -> str:
    return uuid.uuid4().hex


async def until(condition: Callable[[], Awaitable[bool]], step: Callable[[], Awaitable[object]]) -> None:
    while not await condition():
        await step()
        await asyncio.sleep(0.02)


async def idle() -> None:
    """A step that does nothing: until then only waits."""


def test_a_delivered_event_verifies_with_the_client_helper_and_carries_the_result(redis_url: str) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        receiver = await Receiver().start()
        registration = await hooks.service.register(TENANT, receiver.url)
        assert registration.secret is not None and registration.secret.startswith("whsec_")
        completed, failed = reference(), reference()
        await hooks.finish(completed)
        await hooks.finish(failed, fail=True)
        deliverer = hooks.deliverer(policy())
        assert await deliverer.run_once() == 2
        assert sorted(receiver.event_ids()) == sorted([f"evt_{completed}", f"evt_{failed}"])
        events = {}
        for item in receiver.received:
            event = verify_webhook(registration.secret, item.headers, item.body)
            events[event["data"]["reference_id"]] = event
            with pytest.raises(WebhookVerificationError):  # one byte changed
                verify_webhook(registration.secret, item.headers, item.body[:-1] + b" ")
            with pytest.raises(WebhookVerificationError):  # an old request replayed
                verify_webhook(registration.secret, item.headers, item.body, now=10_000.0)
        done = events[completed]
        assert done["type"] == "transaction.completed" and done["id"] == f"evt_{completed}"
        assert done["data"]["transaction_type"] == "age_estimation" and done["data"]["state"] == "completed"
        # The very body /result answers for it, rendered by the same function.
        tx = await hooks.transactions.get(completed)
        assert tx is not None
        signer = TokenSigner(KEY, 900, 900)
        assert done["data"]["result"] == orjson.loads(result_response(tx, "", signer, created=False).body)
        assert done["data"]["result"]["result"]["data"]["age"] == 31
        assert events[failed]["type"] == "transaction.failed"
        assert events[failed]["data"]["result"]["errors"] == {"transaction": "no face found"}
        log = await hooks.service.deliveries(TENANT, 10)
        assert {(a.outcome, a.status_code) for a in log} == {("delivered", 204)}
        assert (await hooks.store.event_state(f"evt_{completed}"))["state"] == "delivered"
        assert await deliverer.run_once() == 0  # delivered once, not again
        stats = await hooks.store.stats(0)
        assert (stats.pending, stats.totals) == (0, {"delivered": 2, "retried": 0, "dead": 0})
        await receiver.stop()

    run(scenario)


def test_the_event_is_queued_by_the_final_write_itself_and_only_for_a_registered_tenant(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        before = reference()
        await hooks.finish(before)  # no webhook yet: nothing queued
        assert await hooks.store.event_state(f"evt_{before}") == {}
        await hooks.service.register(TENANT, "http://127.0.0.1:9/")
        after = reference()
        await hooks.finish(after)
        # Already there when complete() returns: no step after the final write could be lost.
        assert (await hooks.store.event_state(f"evt_{after}"))["state"] == "pending"
        again = AgeEstimationOutcome(age=1, under_18=100, under_21=100)
        assert not await hooks.transactions.complete(after, again)  # already final: no second event
        assert (await hooks.store.stats(0)).pending == 1
        await hooks.service.disable(TENANT)
        last = reference()
        await hooks.finish(last)
        assert await hooks.store.event_state(f"evt_{last}") == {}

    run(scenario)


def test_a_receiver_down_for_a_while_then_back_gets_every_event(redis_url: str) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        port = free_port()
        receiver = Receiver(port=port)  # not started: connections are refused
        await hooks.service.register(TENANT, receiver.url)
        references = [reference() for _ in range(6)]
        for ref in references:
            await hooks.finish(ref)
        outcomes: list[str] = []
        deliverer = hooks.deliverer(policy(), on_outcome=outcomes.append)
        for _ in range(3):  # down: each event fails and is retried later
            await deliverer.run_once()
            await asyncio.sleep(0.25)
        assert outcomes and set(outcomes) == {"retried"}
        failures = await hooks.service.deliveries(TENANT, 50)
        assert all(a.status_code is None and "connect failed" in (a.error or "") for a in failures)
        assert all(a.next_attempt_at is not None for a in failures)
        await receiver.start()  # back, on the same port

        async def all_delivered() -> bool:
            states = [await hooks.store.event_state(f"evt_{ref}") for ref in references]
            return all(state["state"] == "delivered" for state in states)

        await until(all_delivered, deliverer.run_once)
        assert sorted(set(receiver.event_ids())) == sorted(f"evt_{ref}" for ref in references)
        assert outcomes.count("delivered") == len(references)
        totals = (await hooks.store.stats(0)).totals
        assert totals["delivered"] == len(references) and totals["retried"] == outcomes.count("retried")
        assert (await hooks.store.stats(0)).pending == 0
        await receiver.stop()

    run(scenario)


def test_a_worker_killed_mid_delivery_loses_nothing(redis_url: str) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        # The first request is held unanswered (the child is killed while it waits), later ones answered.
        receiver = await Receiver(answer=lambda n: (None, 200) if n == 1 else (0.0, 200)).start()
        await hooks.service.register(TENANT, receiver.url)
        ref = reference()
        await hooks.finish(ref)
        prefix = hooks.store.prefix
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.integration.webhook_support", redis_url, prefix,
            cwd=REPO, stdout=asyncio.subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            await asyncio.wait_for(receiver.arrived.wait(), HANG_GUARD_S / 2)
            child.send_signal(signal.SIGKILL)  # mid-delivery: the request is out, no answer yet
        finally:
            if child.returncode is None:
                child.kill()
            await child.wait()
        # Nothing settled: the child died holding the event's lease.
        assert (await hooks.store.event_state(f"evt_{ref}"))["state"] == "delivering"
        assert await hooks.service.deliveries(TENANT, 10) == []
        deliverer = hooks.deliverer(policy())
        assert await deliverer.run_once() == 0  # the lease still holds it

        async def delivered() -> bool:
            return (await hooks.store.event_state(f"evt_{ref}"))["state"] == "delivered"

        await until(delivered, deliverer.run_once)  # due again once the child's lease lapsed
        assert receiver.event_ids() == [f"evt_{ref}", f"evt_{ref}"]  # at least once: here twice, same id
        log = await hooks.service.deliveries(TENANT, 10)
        assert [(a.attempt, a.outcome) for a in log] == [(2, "delivered")]
        await receiver.stop()

    run(scenario)


def test_a_slow_receiver_times_out_and_is_retried(redis_url: str) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        receiver = await Receiver(answer=lambda n: (2.0, 200) if n == 1 else (0.0, 200)).start()
        await hooks.service.register(TENANT, receiver.url)
        ref = reference()
        await hooks.finish(ref)
        deliverer = hooks.deliverer(policy(read_timeout_s=0.3, total_timeout_s=0.5, lease_s=2.0))
        await deliverer.run_once()
        (first,) = await hooks.service.deliveries(TENANT, 10)
        assert (
            first.outcome == "retrying" and first.status_code is None and "timed out" in (first.error or "")
        )

        async def delivered() -> bool:
            return (await hooks.store.event_state(f"evt_{ref}"))["state"] == "delivered"

        await until(delivered, deliverer.run_once)
        assert receiver.event_ids() == [f"evt_{ref}", f"evt_{ref}"]
        assert [a.outcome for a in await hooks.service.deliveries(TENANT, 10)] == ["delivered", "retrying"]
        await receiver.stop()

    run(scenario)


def test_non_2xx_answers_are_retried_and_the_event_dies_after_the_window(redis_url: str) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        receiver = await Receiver(answer=lambda _n: (0.0, 302)).start()  # a redirect is not followed
        await hooks.service.register(TENANT, receiver.url)
        ref = reference()
        await hooks.finish(ref)
        outcomes: list[str] = []
        deliverer = hooks.deliverer(policy(give_up_after_s=0.5), on_outcome=outcomes.append)

        async def dead() -> bool:
            return (await hooks.store.event_state(f"evt_{ref}")).get("state") == "dead"

        await until(dead, deliverer.run_once)
        assert outcomes[-1] == "dead" and set(outcomes[:-1]) == {"retried"}
        assert {a.status_code for a in await hooks.service.deliveries(TENANT, 50)} == {302}
        assert all(item.headers.get("host") == f"127.0.0.1:{receiver.port}" for item in receiver.received)
        # Redelivery: a fresh window, delivered once the receiver answers 2xx.
        receiver.answer = lambda _n: (0.0, 200)
        assert await hooks.service.redeliver(TENANT, f"evt_{ref}") is True
        with pytest.raises(Exception, match="No such event"):
            await hooks.service.redeliver("cl_another", f"evt_{ref}")

        async def delivered() -> bool:
            return (await hooks.store.event_state(f"evt_{ref}"))["state"] == "delivered"

        await until(delivered, deliverer.run_once)
        await receiver.stop()

    run(scenario)


def test_refused_addresses_are_refused_without_a_connection(redis_url: str) -> None:
    """A listening socket on a refused address: a connection attempt would complete the handshake into its
    backlog, so accept() finding nothing shows none was made."""

    async def scenario() -> None:
        strict = policy(allowed_hosts=frozenset())  # 127.0.0.1 not allowed here
        hooks = fresh(redis_url, allowed_hosts=frozenset())
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        try:
            for url in (
                f"https://127.0.0.1:{port}/",
                f"https://localhost:{port}/",
                f"https://[::ffff:127.0.0.1]:{port}/",
                f"http://127.0.0.1:{port}/",
            ):
                with pytest.raises(ValidationFailed):
                    await hooks.service.register(TENANT, url)
            assert await hooks.store.get(TENANT) is None
            # Registered while the operator allowed the host, refused at delivery once it no longer is.
            allowing = fresh(redis_url)
            await allowing.service.register(TENANT, f"https://127.0.0.1:{port}/")
            ref = reference()
            await allowing.finish(ref)
            await allowing.deliverer(strict).run_once()
            (attempt,) = await allowing.service.deliveries(TENANT, 10)
            assert attempt.outcome == "retrying" and "refused" in (attempt.error or "")
            assert "loopback" in (attempt.error or "")
            with pytest.raises(BlockingIOError):
                listener.accept()
        finally:
            listener.close()

    run(scenario)


def test_a_rotated_secret_signs_beside_the_old_one_for_its_grace(redis_url: str) -> None:
    async def scenario() -> None:
        hooks = fresh(redis_url)
        receiver = await Receiver().start()
        first = (await hooks.service.register(TENANT, receiver.url)).secret
        assert first is not None
        assert (await hooks.service.register(TENANT, receiver.url)).secret is None  # shown once only
        second = (await hooks.service.rotate_secret(TENANT)).secret
        assert second is not None and second != first
        ref = reference()
        await hooks.finish(ref)
        await hooks.deliverer(policy()).run_once()
        (item,) = receiver.received
        assert len(item.headers["webhook-signature"].split(" ")) == 2
        for secret in (first, second, [second, "whsec_" + "A" * 44]):
            assert verify_webhook(secret, item.headers, item.body)["id"] == f"evt_{ref}"
        # Stored sealed: neither secret appears in Redis.
        redis = hooks.store._redis
        raw = await redis.hgetall(f"{hooks.store.prefix}webhook:{TENANT}")
        assert all(first not in v and second not in v for v in raw.values())
        await receiver.stop()

    run(scenario)


def test_the_client_manages_its_webhook_through_the_api(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        redis=RedisSettings(url=redis_url, key_prefix=f"a{uuid.uuid4().hex[:6]}:"),
        milvus=MilvusSettings(uri=None, token=""),
        auth=AuthSettings(secret_key=SecretStr(KEY)),
        webhooks=WebhookSettings(allowed_hosts=("127.0.0.1",)),
    )

    async def scenario() -> None:
        app = create_app(build_api_services(settings))
        info, secret = await redis_stores(settings).clients.create("webhook-api")
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://testserver", headers={"Client-Secret": secret}
        ) as http:
            missing = await http.get("/webhook")
            assert missing.status_code == 404 and missing.json()["status"] is False
            refused = await http.put("/webhook", json={"url": "https://10.1.2.3/hook"})
            assert refused.status_code == 422
            assert refused.json()["errors"] == {"url": "resolves to a private address"}
            plain = await http.put("/webhook", json={"url": "http://203.0.113.9/hook"})
            assert plain.status_code == 422 and plain.json()["errors"] == {"url": "must use https"}
            created = await http.put("/webhook", json={"url": "http://127.0.0.1:9/hook"})
            assert created.status_code == 200, created.text
            data = created.json()["result"]["data"]
            assert data["url"] == "http://127.0.0.1:9/hook" and data["secret"].startswith("whsec_")
            shown = (await http.get("/webhook")).json()["result"]["data"]
            assert shown["secret"] is None and shown["url"] == data["url"]
            again = (await http.put("/webhook", json={"url": "http://127.0.0.1:10/hook"})).json()
            assert again["result"]["data"]["secret"] is None  # shown once, at creation only
            rotated = (await http.post("/webhook/secret")).json()["result"]["data"]
            assert rotated["secret"].startswith("whsec_") and rotated["secret"] != data["secret"]
            assert rotated["previous_secret_valid_until"] is not None
            log = await http.get("/webhook/deliveries", params={"limit": "5"})
            assert log.status_code == 200 and log.json()["result"]["data"] == {"deliveries": []}
            bad_limit = await http.get("/webhook/deliveries", params={"limit": "0"})
            assert bad_limit.status_code == 422 and "limit" in bad_limit.json()["errors"]
            unknown = await http.post(f"/webhook/events/evt_{'0' * 32}/redeliver")
            assert unknown.status_code == 404 and unknown.json()["errors"] == {"event_id": "unknown event"}
            malformed = await http.post("/webhook/events/evt_x/redeliver")
            assert malformed.status_code == 422
            removed = await http.delete("/webhook")
            assert removed.json()["result"]["data"] == {"deleted": True}
            assert (await http.get("/webhook")).status_code == 404
            anonymous = await http.get("/webhook", headers={"Client-Secret": "wrong"})
            assert anonymous.status_code == 401
            paths = (await http.get("/openapi.json")).json()["paths"]
            assert {"/webhook", "/webhook/secret", "/webhook/deliveries"} <= set(paths)
        assert info.client_id

    run(scenario)


def test_a_key_ring_rotation_keeps_secrets_readable_and_reseals_them(redis_url: str) -> None:
    async def scenario() -> None:
        prefix = f"k{uuid.uuid4().hex[:8]}:"
        redis = connect_redis(redis_url)

        def store(ring: str) -> RedisWebhookStore:
            keys = KeyRing.parse(ring).for_purpose(WEBHOOK_SECRETS)
            return RedisWebhookStore(redis, SecretCipher(keys), prefix=prefix)

        old, new = "k1:" + "a" * 32, "k2:" + "b" * 32
        secret = await store(old).set_url(TENANT, "https://hooks.example.com/")
        assert secret is not None
        url, keys = await store(f"{new},{old}").signing_keys(TENANT)  # k2 current, k1 still verifies
        assert url == "https://hooks.example.com/" and keys == [secret_key(secret)]
        sealed = text(await redis.hget(f"{prefix}webhook:{TENANT}", "secret"))
        assert sealed.startswith("k2:")  # moved to the current key when it was read
        assert (await store(new).signing_keys(TENANT))[1] == [secret_key(secret)]  # k1 may go now
        with pytest.raises(SecretUnreadable):  # another tenant's hash does not open it
            await redis.hset(
                f"{prefix}webhook:cl_other", mapping={"url": "https://x.example/", "secret": sealed}
            )
            await store(new).signing_keys("cl_other")
        await redis.aclose()

    run(scenario)


def test_the_cli_registers_shows_rotates_and_lists(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        redis=RedisSettings(url=redis_url, key_prefix=f"c{uuid.uuid4().hex[:6]}:"),
        milvus=MilvusSettings(uri=None, token=""),
        auth=AuthSettings(secret_key=SecretStr(KEY)),
        webhooks=WebhookSettings(allowed_hosts=("127.0.0.1",)),
    )

    async def scenario() -> None:
        info, _ = await redis_stores(settings).clients.create("cli-webhooks")
        client = info.client_id
        assert await _clients(settings, "update", client, webhook_url="https://10.0.0.5/") == 2
        assert "private" in capsys.readouterr().err
        assert await _clients(settings, "update", client, webhook_url="http://127.0.0.1:9/in") == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["webhook_url"] == "http://127.0.0.1:9/in" and shown["webhook_secret"].startswith(
            "whsec_"
        )
        assert await _webhooks(settings, "show", client, None, 20) == 0
        assert "whsec_" not in capsys.readouterr().out
        assert await _webhooks(settings, "rotate-secret", client, None, 20) == 0
        rotated = json.loads(capsys.readouterr().out)["webhook_secret"]
        assert rotated.startswith("whsec_") and rotated != shown["webhook_secret"]
        assert await _webhooks(settings, "deliveries", client, None, 20) == 0
        assert capsys.readouterr().out == ""
        assert await _webhooks(settings, "redeliver", client, "evt_" + "0" * 32, 20) == 1
        assert await _clients(settings, "update", client, webhook_url="none") == 0
        assert json.loads(capsys.readouterr().out)["webhook_url"] is None
        assert await _clients(settings, "update", "cl_nobody", webhook_url="none") == 1
        assert await _clients(settings, "revoke", client) == 0
        assert await _webhooks(settings, "show", client, None, 20) == 1  # revoking removed it

    run(scenario)


def _self_signed(tmp_path: Path, host: str) -> tuple[Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_https_names_the_host_in_sni_and_checks_the_certificate(redis_url: str, tmp_path: Path) -> None:
    """The delivery connects to the pinned address, names the URL's host in TLS (SNI) and refuses a
    certificate no trusted authority signed: the attempt fails before any request is sent."""
    import ssl

    cert, key = _self_signed(tmp_path, "hooks.test")
    server_names: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda _sock, name, _ctx: server_names.append(name)

    async def scenario() -> None:
        requests: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            requests.append(await reader.read(100))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
        port = server.sockets[0].getsockname()[1]

        async def resolve(host: str, _port: int) -> list[str]:
            assert host == "hooks.test"
            return ["127.0.0.1"]

        allowed = policy(allowed_hosts=frozenset({"hooks.test"}))
        hooks = pipeline(redis_url, f"s{uuid.uuid4().hex[:8]}:", allowed)
        await hooks.store.set_url(TENANT, f"https://hooks.test:{port}/in")
        ref = reference()
        await hooks.finish(ref)
        await hooks.deliverer(allowed, resolve=resolve).run_once()
        (attempt,) = await hooks.service.deliveries(TENANT, 10)
        assert attempt.outcome == "retrying" and "CERTIFICATE_VERIFY_FAILED" in (attempt.error or "")
        assert server_names == ["hooks.test"] and requests in ([], [b""])
        server.close()

    run(scenario)


def test_an_internationalised_url_is_kept_in_ascii_and_delivered(redis_url: str) -> None:
    """An IDN host and a non-ASCII path and query are stored as they are sent (IDNA, percent-encoding)
    and delivered; so is such a URL stored before registrations were put in that form."""

    async def scenario() -> None:
        receiver = await Receiver().start()
        asked: list[str] = []

        async def resolve(host: str, port: int) -> list[str]:
            asked.append(host)
            return ["127.0.0.1"] if host == "xn--bcher-kva.test" else []

        # The operator allows the host as people write it.
        allowed = policy(allowed_hosts=frozenset({"Bücher.test"}))
        hooks = fresh(redis_url)
        service = WebhookService(hooks.store, allowed, resolve)
        written = f"http://Bücher.test:{receiver.port}/pfad/ä?q=é&x=1"
        registration = await service.register(TENANT, written)
        stored = f"http://xn--bcher-kva.test:{receiver.port}/pfad/%C3%A4?q=%C3%A9&x=1"
        assert registration.config.url == stored and registration.secret is not None
        first = reference()
        await hooks.finish(first)
        deliverer = hooks.deliverer(allowed, resolve=resolve)
        assert await deliverer.run_once() == 1
        # Registered before the ASCII form was kept: put in it at delivery.
        await hooks.store.set_url(TENANT, written)
        second = reference()
        await hooks.finish(second)
        assert await deliverer.run_once() == 1
        assert receiver.event_ids() == [f"evt_{first}", f"evt_{second}"]
        for item in receiver.received:
            assert item.target == "/pfad/%C3%A4?q=%C3%A9&x=1"
            assert item.headers["host"] == f"xn--bcher-kva.test:{receiver.port}"
            assert (
                verify_webhook(registration.secret, item.headers, item.body)["type"]
                == "transaction.completed"
            )
        assert set(asked) == {"xn--bcher-kva.test"}
        assert [a.outcome for a in await hooks.service.deliveries(TENANT, 10)] == ["delivered", "delivered"]
        with pytest.raises(ValidationFailed, match="internationalised"):
            await service.register(TENANT, "https://☃.example/hook")
        await receiver.stop()

    run(scenario)


def test_an_attempt_that_raises_counts_and_the_event_dies_on_schedule(redis_url: str, tmp_path: Path) -> None:
    """Whatever an attempt raises is a failed attempt: logged, retried with the backoff, and the event is
    dead once its window has passed (a short schedule, set through the settings)."""
    short = WebhookSettings(
        allowed_hosts=("127.0.0.1",),
        retry_base_s=0.05,
        retry_max_delay_s=0.2,
        give_up_after_s=1.0,
        total_timeout_s=2.0,
        lease_s=4.0,
    )
    schedule = webhook_policy(
        Settings(data_dir=tmp_path, auth=AuthSettings(secret_key=SecretStr(KEY)), webhooks=short)
    )

    async def broken_send(*_args: object) -> int:
        raise RuntimeError("a sender that breaks")

    async def scenario() -> None:
        hooks = fresh(redis_url)
        await hooks.store.set_url(TENANT, "http://127.0.0.1:9/in")
        ref = reference()
        await hooks.finish(ref)
        outcomes: list[str] = []
        deliverer = hooks.deliverer(schedule, send=broken_send, on_outcome=outcomes.append)

        async def dead() -> bool:
            return (await hooks.store.event_state(f"evt_{ref}")).get("state") == "dead"

        await until(dead, deliverer.run_once)
        assert outcomes[-1] == "dead" and set(outcomes[:-1]) == {"retried"} and len(outcomes) >= 2
        log = await hooks.service.deliveries(TENANT, 50)
        assert len(log) == len(outcomes)
        assert all(a.error == "internal error: RuntimeError: a sender that breaks" for a in log)
        state = await hooks.store.event_state(f"evt_{ref}")
        final_at = int(state["final_at"]) / 1000
        assert log[0].outcome == "dead" and log[0].at >= final_at + short.give_up_after_s
        retries = [a for a in log if a.outcome == "retrying"]
        assert all(a.next_attempt_at is not None for a in retries)
        assert all(a.next_attempt_at <= final_at + short.give_up_after_s for a in retries)  # type: ignore[operator]

    run(scenario)


HUNG_HOST = "hung-resolver.test"


def test_a_webhook_whose_name_server_hangs_delays_no_other_tenant(
    redis_url: str, milvus_lite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More events due than threads for an endpoint whose name never resolves, in one event loop with a
    worker, as in a worker replica, and asyncio's default pool sized as on the 2-core machines the service
    runs on (min(32, cores + 4) = 6 threads). Another tenant's age estimations are created and completed
    through the worker all the same (upload checks, blob reads and decoding use the default pool), and
    each webhook attempt fails when resolving times out."""
    released = threading.Event()
    lookups: list[str] = []
    system_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == HUNG_HOST:
            lookups.append(host)
            released.wait(HANG_GUARD_S)  # a name server that never answers, until the test ends
            raise socket.gaierror(socket.EAI_AGAIN, "the name server did not answer")
        return system_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    settings = Settings(
        data_dir=tmp_path,
        redis=RedisSettings(url=redis_url, key_prefix=f"h{uuid.uuid4().hex[:6]}:"),
        milvus=MilvusSettings(uri=milvus_lite, token=""),
        auth=AuthSettings(secret_key=SecretStr(KEY)),
        webhooks=WebhookSettings(
            connect_timeout_s=0.5, total_timeout_s=1.0, lease_s=5.0, retry_base_s=0.1, retry_max_delay_s=0.2
        ),
    )
    other_tenant = "cl_76543210fedcba9876543210"
    analysis = ScriptedAnalysis({RED: [face(embedding(1), age=40)]})

    async def scenario() -> None:
        default_pool = ThreadPoolExecutor(max_workers=6)
        asyncio.get_running_loop().set_default_executor(default_pool)
        redis = connect_redis(redis_url)
        prefix = settings.redis.key_prefix
        transactions = RedisTransactionStore(redis, prefix=prefix)
        records = RedisFaceRecordStore(redis, prefix=prefix)
        blobs = LocalBlobStore(tmp_path / "blobs")
        await webhook_store(settings, redis).set_url(TENANT, f"https://{HUNG_HOST}/hook")
        for _ in range(settings.webhooks.batch + 4):  # more events than either pool has threads
            await finish(transactions, TENANT, reference())
        deliverer = build_deliverer(settings, redis, transactions, records, result_archive(settings))
        # The real gallery of the service (age estimations that enrol nothing never reach it).
        gallery = gallery_store(settings, redis)
        processor = TransactionProcessor(transactions, records, gallery, blobs, analysis, TEST_POLICY)
        worker_policy = WorkerPolicy(concurrency=4, stale_after_s=30, max_deliveries=3, claim_block_ms=50)
        worker = QueueWorker("worker-beside-webhooks", transactions, processor, worker_policy)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(deliverer.run(stop)), asyncio.create_task(worker.run(stop))]
        try:

            async def pool_taken() -> bool:  # as many resolutions hang as the default pool has threads
                return len(lookups) >= 6

            await until(pool_taken, idle)
            service = TransactionService(transactions, blobs, 40_000_000)

            async def estimate_ages() -> list[Transaction]:
                created = [
                    await service.create_age_estimation(
                        AgeEstimationCommand(other_tenant, solid_png(RED), enroll_face=False)
                    )
                    for _ in range(4)
                ]

                async def all_final() -> bool:
                    found = [await transactions.get(tx.reference_id) for tx in created]
                    return all(tx is not None and tx.state.is_final for tx in found)

                await until(all_final, idle)
                return [tx for tx in [await transactions.get(tx.reference_id) for tx in created] if tx]

            try:  # a hang guard, not a speed bound: on a starved pool they never end
                final = await asyncio.wait_for(estimate_ages(), 30)
            except TimeoutError:
                raise AssertionError(
                    "another tenant's transactions waited for a webhook's resolver"
                ) from None
            assert [(tx.state.value, tx.result) for tx in final] == [("completed", final[0].result)] * 4
            assert isinstance(final[0].result, AgeEstimationOutcome) and final[0].result.age == 40
            hooks = webhook_store(settings, redis)

            async def attempted() -> bool:
                return bool(await hooks.deliveries(TENANT, 1))

            await until(attempted, idle)
            log = await hooks.deliveries(TENANT, 50)
            assert all(a.outcome == "retrying" for a in log)
            assert all(a.error == f"resolving {HUNG_HOST} timed out after 0.5 s" for a in log)
            assert not released.is_set()  # every resolution of the host was still hanging meanwhile
        finally:
            released.set()
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            await redis.aclose()

    run(scenario)


def test_an_answer_whose_head_passes_the_cap_fails_the_attempt(redis_url: str) -> None:
    """The status line and headers are read up to max_response_bytes (never the body): a 2xx whose head is
    longer is a failed attempt, retried."""

    async def scenario() -> None:
        async def bloated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * 20_000 + b"\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(bloated, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        hooks = fresh(redis_url)
        await hooks.service.register(TENANT, f"http://127.0.0.1:{port}/in")
        await hooks.finish(reference())
        await hooks.deliverer(policy(max_response_bytes=16 * 1024)).run_once()
        (attempt,) = await hooks.service.deliveries(TENANT, 10)
        assert attempt.outcome == "retrying" and attempt.status_code is None
        assert attempt.error == "the answer's head is longer than the response cap"
        server.close()

    run(scenario)
