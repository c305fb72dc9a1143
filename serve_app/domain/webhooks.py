"""Completion webhooks: the rules, free of I/O (docs/api.md, "Webhooks"; docs/security.md).

Signing follows the Standard Webhooks specification (https://www.standardwebhooks.com): the secret is
`whsec_` + base64 of random bytes, and every request carries `webhook-id`, `webhook-timestamp` (Unix
seconds) and `webhook-signature`, a space-separated list of `v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">`, one per secret in force (two while a rotated-out secret is in its grace).

The address rules are what keeps a webhook from reaching inside the network (server-side request forgery):
a URL is refused unless every address its host resolves to is a global unicast address, or the operator
lists the host in FACESEARCH_WEBHOOK_ALLOWED_HOSTS. The delivery connects to one of the vetted addresses
itself, so the name is never looked up a second time (no DNS rebinding between the check and the connect).

A URL is kept in the form it is sent in, ASCII only: an internationalised host name in IDNA (punycode,
IDNA 2008 with the UTS 46 mapping, as browsers and httpx write it), a non-ASCII path or query
percent-encoded as UTF-8. A client may register either form; both name the same endpoint.

What the webhook store keeps (stores/interfaces.py, WebhookStore) is typed here: the endpoint's shown
config, a claimed event, one line of the delivery log, the queue's statistics.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import random
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import quote, urlsplit

import idna

from serve_app.domain.errors import ValidationFailed

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
MAX_URL_LENGTH = 2048
MAX_HOST_LENGTH = 253  # DNS: a name of at most 253 characters in labels of at most 63
MAX_LABEL_LENGTH = 63
# The event id names the transaction: a transaction becomes final once, so it has one event, and every
# retry and redelivery of it carries the same id, which is what receivers deduplicate by.
EVENT_ID_PREFIX = "evt_"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud instance metadata endpoints that are not already link-local or private: refused whatever the
# general rule says (Alibaba's 100.100.100.200 sits in the shared 100.64.0.0/10; AWS' IPv6 endpoint in
# fd00:ec2::/32). Listed so the refusal names them.
_METADATA = {
    ipaddress.ip_address("169.254.169.254"),
    ipaddress.ip_address("169.254.170.2"),
    ipaddress.ip_address("100.100.100.200"),
    ipaddress.ip_address("fd00:ec2::254"),
}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class EventType(StrEnum):
    COMPLETED = "transaction.completed"
    FAILED = "transaction.failed"

    @classmethod
    def of_state(cls, state: str) -> EventType:
        return cls.COMPLETED if state == "completed" else cls.FAILED


def event_id(reference_id: str) -> str:
    return f"{EVENT_ID_PREFIX}{reference_id}"


def reference_of_event(event: str) -> str | None:
    return event[len(EVENT_ID_PREFIX) :] if event.startswith(EVENT_ID_PREFIX) else None


# -- secrets and signatures --------------------------------------------------------------------------------


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key a `whsec_` secret stands for."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signature_header(keys: list[bytes], message_id: str, timestamp: int, body: bytes) -> str:
    return " ".join(signature(key, message_id, timestamp, body) for key in keys)


# -- URLs and addresses ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WebhookUrl:
    """A registered endpoint, split the way the delivery needs it: the host to resolve (and to name in Host
    and TLS SNI), the port to connect to and the request target."""

    url: str
    https: bool
    host: str
    port: int
    target: str

    @property
    def host_header(self) -> str:
        default = 443 if self.https else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def ascii_host(host: str) -> str:
    """The host name as DNS and HTTP carry it: lower case, each non-ASCII label in IDNA (UTS 46 mapping,
    then punycode: "Bücher.example" is "xn--bcher-kva.example"), no trailing dot. An address is returned
    as it is. ValueError when the name cannot be a DNS name (a label IDNA refuses, or longer than DNS
    allows)."""
    host = host.rstrip(".")
    if literal_address(host) is not None:
        return host
    if not host.isascii():
        try:
            mapped = idna.uts46_remap(host, std3_rules=False, transitional=False)
            host = ".".join(
                label if label.isascii() else idna.alabel(label).decode("ascii")
                for label in mapped.rstrip(".").split(".")
            )
        except idna.IDNAError as error:
            raise ValueError(f"not an internationalised domain name ({error})") from None
    host = host.lower()
    labels = host.split(".")
    if len(host) > MAX_HOST_LENGTH or any(not 1 <= len(label) <= MAX_LABEL_LENGTH for label in labels):
        raise ValueError(
            f"a host name has labels of 1 to {MAX_LABEL_LENGTH} characters, {MAX_HOST_LENGTH} in all"
        )
    return host


def _percent_encoded(text: str) -> str:
    """text with every non-ASCII character percent-encoded as UTF-8 (what is ASCII is kept as written)."""
    return _NON_ASCII.sub(lambda found: quote(found.group(0), safe=""), text)


def parse_url(url: str, allowed_hosts: frozenset[str]) -> WebhookUrl:
    """The URL's parts, or ValidationFailed naming the rule it breaks: absolute http(s) without
    credentials or fragment, https unless the host is allowed by the operator (allowed_hosts in
    ascii_host's form). A URL with non-ASCII characters is returned in its ASCII form (the module's
    docstring), which is what is stored and sent."""

    def refuse(problem: str) -> ValidationFailed:
        return ValidationFailed(f"The webhook URL is refused: {problem}.", {"url": problem})

    if not url or len(url) > MAX_URL_LENGTH or any(ord(c) <= 32 or ord(c) == 127 for c in url):
        raise refuse(f"must be an absolute URL of at most {MAX_URL_LENGTH} characters, without spaces")
    try:
        parts = urlsplit(url)
        port = parts.port
        written_host = parts.hostname or ""
    except ValueError:
        raise refuse("is not a valid URL") from None
    if parts.scheme not in ("https", "http") or not written_host.rstrip("."):
        raise refuse("must be an https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise refuse("must not carry credentials")
    if parts.fragment:
        raise refuse("must not have a fragment")
    try:
        host = ascii_host(written_host)
    except ValueError as error:
        raise refuse(f"its host is {error}") from None
    if parts.scheme != "https" and host not in allowed_hosts:
        raise refuse("must use https")
    https = parts.scheme == "https"
    path, query = _percent_encoded(parts.path), _percent_encoded(parts.query)
    target = (path or "/") + (f"?{query}" if query else "")
    if not url.isascii():
        netloc = f"[{host}]" if ":" in host else host
        url = f"{parts.scheme}://{netloc}{f':{port}' if port is not None else ''}{path}"
        url += f"?{query}" if query else ""
        if len(url) > MAX_URL_LENGTH:
            raise refuse(f"must be at most {MAX_URL_LENGTH} characters once encoded")
    return WebhookUrl(url, https, host, port or (443 if https else 80), target)


def address_problem(address: IPAddress) -> str | None:
    """Why a webhook may not connect to this address (None: a global unicast address it may use). An
    IPv6 address that carries an IPv4 one (mapped, NAT64, 6to4, Teredo) is judged by the IPv4 address."""
    if address in _METADATA:
        return "a cloud metadata address"
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is None and address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is not None:
            return address_problem(embedded)
    for problem, applies in (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
    ):
        if applies:
            return f"a {problem} address"
    if not address.is_global:  # shared (100.64/10), documentation, benchmarking ranges...
        return "not a global address"
    return None


def vet_addresses(host: str, addresses: list[str]) -> list[IPAddress]:
    """The host's resolved addresses once every one of them is allowed; ValidationFailed otherwise. All
    of them, not just the first: a name that resolves to one public and one private address could be
    answered in either order."""
    if not addresses:
        raise ValidationFailed(
            f"The webhook URL is refused: {host} does not resolve.", {"url": "host does not resolve"}
        )
    vetted = []
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])  # a link-local's zone is refused anyway
        problem = address_problem(address)
        if problem is not None:
            raise ValidationFailed(
                f"The webhook URL is refused: {host} resolves to {address}, {problem}.",
                {"url": f"resolves to {problem}"},
            )
        vetted.append(address)
    return vetted


def literal_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# -- retries -----------------------------------------------------------------------------------------------


def retry_delay_s(attempt: int, base_s: float, max_delay_s: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(max, base * 2^(attempt-1))], so receivers
    coming back after an outage are not hit by every sender's retry at the same instant."""
    ceiling = min(max_delay_s, base_s * 2.0 ** min(max(attempt - 1, 0), 62))
    return (rng or random).uniform(0.0, ceiling)


