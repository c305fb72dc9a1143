"""Webhook rules without I/O: the address rules (server-side request forgery), URL parsing, Standard
Webhooks signatures (the specification's own test vector) and the client's verify_webhook, the backoff."""

from __future__ import annotations

import asyncio
import ipaddress
import random

import pytest

from facesearch_client import WebhookVerificationError, verify_webhook
from serve_app.domain.errors import ValidationFailed
from serve_app.domain.webhooks import (
    address_problem,
    new_secret,
    parse_url,
    retry_delay_s,
    secret_key,
    signature,
    signature_header,
    vet_addresses,
)
from serve_app.pipelines.webhooks import WebhookPolicy, vetted_addresses

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
