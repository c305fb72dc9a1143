"""API clients (tenants) in Redis. Secrets are never stored: only HMAC-SHA256(pepper, secret), with the kid
of the pepper (the key ring's client-secret key, serve_app/domain/keys.py) that made it.

Why a keyed fast hash and not a password hash (bcrypt/scrypt): the secrets are 256-bit random tokens, so
there is nothing to brute-force, and a deterministic keyed hash lets the Client-Secret header be looked up
by its hash. The pepper lives outside Redis, so a copy of the database alone does not allow checking
guesses.

Rotation: a new client is hashed with the current pepper; a client hashed with an older one is verified
with that one (its stored kid; none: kid 0) while the ring still holds it, and re-hashed with the current
one on its next successful authentication, so its secret keeps working across the rotation and the old
pepper can go once no client uses it (peppers_in_use).

Keys (prefix default "fs:"):
  {p}client:{client_id}          hash name, created_at, revoked ("0"/"1"), secret_hmac, kid (absent: "0")
  {p}client-secret:{secret_hmac} client_id (removed on revoke)
  {p}clients                     sorted set client_id -> created_at
  {p}search-defaults             hash min_score: the service-wide minimum score set at run time

client_id arrives from callers at login: only values of the issued format (cl_ + 24 hex digits) reach a key
name, anything else is an unknown client. Secrets appear only as their keyed hash.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import Counter
from collections.abc import Sequence

from redis.asyncio import Redis

from serve_app.domain.identifiers import is_client_id, new_client_id, new_client_secret
from serve_app.domain.keys import CLIENT_SECRETS, LEGACY_KID, PurposeKeys, as_purpose_keys
from serve_app.stores.interfaces import ClientInfo
from serve_app.stores.redis_support import redis_errors, text, text_map


def client_key(prefix: str, client_id: str) -> str:
    return f"{prefix}client:{client_id}"


# Moves a client's hash to the current pepper, only while it still holds the hash it was verified with and
# is not revoked (a revoke or another re-hash in between wins). KEYS: client hash, old index, new index.
# ARGV: old hash, new hash, new kid, client_id.
_REHASH = """
if redis.call('HGET', KEYS[1], 'secret_hmac') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'revoked') == '1' then return 0 end
redis.call('HSET', KEYS[1], 'secret_hmac', ARGV[2], 'kid', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[3], ARGV[4])
return 1
"""


class RedisClientStore:
    def __init__(self, redis: Redis, pepper: PurposeKeys | str | bytes, prefix: str = "fs:") -> None:
        """pepper: the key ring's client-secret keys (a bare key is a ring of one, kid 0)."""
        if not isinstance(pepper, PurposeKeys) and len(pepper) < 16:
            raise ValueError("the client-secret pepper must be at least 16 bytes")
        self._peppers = as_purpose_keys(CLIENT_SECRETS, pepper)
        self._redis = redis
        self._prefix = prefix
        self._rehash = redis.register_script(_REHASH)

    def _client_key(self, client_id: str) -> str:
        return client_key(self._prefix, client_id)

    def _index_key(self, secret_hmac: str) -> str:
        return f"{self._prefix}client-secret:{secret_hmac}"

    def _hash(self, secret: str, pepper: bytes | None = None) -> str:
        """Under the current pepper unless another is given."""
        # surrogatepass: a str that is not valid Unicode (a lone surrogate) hashes to something no issued
        # secret matches, rather than raising.
        key = self._peppers.current if pepper is None else pepper
        return hmac.new(key, secret.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

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
                    "kid": self._peppers.current_kid,
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
        # The hash is computed even for unknown clients so timing does not tell which ids exist. A client
        # hashed with a pepper the ring no longer holds cannot be verified (the rotation's grace is over).
        pepper = self._peppers.get(fields.get("kid", LEGACY_KID))
        presented = self._hash(secret, pepper)
        stored = fields.get("secret_hmac", "0" * len(presented))
        if not hmac.compare_digest(presented, stored) or not fields or pepper is None:
            return None
        info = self._info(client_id, fields)
        if info.revoked:
            return None
        if fields.get("kid", LEGACY_KID) != self._peppers.current_kid:
            await self._move_to_current(client_id, secret, stored)
        return info

    async def _move_to_current(self, client_id: str, secret: str, stored: str) -> None:
        current = self._hash(secret)
        async with redis_errors():
            await self._rehash(
                keys=[self._client_key(client_id), self._index_key(stored), self._index_key(current)],
                args=[stored, current, self._peppers.current_kid, client_id],
            )

    async def peppers_in_use(self) -> dict[str, int]:
        """kid -> clients whose secret hash it made (revoked clients left out): a pepper may leave the
        ring once no client uses it."""
        counts: Counter[str] = Counter()
        for _, fields in await self._all_fields():
            if fields.get("revoked") != "1":
                counts[fields.get("kid", LEGACY_KID)] += 1
        return dict(counts)

    async def find_by_secret(self, secret: str) -> ClientInfo | None:
        # Under every pepper of the ring, current first, in one round trip: a client not yet re-hashed
        # after a rotation is found under its own.
        hashes = [self._hash(secret, self._peppers.get(kid)) for kid in self._peppers.kids()]
        async with redis_errors():
            candidates = await self._redis.mget([self._index_key(secret_hmac) for secret_hmac in hashes])
        found = next((candidate for candidate in candidates if candidate is not None), None)
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
        return [self._info(client_id, fields) for client_id, fields in await self._all_fields()]

    async def _all_fields(self) -> Sequence[tuple[str, dict[str, str]]]:
        async with redis_errors():
            client_ids = [text(c) for c in await self._redis.zrange(f"{self._prefix}clients", 0, -1)]
            async with self._redis.pipeline(transaction=False) as pipe:
                for client_id in client_ids:
                    pipe.hgetall(self._client_key(client_id))
                rows = await pipe.execute()
        return [
            (client_id, text_map(fields))
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

    async def default_min_score(self) -> float | None:
        async with redis_errors():
            value = await self._redis.hget(f"{self._prefix}search-defaults", "min_score")
        return float(text(value)) if value is not None else None

    async def set_default_min_score(self, min_score: float | None) -> None:
        key = f"{self._prefix}search-defaults"
        async with redis_errors():
            if min_score is None:
                await self._redis.hdel(key, "min_score")
            else:
                await self._redis.hset(key, "min_score", repr(float(min_score)))

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
