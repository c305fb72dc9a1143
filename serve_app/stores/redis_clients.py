"""API clients (tenants) in Redis. Secrets are never stored: only HMAC-SHA256(pepper, secret).

Why a keyed fast hash and not a password hash (bcrypt/scrypt): the secrets are 256-bit random tokens, so
there is nothing to brute-force, and a deterministic keyed hash lets the Client-Secret header be looked up
by its hash. The pepper (the service's signing secret) lives outside Redis, so a copy of the database alone
does not allow checking guesses.

Keys (prefix default "fs:"):
  {p}client:{client_id}          hash name, created_at, revoked ("0"/"1"), secret_hmac
  {p}client-secret:{secret_hmac} client_id (removed on revoke)
  {p}clients                     sorted set client_id -> created_at

client_id arrives from callers at login: only values of the issued format (cl_ + 24 hex digits) reach a key
name, anything else is an unknown client. Secrets appear only as their keyed hash.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from redis.asyncio import Redis

from serve_app.domain.identifiers import is_client_id, new_client_id, new_client_secret
from serve_app.stores.interfaces import ClientInfo
from serve_app.stores.redis_support import redis_errors, text, text_map


def client_key(prefix: str, client_id: str) -> str:
    return f"{prefix}client:{client_id}"


class RedisClientStore:
    def __init__(self, redis: Redis, pepper: str | bytes, prefix: str = "fs:") -> None:
        pepper_bytes = pepper.encode() if isinstance(pepper, str) else bytes(pepper)
        if len(pepper_bytes) < 16:
            raise ValueError("the client-secret pepper must be at least 16 bytes")
        self._redis = redis
        self._pepper = pepper_bytes
        self._prefix = prefix

    def _client_key(self, client_id: str) -> str:
        return client_key(self._prefix, client_id)

    def _index_key(self, secret_hmac: str) -> str:
        return f"{self._prefix}client-secret:{secret_hmac}"

    def _hash(self, secret: str) -> str:
        # surrogatepass: a str that is not valid Unicode (a lone surrogate) hashes to something no issued
        # secret matches, rather than raising.
        return hmac.new(self._pepper, secret.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    @staticmethod
    def _info(client_id: str, fields: dict[str, str]) -> ClientInfo:
        return ClientInfo(
            client_id=client_id,
            name=fields.get("name", ""),
            created_at=float(fields.get("created_at", "0")),
            revoked=fields.get("revoked") == "1",
            min_score=float(fields["min_score"]) if fields.get("min_score") else None,
            max_matches=int(fields["max_matches"]) if fields.get("max_matches") else None,
        )

    async def create(self, name: str) -> tuple[ClientInfo, str]:
        client_id = new_client_id()
        secret = new_client_secret()
        secret_hmac = self._hash(secret)
        created_at = time.time()
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                self._client_key(client_id),
                mapping={
                    "name": name,
                    "created_at": repr(created_at),
                    "revoked": "0",
                    "secret_hmac": secret_hmac,
                },
            )
            pipe.set(self._index_key(secret_hmac), client_id)
            pipe.zadd(f"{self._prefix}clients", {client_id: created_at})
            await pipe.execute()
        return ClientInfo(client_id=client_id, name=name, created_at=created_at, revoked=False), secret

    async def verify(self, client_id: str, secret: str) -> ClientInfo | None:
        if not is_client_id(client_id):
            self._hash(secret)  # the same work as for a well-formed id, so timing tells nothing
            return None
        async with redis_errors():
            fields = text_map(await self._redis.hgetall(self._client_key(client_id)))
        # The hash is computed even for unknown clients so timing does not tell which ids exist.
        presented = self._hash(secret)
        stored = fields.get("secret_hmac", "0" * len(presented))
        if not hmac.compare_digest(presented, stored) or not fields:
            return None
        info = self._info(client_id, fields)
        return None if info.revoked else info

    async def find_by_secret(self, secret: str) -> ClientInfo | None:
        async with redis_errors():
            found = await self._redis.get(self._index_key(self._hash(secret)))
        if found is None:
            return None
        client_id = text(found)
        # verify() re-checks the stored hash in constant time and the revoked flag.
        return await self.verify(client_id, secret)

    async def get(self, client_id: str) -> ClientInfo | None:
        if not is_client_id(client_id):
            return None
        async with redis_errors():
            fields = text_map(await self._redis.hgetall(self._client_key(client_id)))
        return self._info(client_id, fields) if fields else None

    async def list(self) -> list[ClientInfo]:
        async with redis_errors():
            client_ids = [text(c) for c in await self._redis.zrange(f"{self._prefix}clients", 0, -1)]
            async with self._redis.pipeline(transaction=False) as pipe:
                for client_id in client_ids:
                    pipe.hgetall(self._client_key(client_id))
                rows = await pipe.execute()
        return [
            self._info(client_id, text_map(fields))
            for client_id, fields in zip(client_ids, rows, strict=True)
            if fields
        ]

    async def update_search_settings(
        self, client_id: str, min_score: float | None, max_matches: int | None
    ) -> ClientInfo | None:
        key = self._client_key(client_id)
        async with redis_errors():
            if not await self._redis.exists(key):
                return None
            async with self._redis.pipeline(transaction=True) as pipe:
                for name, value in (("min_score", min_score), ("max_matches", max_matches)):
                    if value is None:
                        pipe.hdel(key, name)
                    else:
                        pipe.hset(key, name, repr(value))
                await pipe.execute()
        return await self.get(client_id)

    async def revoke(self, client_id: str) -> bool:
        """Marks the client revoked and forgets its secret hash index; False when the client is unknown."""
        if not is_client_id(client_id):
            return False
        async with redis_errors():
            stored = await self._redis.hget(self._client_key(client_id), "secret_hmac")
            if stored is None:
                return False
            secret_hmac = text(stored)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._client_key(client_id), "revoked", "1")
                pipe.delete(self._index_key(secret_hmac))
                await pipe.execute()
        return True
