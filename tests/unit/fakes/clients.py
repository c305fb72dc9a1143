"""The fake ClientStore, RequestAdmission and RateLimiter."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import math
import time
from collections.abc import Callable

from serve_app.domain.identifiers import new_client_id, new_client_secret
from serve_app.stores.interfaces import Admission, ClientInfo, request_counter_key


class FakeClientStore:
    """Secrets are kept only as keyed hashes, compared in constant time."""

    def __init__(self, pepper: bytes = b"unit-test-pepper") -> None:
        self._pepper = pepper
        self._clients: dict[str, ClientInfo] = {}
        self._hashes: dict[str, bytes] = {}  # client_id -> keyed hash of the secret
        self._default_min_score: float | None = None

    def _hash(self, secret: str) -> bytes:
        return hmac.new(self._pepper, secret.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()

    async def create(self, name: str) -> tuple[ClientInfo, str]:
        await asyncio.sleep(0)
        client = ClientInfo(client_id=new_client_id(), name=name, created_at=time.time(), revoked=False)
        secret = new_client_secret()
        self._clients[client.client_id] = client
        self._hashes[client.client_id] = self._hash(secret)
        return client, secret

    async def verify(self, client_id: str, secret: str) -> ClientInfo | None:
        await asyncio.sleep(0)
        client = self._clients.get(client_id)
        expected = self._hashes.get(client_id, b"\0" * 32)
        matches = hmac.compare_digest(expected, self._hash(secret))
        if client is None or client.revoked or not matches:
            return None
        return client

    async def find_by_secret(self, secret: str) -> ClientInfo | None:
        await asyncio.sleep(0)
        digest = self._hash(secret)
        for client_id, stored in self._hashes.items():
            if hmac.compare_digest(stored, digest):
                client = self._clients[client_id]
                return None if client.revoked else client
        return None

    async def get(self, client_id: str) -> ClientInfo | None:
        await asyncio.sleep(0)
        return self._clients.get(client_id)

    async def list(self) -> list[ClientInfo]:
        await asyncio.sleep(0)
        return sorted(self._clients.values(), key=lambda client: client.created_at)

    async def revoke(self, client_id: str) -> bool:
        await asyncio.sleep(0)
        client = self._clients.get(client_id)
        if client is None:
            return False
        self._clients[client_id] = dataclasses.replace(client, revoked=True)
        return True

    async def update_search_settings(
        self, client_id: str, min_score: float | None, max_matches: int | None
    ) -> ClientInfo | None:
        await asyncio.sleep(0)
        client = self._clients.get(client_id)
        if client is None:
            return None
        updated = dataclasses.replace(client, min_score=min_score, max_matches=max_matches)
        self._clients[client_id] = updated
        return updated

    async def default_min_score(self) -> float | None:
        await asyncio.sleep(0)
        return self._default_min_score

    async def set_default_min_score(self, min_score: float | None) -> None:
        await asyncio.sleep(0)
        self._default_min_score = min_score


class FakeRequestAdmission:
    """RequestAdmission over the fake client store and limiter: the same answers as the Redis script
    (nothing counted for an unknown or revoked client)."""

    def __init__(self, clients: FakeClientStore, limiter: FakeRateLimiter) -> None:
        self._clients = clients
        self._limiter = limiter
        self.calls = 0

    async def admit(self, client_id: str, limit: int, window_s: int) -> Admission:
        self.calls += 1
        client = await self._clients.get(client_id)
        if client is None or client.revoked:
            return Admission(active=False)
        return Admission(
            active=True,
            retry_after_s=await self._limiter.hit(request_counter_key(client_id), limit, window_s),
        )


class FakeRateLimiter:
    """Fixed windows, like the Redis limiter: a window opens at a key's first event and lasts window_s;
    every hit counts, refused ones too. The clock is the test's."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # key -> (window end, events counted)
        self._attempts: dict[str, tuple[int, float, float]] = {}  # key -> (count, blocked until, forget at)
        self.hits: list[str] = []

    def _current(self, key: str) -> tuple[float, int] | None:
        window = self._windows.get(key)
        if window is not None and window[0] <= self._clock():
            del self._windows[key]
            return None
        return window

    def _seconds_left(self, end: float) -> int:
        return max(1, math.ceil(end - self._clock()))

    async def hit(self, key: str, limit: int, window_s: int) -> int:
        await asyncio.sleep(0)
        self.hits.append(key)
        end, count = self._current(key) or (self._clock() + window_s, 0)
        self._windows[key] = (end, count + 1)
        return 0 if count + 1 <= limit else self._seconds_left(end)

    async def attempt(
        self, key: str, free_attempts: int, base_s: float, max_s: float, memory_s: float
    ) -> int:
        # No await before the decision: like the Redis script, check and count are one step.
        free_attempts = max(1, free_attempts)
        now = self._clock()
        count, blocked_until, forget_at = self._attempts.get(key, (0, 0.0, 0.0))
        if forget_at <= now:
            count, blocked_until = 0, 0.0
        if blocked_until > now:
            await asyncio.sleep(0)
            return self._seconds_left(blocked_until)
        count += 1
        wait = min(base_s * 2 ** (count - free_attempts), max_s) if count >= free_attempts else 0.0
        self._attempts[key] = (count, now + wait, now + memory_s + wait)
        await asyncio.sleep(0)
        return 0

    async def reset(self, key: str) -> None:
        await asyncio.sleep(0)
        self._windows.pop(key, None)
        self._attempts.pop(key, None)