def event_payload(event: str, kind: EventType, timestamp: str, data: dict[str, Any]) -> dict[str, Any]:
    """The body's shape (Standard Webhooks: type, timestamp, data)."""
    return {"id": event, "type": kind.value, "timestamp": timestamp, "data": data}


# -- what the webhook store keeps (stores/interfaces.py, WebhookStore) -------------------------------------


class SecretUnreadable(Exception):
    """A stored secret whose key is no longer in the key ring (or that was tampered with)."""


@dataclass(frozen=True)
class WebhookConfig:
    """What may be shown of a tenant's webhook: never the secret."""

    url: str | None
    created_at: float
    updated_at: float
    secret_rotated_at: float | None
    previous_secret_until: float | None  # s; the rotated-out secret still signs until then


@dataclass(frozen=True)
class ClaimedEvent:
    event_id: str
    tenant: str
    reference_id: str
    state: str  # the transaction's final state
    final_at_ms: int
    since_ms: int  # when the current delivery window began (the final write, or the last redelivery)
    attempt: int  # this attempt's number (1 for the first)


class Settlement(StrEnum):
    """How an attempt settles its event."""

    RETRY = "retry"  # due again at the given time
    DELIVERED = "delivered"
    DEAD = "dead"


@dataclass(frozen=True)
class DeliveryAttempt:
    """One line of a tenant's delivery log."""

    event_id: str
    reference_id: str
    attempt: int
    at: float
    outcome: str  # delivered, retrying, dead
    status_code: int | None
    error: str | None
    duration_ms: float
    next_attempt_at: float | None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> DeliveryAttempt:
        return cls(**json.loads(raw))

    @property
    def in_words(self) -> str:
        """The attempt's outcome as an event remembers its last one: the status, else the error."""
        return f"{self.status_code}" if self.status_code is not None else (self.error or "")


# The totals of settled attempts, by outcome (the metrics' labels).
OUTCOMES = ("delivered", "retried", "dead")


@dataclass(frozen=True)
class QueueStats:
    pending: int
    oldest_age_s: float  # of the oldest undelivered event (0: none)
    totals: dict[str, int]  # settled attempts by outcome (OUTCOMES), since the deployment began
