"""Who is calling: client credentials, login throttling and request limits.

Throttling is built so that nobody can use it against someone else:
- failed logins are counted per (client_id, source address), so an attacker's failures from one address
  never lock the real client out from its own; each attempt past the allowance waits twice as long as the
  one before (capped), and checking and counting are one atomic step, so parallel attempts cannot slip
  through a check made before any of them was counted;
- every login, and every request whose credentials fail, counts against a per-source allowance of
  unauthenticated requests, which bounds guessing across many client ids from one address.
"""

from __future__ import annotations

from serve_app.domain.errors import AuthenticationFailed, RateLimited
from serve_app.stores.interfaces import (
    ClientInfo,
    ClientStore,
    RateLimiter,
    RequestAdmission,
    request_counter_key,
)

LOGIN_BACKOFF_BASE_S = 1.0  # the first wait once the free attempts are used up; it doubles per attempt


def login_key(client_id: str, source: str) -> str:
    return f"login:{client_id}:{source}"


def unauthenticated_key(source: str) -> str:
    return f"unauthenticated:{source}"


class ClientAuthenticator:
    def __init__(
        self,
        clients: ClientStore,
        limiter: RateLimiter,
        admission: RequestAdmission,
        login_failures_per_window: int,
        login_window_s: int,
        requests_per_minute: int,
        login_backoff_max_s: int = 900,
        unauthenticated_per_minute: int = 300,
    ) -> None:
        self._clients = clients
        self._limiter = limiter
        self._admission = admission
        self._failures_allowed = login_failures_per_window
        self._window_s = login_window_s
        self._backoff_max_s = login_backoff_max_s
        self._requests_per_minute = requests_per_minute
        self._unauthenticated_per_minute = unauthenticated_per_minute

    async def count_unauthenticated(self, source: str) -> None:
        """Count a request from `source` that carries no valid credentials (a login, a failed check)."""
        retry_after = await self._limiter.hit(
            unauthenticated_key(source), self._unauthenticated_per_minute, 60
        )
        if retry_after:
            raise RateLimited(
                "Too many unauthenticated requests from this address; try again later.", retry_after
            )

    async def login(self, client_id: str, client_secret: str, source: str) -> ClientInfo:
        """Check credentials. The attempt is counted before the check, atomically with the back-off test,
        and forgotten on success."""
        key = login_key(client_id, source)
        retry_after = await self._limiter.attempt(
            key, self._failures_allowed, LOGIN_BACKOFF_BASE_S, self._backoff_max_s, self._window_s
        )
        if retry_after:
            raise RateLimited(
                "Too many failed logins for this client from this address; try again later.", retry_after
            )
        client = await self._clients.verify(client_id, client_secret)
        if client is None:
            raise AuthenticationFailed("Invalid client_id or client_secret.")
        await self._limiter.reset(key)
        return client

    async def admit(self, client_id: str) -> None:
        """A request with a valid access token of client_id: refused once the client is revoked (or gone),
        else counted against its request allowance, in one step."""
        admission = await self._admission.admit(client_id, self._requests_per_minute, 60)
        if not admission.active:
            raise AuthenticationFailed("This client has been revoked.")
        if admission.retry_after_s:
            raise RateLimited("Request rate limit exceeded.", admission.retry_after_s)

    async def client_by_secret(self, secret: str) -> ClientInfo:
        client = await self._clients.find_by_secret(secret)
        if client is None or client.revoked:
            raise AuthenticationFailed("Invalid Client-Secret.")
        return client

    async def count_request(self, client_id: str) -> None:
        retry_after = await self._limiter.hit(request_counter_key(client_id), self._requests_per_minute, 60)
        if retry_after:
            raise RateLimited("Request rate limit exceeded.", retry_after)
