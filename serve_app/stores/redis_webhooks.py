"""Webhook endpoints, their signing secrets and the durable delivery queue in Redis (WebhookStore).

Keys (prefix default "fs:"), every name and field written here once (WebhookKeys, the scripts below):
  {p}webhook:{tenant}      hash: url (absent: no endpoint, nothing is queued), secret and prev_secret
                           (encrypted, see SecretCipher), prev_until (ms: the rotated-out secret still
                           signs until then), created_at, updated_at, rotated_at (s)
  {p}wh-event:{event_id}   hash of one event: tenant, ref, type, final_at (ms: when the transaction became
                           final), since (ms: when the current delivery window began), attempts, state
                           (pending, delivering, delivered, dead), last (the last attempt's outcome in
                           words); expires event_retention_s after it was delivered or marked dead
  {p}sys:wh-due            sorted set event_id -> when it is next due (ms). A claim pushes the score one
                           lease into the future, so an event whose worker died is due again then.
  {p}sys:wh-born           sorted set event_id -> since: the age of the oldest undelivered event
  {p}wh-log:{tenant}       list of the tenant's last delivery attempts (JSON), newest first
  {p}sys:wh-counts         hash outcome (delivered, retried, dead) -> settled attempts, cluster-wide totals
                           (the metrics: exported by every worker, so they survive replica restarts)

The event is written by the script that makes a transaction final (redis_transactions._FINALIZE), in the
same atomic step, when the tenant's hash has a url: once a transaction is final its event exists, and no
crash can fall between the two. That script runs QUEUE_COMPLETION_EVENT, the Lua function below, with the
names WebhookKeys.completion_args gives, so the event's layout is written in this module only. The webhook
hash's name depends on the transaction's tenant, which only the script reads: it is built there from the
prefix passed in, which a single Redis server or a Sentinel group allows; the service does not run on
Redis Cluster.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from redis.asyncio import Redis

from serve_app.domain.keys import PurposeKeys
from serve_app.domain.webhooks import (
    OUTCOMES,
    ClaimedEvent,
    DeliveryAttempt,
    QueueStats,
    SecretUnreadable,
    Settlement,
    WebhookConfig,
    event_id,
    new_secret,
    secret_key,
)
from serve_app.stores.redis_support import redis_errors, text, text_map

# Queue a transaction's completion event, if its tenant has an endpoint: a Lua function for the script
# that makes the transaction final (redis_transactions._FINALIZE), whose other arguments come first.
# queue_completion_event(tenant, reference id, final state, when final (ms), then WebhookKeys.
# completion_args: the webhook hashes' name prefix, the event's hash, the due and born sets, the event id).
QUEUE_COMPLETION_EVENT = """
local function queue_completion_event(tenant, ref, state, now_ms, hooks, event_key, due, born, id)
  if redis.call('HEXISTS', hooks .. tenant, 'url') == 1 then
    redis.call('HSET', event_key, 'tenant', tenant, 'ref', ref, 'type', state, 'final_at', now_ms,
      'since', now_ms, 'attempts', 0, 'state', 'pending')
    redis.call('ZADD', due, now_ms, id)
    redis.call('ZADD', born, now_ms, id)
  end
end
"""


class WebhookKeys:
    """The key names of the layout above, under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.configs = f"{prefix}webhook:"  # + tenant
        self.events = f"{prefix}wh-event:"  # + event id
        self.due = f"{prefix}sys:wh-due"
        self.born = f"{prefix}sys:wh-born"
        self.counts = f"{prefix}sys:wh-counts"

    def config(self, tenant: str) -> str:
        return f"{self.configs}{tenant}"

    def event(self, event: str) -> str:
        return f"{self.events}{event}"

    def log(self, tenant: str) -> str:
        return f"{self.prefix}wh-log:{tenant}"

    # The final write's arguments when no event is ever queued (a store without webhooks).
    NO_COMPLETION_EVENT = ("", "", "", "", "")

    def completion_args(self, reference_id: str) -> tuple[str, str, str, str, str]:
        """QUEUE_COMPLETION_EVENT's names for the completion event of this transaction."""
        event = event_id(reference_id)
        return (self.configs, self.event(event), self.due, self.born, event)


# Claim: the due events (score <= now), at most ARGV[3]; each gets attempts + 1, state delivering and a
# due time one lease (ARGV[2] ms) on. KEYS: due, born. ARGV: now ms, lease ms, count, event key prefix.
# An id whose event hash is gone (expired) leaves both sets. Returns {id, tenant, ref, type, final_at,
# since, attempt} per event.
_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local key = ARGV[4] .. id
  local f = redis.call('HMGET', key, 'tenant', 'ref', 'type', 'final_at', 'since')
  if not f[1] then
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', KEYS[2], id)
  else
    local attempt = redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('HSET', key, 'state', 'delivering')
    redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), id)
    out[#out + 1] = {id, f[1], f[2], f[3], f[4], f[5], attempt}
  end
end
return out
"""

# Settle one attempt. KEYS: due, born, event hash, the tenant's log, the totals. ARGV: event id, the
# attempt number the claim returned, outcome (retry, delivered, dead), next due ms (retry), the log record,
# log length, the retention of a settled event and of the log (s), the outcome in words. The attempt is
# always logged; the event changes (and is counted) only while it is still this claim's (no later claim
# after a lapsed lease took it over).
_SETTLE = """
redis.call('LPUSH', KEYS[4], ARGV[5])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[6]) - 1)
redis.call('EXPIRE', KEYS[4], ARGV[7])
if redis.call('HGET', KEYS[3], 'attempts') ~= ARGV[2] then return 0 end
if ARGV[3] == 'retry' then
  redis.call('HSET', KEYS[3], 'state', 'pending', 'last', ARGV[8])
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[1])
  redis.call('HINCRBY', KEYS[5], 'retried', 1)
