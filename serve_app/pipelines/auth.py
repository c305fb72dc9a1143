"""Who is calling: client credentials, login throttling and per-client request limits."""

from __future__ import annotations

from serve_app.domain.errors import AuthenticationFailed, RateLimited
from serve_app.stores.interfaces import ClientInfo, ClientStore, RateLimiter


class ClientAuthenticator:
    def __init__(
        self,
        clients: ClientStore,
        limiter: RateLimiter,
        login_failures_per_window: int,
        login_window_s: int,
        requests_per_minute: int,
    ) -> None:
        self._clients = clients
        self._limiter = limiter
        self._failures_allowed = login_failures_per_window
        self._window_s = login_window_s
        self._requests_per_minute = requests_per_minute

    async def login(self, client_id: str, client_secret: str, source: str) -> ClientInfo:
        """Check credentials. Failed attempts are counted per client_id and per source address, and once
        either exceeds its allowance every further attempt is refused (429) until the window passes."""
        keys = (f"login-fail:id:{client_id}", f"login-fail:ip:{source}")
        for key in keys:
            retry_after = await self._limiter.peek(key, self._failures_allowed, self._window_s)
            if retry_after:
                raise RateLimited("Too many failed logins; try again later.", retry_after)
        client = await self._clients.verify(client_id, client_secret)
        if client is None:
            for key in keys:
                await self._limiter.hit(key, self._failures_allowed, self._window_s)
            raise AuthenticationFailed("Invalid client_id or client_secret.")
        return client

    async def active_client(self, client_id: str) -> ClientInfo:
        client = await self._clients.get(client_id)
        if client is None or client.revoked:
            raise AuthenticationFailed("This client has been revoked.")
        return client

    async def client_by_secret(self, secret: str) -> ClientInfo:
        client = await self._clients.find_by_secret(secret)
        if client is None or client.revoked:
            raise AuthenticationFailed("Invalid Client-Secret.")
        return client

    async def count_request(self, client_id: str) -> None:
        retry_after = await self._limiter.hit(f"requests:{client_id}", self._requests_per_minute, 60)
        if retry_after:
            raise RateLimited("Request rate limit exceeded.", retry_after)
