"""Request limits at the edge: oversized bodies are refused before they are read (by Content-Length when
declared, else while streaming), and the source address that per-source limits count is decided here."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class BodyTooLarge(Exception):
    """Raised from receive() once a streamed body passes the limit; body readers must let it propagate."""


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(send)
            return
        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            {
                "status": False,
                "message": f"The request body exceeds the limit of {self.max_body_bytes} bytes.",
                "errors": {"body": "too large"},
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def parse_networks(cidrs: Iterable[str]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def _address(value: str | None) -> IPAddress | None:
    if not value:
        return None
    try:
        address = ipaddress.ip_address(value.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_source(peer: str | None, forwarded_for: Sequence[str], trusted: Sequence[IPNetwork]) -> str:
    """The address per-source limits count, as a bucket name.

    X-Forwarded-For is believed only as far as it was written by trusted proxies: starting from the peer,
    while the current hop is a trusted proxy, step to the address it says it received the request from
    (the right-most entry not yet used). The first untrusted address is the source, so a client cannot
    pick its own bucket by sending the header itself. With no trusted proxies the header is ignored.
    An IPv6 source counts as its /64, which one host can usually fill with addresses at will.
    """
    address = _address(peer)
    if address is None:
        return "unknown"
    hops = [part for header in forwarded_for for part in header.split(",")]
    while hops and any(address in network for network in trusted):
        forwarded = _address(hops.pop())
        if forwarded is None:
            break  # a malformed entry: the trusted hop that passed it on is all that is known
        address = forwarded
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