else
  redis.call('HINCRBY', KEYS[5], ARGV[3], 1)
  redis.call('HSET', KEYS[3], 'state', ARGV[3], 'last', ARGV[8])
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 1
"""

# Redeliver a settled event of the tenant: a fresh delivery window from now. KEYS: event hash, due, born.
# ARGV: tenant, now ms, event id. Returns 0 unknown (or another tenant's), 1 queued, 2 already queued.
_REDELIVER = """
local f = redis.call('HMGET', KEYS[1], 'tenant', 'state')
if f[1] ~= ARGV[1] then return 0 end
if f[2] ~= 'delivered' and f[2] ~= 'dead' then return 2 end
redis.call('HSET', KEYS[1], 'state', 'pending', 'since', ARGV[2])
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
return 1
"""

# Replace an encrypted secret only if it is still the one read (a rotation meanwhile wins).
_REWRAP = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


class SecretCipher:
    """Signing secrets at rest: AES-256-GCM under the key ring's webhook key, the tenant as associated data
    (a ciphertext copied to another tenant's hash does not decrypt). Stored as `<kid>:<base64 nonce+ct>`,
    so a ring rotation keeps old ones readable and they move to the current key when next read."""

    def __init__(self, keys: PurposeKeys) -> None:
        self._keys = keys

    @property
    def current_kid(self) -> str:
        return self._keys.current_kid

    def encrypt(self, tenant: str, secret: str) -> str:
        nonce = os.urandom(12)
        sealed = AESGCM(self._keys.current).encrypt(nonce, secret.encode(), tenant.encode())
        return f"{self._keys.current_kid}:{base64.b64encode(nonce + sealed).decode()}"

    def decrypt(self, tenant: str, stored: str) -> str:
        kid, _, blob = stored.partition(":")
        key = self._keys.get(kid)
        if key is None:
            raise SecretUnreadable(
                f"the webhook secret of {tenant} was sealed with kid {kid!r}, not in the ring"
            )
        try:
            raw = base64.b64decode(blob)
            return AESGCM(key).decrypt(raw[:12], raw[12:], tenant.encode()).decode()
        except (InvalidTag, ValueError) as error:
            raise SecretUnreadable(f"the webhook secret of {tenant} does not decrypt") from error


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class RedisWebhookStore:
    def __init__(
        self,
        redis: Redis,
        cipher: SecretCipher,
        prefix: str = "fs:",
        *,
        log_size: int = 100,
        event_retention_s: int = 7 * 24 * 3600,
    ) -> None:
        self._redis = redis
        self._cipher = cipher
        self._keys = WebhookKeys(prefix)
        self._log_size = log_size
        self._retention_s = event_retention_s
        self._due = self._keys.due
        self._born = self._keys.born
        self._counts = self._keys.counts
        self._claim = redis.register_script(_CLAIM)
        self._settle = redis.register_script(_SETTLE)
        self._redeliver = redis.register_script(_REDELIVER)
        self._rewrap = redis.register_script(_REWRAP)

    @property
    def prefix(self) -> str:
        return self._keys.prefix

    def _config_key(self, tenant: str) -> str:
        return self._keys.config(tenant)

    def _event_key(self, event: str) -> str:
        return self._keys.event(event)

    def _log_key(self, tenant: str) -> str:
        return self._keys.log(tenant)

    # -- configuration ----------------------------------------------------------------------------------

    async def get(self, tenant: str) -> WebhookConfig | None:
        async with redis_errors():
            fields = text_map(await self._redis.hgetall(self._config_key(tenant)))
        if not fields:
            return None
        until = float(fields.get("prev_until", 0)) / 1000
        return WebhookConfig(
            url=fields.get("url"),
            created_at=float(fields.get("created_at", 0)),
            updated_at=float(fields.get("updated_at", 0)),
            secret_rotated_at=float(fields["rotated_at"]) if "rotated_at" in fields else None,
            previous_secret_until=until if until > time.time() and "prev_secret" in fields else None,
        )

    async def set_url(self, tenant: str, url: str) -> str | None:
        """Register the endpoint (the URL already vetted). Returns the signing secret when this created
        it (the first registration): the one time it is shown."""
        secret = new_secret()
        now = repr(time.time())
        key = self._config_key(tenant)
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "secret", self._cipher.encrypt(tenant, secret))
            pipe.hsetnx(key, "created_at", now)
            pipe.hset(key, mapping={"url": url, "updated_at": now})
            created, *_ = await pipe.execute()
        return secret if created else None

    async def remove_url(self, tenant: str) -> bool:
        """No endpoint: nothing more is queued; the secret and queued events stay (events already queued
        are marked dead on their next attempt)."""
        async with redis_errors():
            removed = await self._redis.hdel(self._config_key(tenant), "url")
            if removed:
                await self._redis.hset(self._config_key(tenant), "updated_at", repr(time.time()))
        return bool(removed)

    async def delete(self, tenant: str) -> bool:
        """Forget the endpoint, its secrets and the delivery log (the client's DELETE, a revocation)."""
        async with redis_errors():
            return bool(await self._redis.delete(self._config_key(tenant), self._log_key(tenant)))

    async def rotate_secret(self, tenant: str, grace_s: float) -> str:
        """A new signing secret, returned once. The previous one keeps signing beside it for grace_s, so
        receivers can switch without dropping events (Standard Webhooks' several signatures)."""
        secret = new_secret()
        key = self._config_key(tenant)
        now = time.time()
        async with redis_errors():
            old = await self._redis.hget(key, "secret")
            sealed = self._cipher.encrypt(tenant, secret)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={"secret": sealed, "rotated_at": repr(now)})
                pipe.hsetnx(key, "created_at", repr(now))
                if old is not None and grace_s > 0:
                    pipe.hset(key, mapping={"prev_secret": text(old), "prev_until": _ms(now + grace_s)})
                else:
                    pipe.hdel(key, "prev_secret", "prev_until")
                await pipe.execute()
        return secret

    async def signing_keys(self, tenant: str) -> tuple[str | None, list[bytes]]:
        """The endpoint and the HMAC keys to sign with (the current secret first). A secret sealed under
        an older ring key is sealed again under the current one."""
        key = self._config_key(tenant)
        async with redis_errors():
            url, current, previous, until = await self._redis.hmget(
                key, ["url", "secret", "prev_secret", "prev_until"]
            )
        keys = []
        for field, stored in (("secret", current), ("prev_secret", previous)):
            if stored is None or (field == "prev_secret" and int(text(until or 0)) <= _ms(time.time())):
                continue
            plain = self._cipher.decrypt(tenant, text(stored))
            keys.append(secret_key(plain))
            if not text(stored).startswith(f"{self._cipher.current_kid}:"):
                async with redis_errors():
                    await self._rewrap(
                        keys=[key], args=[field, text(stored), self._cipher.encrypt(tenant, plain)]
                    )
        return (text(url) if url is not None else None), keys

    # -- the queue -------------------------------------------------------------------------------------

    async def claim_due(self, now: float, lease_s: float, count: int) -> list[ClaimedEvent]:
        async with redis_errors():
            rows = await self._claim(
                keys=[self._due, self._born],
                args=[_ms(now), _ms(lease_s), count, self._keys.events],
            )
        return [
            ClaimedEvent(text(r[0]), text(r[1]), text(r[2]), text(r[3]), int(r[4]), int(r[5]), int(r[6]))
            for r in rows or []
        ]

    async def settle(
        self, event: ClaimedEvent, outcome: Settlement, record: DeliveryAttempt, next_due: float | None = None
    ) -> bool:
        outcome = Settlement(outcome)
        async with redis_errors():
            settled = await self._settle(
                keys=[
                    self._due,
                    self._born,
                    self._event_key(event.event_id),
                    self._log_key(event.tenant),
                    self._counts,
                ],
                args=[
                    event.event_id,
                    event.attempt,
                    outcome.value,
                    _ms(next_due or 0),
                    record.to_json(),
                    self._log_size,
                    self._retention_s,
                    record.in_words,
                ],
            )
        return bool(settled)

    async def redeliver(self, tenant: str, event_id: str) -> bool | None:
        """Queue a delivered or dead event of the tenant again, due now. None: no such event of this
        tenant; False: it is queued already."""
        async with redis_errors():
            answer = int(
                await self._redeliver(
                    keys=[self._event_key(event_id), self._due, self._born],
                    args=[tenant, _ms(time.time()), event_id],
                )
            )
        return None if answer == 0 else answer == 1

    async def event_state(self, event_id: str) -> dict[str, str]:
        async with redis_errors():
            return text_map(await self._redis.hgetall(self._event_key(event_id)))

    async def deliveries(self, tenant: str, limit: int) -> list[DeliveryAttempt]:
        async with redis_errors():
            rows: Sequence[Any] = await self._redis.lrange(self._log_key(tenant), 0, max(0, limit - 1))
        return [DeliveryAttempt.from_json(text(row)) for row in rows]

    async def stats(self, now: float) -> QueueStats:
        async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._born)
            pipe.zrange(self._born, 0, 0, withscores=True)
            pipe.hgetall(self._counts)
            count, oldest, counts = await pipe.execute()
        age = max(0.0, now - float(oldest[0][1]) / 1000) if oldest else 0.0
        totals = dict.fromkeys(OUTCOMES, 0) | {key: int(value) for key, value in text_map(counts).items()}
        return QueueStats(int(count), age, totals)
