"""Rotating the key ring under live clients and tokens (issue 35, item 4), on a real redis-server: the
ingress app runs in-process over the real Redis stores, rebuilt for each step of the rotation as replicas
restarted with the new FACESEARCH_SECRET_KEYS would be. It starts as a deployment from before the ring
(FACESEARCH_SECRET_KEY alone), as docs/security.md's runbook has it."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest
from pydantic import SecretStr

from serve_app.api.app import create_app
from serve_app.launch.embedded import EmbeddedServices
from serve_app.settings import AuthSettings, HttpSettings, MilvusSettings, RedisSettings, Settings
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.wiring.api import build_api_services
from serve_app.wiring.stores import redis_stores

UNKNOWN_REFERENCE = {"reference_id": "0" * 32}  # a 422 to an authenticated caller, a 401 to anyone else


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("rotation"), milvus=False)
    services.start()
    try:
        yield services
    finally:
        services.stop()


class Step:
    """The ingress of one step of the rotation: its settings' key configuration over the shared Redis."""

    def __init__(self, server: EmbeddedServices, tmp_path: Path, **keys: str) -> None:
        self.settings = Settings(
            data_dir=tmp_path,
            blob_dir=tmp_path / "blobs",
            redis=RedisSettings(url=server.redis_url, key_prefix=f"k{tmp_path.name[-6:]}:"),
            milvus=MilvusSettings(uri=None, token=""),
            auth=AuthSettings.model_validate({name: SecretStr(value) for name, value in keys.items()}),
            http=HttpSettings(public_base_url=None),
        )
        self.app = create_app(build_api_services(self.settings))

    def clients(self) -> RedisClientStore:
        return redis_stores(self.settings).clients

    async def call(self, request: tuple[str, str, dict[str, str]]) -> int:
        method, path, headers = request
        transport = httpx.ASGITransport(app=self.app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            json = UNKNOWN_REFERENCE if path == "/result" else None
            return (await http.request(method, path, headers=headers, json=json)).status_code

    async def login(self, client: tuple[str, str]) -> str | None:
        transport = httpx.ASGITransport(app=self.app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            body = {"client_id": client[0], "client_secret": client[1]}
            answer = await http.post("/request-access-token", json=body)
        return str(answer.json()["result"]["data"]["token"]) if answer.status_code == 200 else None

    async def authenticated(self, token: str | None = None, secret: str | None = None) -> bool:
        """Whether /result takes these credentials (422 for an unknown id), or answers 401."""
        headers = {"Authorization": f"Bearer {token}"} if token else {"Client-Secret": str(secret)}
        status = await self.call(("POST", "/result", headers))
        assert status in (401, 422)
        return status == 422


def test_rotation_keeps_tokens_and_client_secrets_working_through_the_grace(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    legacy, new = secrets.token_urlsafe(32), secrets.token_urlsafe(32)

    async def main() -> None:
        # Before the ring: one FACESEARCH_SECRET_KEY. Two clients, one logged in.
        before = Step(redis_server, tmp_path, secret_key=legacy)
        active_info, active_secret = await before.clients().create("active")
        idle_info, idle_secret = await before.clients().create("idle")
        active, idle = (active_info.client_id, active_secret), (idle_info.client_id, idle_secret)
        old_token = await before.login(active)
        assert old_token is not None and jwt.get_unverified_header(old_token)["kid"] == "0"
        assert await before.authenticated(token=old_token)

        # The rotation: a new current key, the old one kept for the grace.
        grace = Step(redis_server, tmp_path, secret_keys=f"k1:{new},0:{legacy}")
        assert await grace.authenticated(token=old_token)  # issued before the rotation
        assert await grace.authenticated(secret=active_secret)  # Client-Secret, hashed with the old pepper
        new_token = await grace.login(active)
        assert new_token is not None and jwt.get_unverified_header(new_token)["kid"] == "k1"
        assert await grace.authenticated(token=new_token)
        fresh_info, fresh_secret = await grace.clients().create("fresh")
        # The active client was re-hashed with the new pepper when it authenticated; the idle one was not.
        assert await grace.clients().peppers_in_use() == {"k1": 2, "0": 1}
        # A replica still on the old ring during the roll-out verifies what it issued, not the new kid's.
        assert await before.authenticated(token=old_token)
        assert not await before.authenticated(token=new_token)

        # The grace is over: the old key leaves the ring.
        after = Step(redis_server, tmp_path, secret_keys=f"k1:{new}")
        assert not await after.authenticated(token=old_token)
        assert await after.authenticated(token=new_token)
        assert await after.login(active) is not None and await after.authenticated(secret=active_secret)
        assert await after.login((fresh_info.client_id, fresh_secret)) is not None
        # A client that did not authenticate during the grace still has the old pepper's hash: the runbook
        # waits for peppers_in_use to show no client on the old kid before dropping it.
        assert await after.login(idle) is None
        assert not await after.authenticated(secret=idle_secret)

    asyncio.run(main())
