"""Webhook rules without I/O: the address rules (server-side request forgery), URL parsing and its ASCII
form, Standard Webhooks signatures (the specification's own test vector) and the client's verify_webhook,
the backoff; registration and the retry schedule on the fake webhook store."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import random

import pytest
from pydantic import SecretStr

from facesearch_client import WebhookVerificationError, verify_webhook
from serve_app.domain.errors import ValidationFailed
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.domain.webhooks import (
    IPAddress,
    WebhookUrl,
    address_problem,
    event_id,
    new_secret,
    parse_url,
    retry_delay_s,
    secret_key,
    signature,
    signature_header,
    vet_addresses,
)
from serve_app.pipelines.webhooks import WebhookDeliverer, WebhookPolicy, WebhookService, vetted_addresses
from serve_app.settings import AuthSettings, Settings, WebhookSettings
from serve_app.wiring.webhooks import webhook_policy
from tests.unit.fakes import FakeTransactionStore, FakeWebhookStore, ManualClock

TENANT = "cl_0123456789abcdef01234567"

REFUSED = {
    "127.0.0.1": "loopback",
    "127.255.0.9": "loopback",
    "::1": "loopback",
    "0.0.0.0": "unspecified",
    "::": "unspecified",
    "10.0.0.1": "private",
    "172.16.5.4": "private",
    "192.168.1.1": "private",
    "fd12:3456::1": "private",
    "169.254.10.10": "link-local",
    "fe80::1": "link-local",
    "224.0.0.1": "multicast",
    "ff02::1": "multicast",
    "240.0.0.1": "private",  # 240/4 is in Python's private table (reserved too)
    "169.254.169.254": "metadata",
    "100.100.100.200": "metadata",
    "fd00:ec2::254": "metadata",
    "100.64.0.1": "not a global",
    "192.0.2.10": "documentation",  # TEST-NET-1
    "::ffff:127.0.0.1": "loopback",  # IPv4-mapped
    "::ffff:10.1.1.1": "private",
    "::ffff:169.254.169.254": "metadata",
    "64:ff9b::a00:1": "private",  # NAT64 of 10.0.0.1
    "2002:a00:1::1": "private",  # 6to4 of 10.0.0.1
}
ALLOWED = ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", sorted(REFUSED))
def test_internal_addresses_are_refused(address: str) -> None:
    problem = address_problem(ipaddress.ip_address(address))
    assert problem is not None
    expected = REFUSED[address]
    assert expected in problem or expected == "documentation"


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_problem(ipaddress.ip_address(address)) is None


def test_one_internal_address_among_public_ones_refuses_the_host() -> None:
    with pytest.raises(ValidationFailed, match=r"10\.0\.0\.7"):
        vet_addresses("rebind.example", ["8.8.8.8", "10.0.0.7"])
    with pytest.raises(ValidationFailed, match="does not resolve"):
        vet_addresses("nothing.example", [])
    assert [str(a) for a in vet_addresses("ok.example", ["8.8.8.8"])] == ["8.8.8.8"]


def test_urls_need_https_a_host_and_no_credentials_unless_the_host_is_allowed() -> None:
    parsed = parse_url("https://Hooks.Example.com./in?x=1", frozenset())
    assert (parsed.host, parsed.port, parsed.target, parsed.host_header) == (
        "hooks.example.com",
        443,
        "/in?x=1",
        "hooks.example.com",
    )
    assert parse_url("https://[2606:4700::1]:8443", frozenset()).host_header == "[2606:4700::1]:8443"
    for bad in (
        "http://hooks.example.com/",
        "ftp://hooks.example.com/",
        "https://user:pw@hooks.example.com/",
        "https://hooks.example.com/#frag",
        "https:///nohost",
        "https://hooks.example.com/a b",
        "https://hooks.example.com:99999/",
        "https://" + "a" * 3000 + ".com/",
        "",
    ):
        with pytest.raises(ValidationFailed):
            parse_url(bad, frozenset())
    assert parse_url("http://127.0.0.1:8080/", frozenset({"127.0.0.1"})).https is False


def test_the_name_is_resolved_once_and_every_answer_vetted() -> None:
    lookups: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return {"public.example": ["8.8.8.8"], "inside.example": ["8.8.8.8", "192.168.0.3"]}[host]

    async def scenario() -> None:
        policy = WebhookPolicy()
        good = await vetted_addresses(parse_url("https://public.example/", frozenset()), policy, resolve)
        assert [str(a) for a in good] == ["8.8.8.8"]
        with pytest.raises(ValidationFailed, match="private"):
            await vetted_addresses(parse_url("https://inside.example/", frozenset()), policy, resolve)
        literal = await vetted_addresses(parse_url("https://8.8.4.4/", frozenset()), policy, resolve)
        assert [str(a) for a in literal] == ["8.8.4.4"]  # a literal is not looked up
        allowed = WebhookPolicy(allowed_hosts=frozenset({"inside.example"}))
        pinned = await vetted_addresses(parse_url("https://inside.example/", frozenset()), allowed, resolve)
        assert [str(a) for a in pinned] == ["8.8.8.8", "192.168.0.3"]

    asyncio.run(scenario())
    assert lookups == ["public.example", "inside.example", "inside.example"]


def test_signatures_follow_standard_webhooks() -> None:
    # The specification's published test vector.
    key = secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert signature(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == expected
    headers = {
        "Webhook-Id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "Webhook-Timestamp": "1614265330",
        "Webhook-Signature": f"v1,bm90IGl0 v2,{expected[3:]} {expected}",
    }
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    assert verify_webhook(secret, headers, body, now=1614265330 + 299) == {"test": 2432232314}
    with pytest.raises(WebhookVerificationError, match="tolerance"):
        verify_webhook(secret, headers, body, now=1614265330 + 301)
    with pytest.raises(WebhookVerificationError, match="no signature"):
        verify_webhook(new_secret(), headers, body, now=1614265330)
    with pytest.raises(WebhookVerificationError, match="no signature"):
        verify_webhook(secret, {**headers, "webhook-id": "msg_other"}, body, now=1614265330)
    with pytest.raises(WebhookVerificationError, match="missing"):
        verify_webhook(secret, {"webhook-id": "x"}, body)
    with pytest.raises(WebhookVerificationError, match="secret"):
        verify_webhook("whsec_***", headers, body, now=1614265330)


def test_several_keys_sign_side_by_side() -> None:
    first, second = secret_key(new_secret()), secret_key(new_secret())
    header = signature_header([first, second], "evt_1", 1700000000, b"{}")
    assert header.split(" ") == [signature(k, "evt_1", 1700000000, b"{}") for k in (first, second)]


def test_backoff_is_exponential_with_full_jitter_and_capped() -> None:
    rng = random.Random(7)
    for attempt, ceiling in ((1, 5.0), (2, 10.0), (3, 20.0), (10, 600.0), (200, 600.0)):
        delays = [retry_delay_s(attempt, 5.0, 600.0, rng) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8 and min(delays) < ceiling * 0.2  # spread over the whole range


def test_urls_are_kept_in_their_ascii_form() -> None:
    parsed = parse_url("https://Bücher.Example:8443/pfad/ä?q=é&x=1", frozenset())
    assert parsed.url == "https://xn--bcher-kva.example:8443/pfad/%C3%A4?q=%C3%A9&x=1"
    assert (parsed.host, parsed.port, parsed.target) == (
        "xn--bcher-kva.example",
        8443,
        "/pfad/%C3%A4?q=%C3%A9&x=1",
    )
    assert parsed.host_header == "xn--bcher-kva.example:8443"
    # Already ASCII: kept as written (escapes included), whatever its case.
    ascii_url = "https://Hooks.example.com/a%20b?c=%C3%A9"
    assert parse_url(ascii_url, frozenset()).url == ascii_url
    assert parse_url("https://faß.example/", frozenset()).host == "xn--fa-hia.example"  # IDNA 2008
    assert parse_url(parse_url("https://bücher.example/ä", frozenset()).url, frozenset()).target == "/%C3%A4"
    for bad, problem in (
        ("https://☃.example/", "internationalised"),
        ("https://" + "a" * 64 + ".example/", "labels"),
        ("https://" + ".".join(["a" * 60] * 5) + "/", "labels"),
        ("https://a..example/", "labels"),
    ):
        with pytest.raises(ValidationFailed, match=problem):
            parse_url(bad, frozenset())


def test_an_operator_may_allow_a_host_as_it_is_written() -> None:
    policy = WebhookPolicy(allowed_hosts=frozenset({"Bücher.test", "127.0.0.1"}))
    assert policy.allowed_hosts == {"xn--bcher-kva.test", "127.0.0.1"}
    assert parse_url("http://bücher.test/in", policy.allowed_hosts).https is False


def test_a_name_that_does_not_resolve_in_time_is_refused_at_registration() -> None:
    async def hangs(host: str, port: int) -> list[str]:
        await asyncio.Event().wait()
        return []

    async def scenario() -> None:
        store = FakeWebhookStore()
        service = WebhookService(store, WebhookPolicy(connect_timeout_s=0.05), hangs)
        with pytest.raises(ValidationFailed, match="timed out") as refused:
            await service.register(TENANT, "https://slow-dns.example/hook")
        assert refused.value.details == {"url": "host does not resolve"}
        assert await store.get(TENANT) is None

    asyncio.run(scenario())


def test_a_failing_event_is_retried_on_the_documented_schedule_then_dead() -> None:
    """Full-jitter backoff (the n-th retry below min(max, base x 2^(n-1))) until give_up_after_s after the
    event was queued, the last retry at that moment, then dead: on the fake store, a clock moved by hand, a
    schedule from the settings."""
    hooks = WebhookSettings(retry_base_s=5.0, retry_max_delay_s=60.0, give_up_after_s=600.0)
    schedule = webhook_policy(Settings(auth=AuthSettings(secret_key=SecretStr("k" * 32)), webhooks=hooks))
    clock = ManualClock(1_700_000_000.0)
    store = FakeWebhookStore(clock=clock)
    transactions = FakeTransactionStore(clock=clock, webhooks=store)
    outcomes: list[str] = []

    async def refused(
        addresses: list[IPAddress], url: WebhookUrl, headers: list[tuple[str, str]], body: bytes,
        policy: WebhookPolicy,
    ) -> int:  # fmt: skip
        return 503

    async def no_lookup(host: str, port: int) -> list[str]:
        raise AssertionError("an address is not looked up")

    async def load(tenant: str, reference_id: str) -> Transaction | None:
        return await transactions.get(reference_id)

    deliverer = WebhookDeliverer(
        store,
        load,
        lambda tx: {"reference_id": tx.reference_id},
        schedule,
        resolve=no_lookup,
        send=refused,
        on_outcome=outcomes.append,
        clock=clock,
        rng=random.Random(3),
    )

    async def scenario() -> None:
        await store.set_url(TENANT, "https://8.8.8.8/hook")
        tx = Transaction(
            reference_id=new_reference_id(),
            tenant_id=TENANT,
            kind=TransactionKind.AGE_ESTIMATION,
            state=TransactionState.QUEUED,
            created_at=clock.now,
            updated_at=clock.now,
            image_key="uploads/x",
            enroll_face=False,
        )
        await transactions.create_and_enqueue(tx)
        await transactions.mark_processing(tx.reference_id)
        await transactions.fail(tx.reference_id, "no face found")
        queued_at = clock.now
        while (await store.event_state(event_id(tx.reference_id)))["state"] != "dead":
            assert await deliverer.run_once() == 1
            (last,) = await store.deliveries(TENANT, 1)
            if last.next_attempt_at is not None:
                clock.now = last.next_attempt_at
        log = list(reversed(await store.deliveries(TENANT, 100)))
        assert [a.status_code for a in log] == [503] * len(log)
        assert [a.outcome for a in log] == ["retrying"] * (len(log) - 1) + ["dead"]
        for n, (attempt, following) in enumerate(itertools.pairwise(log), start=1):
            assert attempt.attempt == n and following.at == attempt.next_attempt_at
            wait = following.at - attempt.at
            assert 0 <= wait <= min(60.0, 5.0 * 2 ** (n - 1))
        assert log[-1].at == queued_at + 600.0  # the last attempt at the end of the window, not after it
        assert outcomes == ["retried"] * (len(log) - 1) + ["dead"]

    asyncio.run(scenario())
