"""The gallery audit trail in Redis: one stream per tenant, {p}audit:{tenant}.

Stream entry ids are the cursors (they only grow), so a page that starts before an id never repeats or
skips an entry, whatever is appended meanwhile. Entries are kept for the audit retention
(FACESEARCH_AUDIT_RETENTION_S): the trail is what an operator shows an auditor, but every deletion or
erasure request adds an entry (also one that found nothing), so without a bound a client at its rate limit
would grow Redis by gigabytes a day. Each append drops the tenant's entries older than the retention (the
stream ids are Redis' millisecond clock) and sets the stream to expire once its newest entry is that old.
"""

from __future__ import annotations

import re
import time

from redis.asyncio import Redis

from serve_app.domain.gallery import AuditAction, AuditEntry
from serve_app.stores.redis_support import redis_errors, text

_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


class RedisAuditLog:
    def __init__(self, redis: Redis, prefix: str = "fs:", retention_s: int | None = None) -> None:
        """retention_s: how long an entry is kept (None: for ever)."""
        self._redis = redis
        self._prefix = prefix
        self._retention_s = retention_s

    def _key(self, tenant_id: str) -> str:
        return f"{self._prefix}audit:{tenant_id}"

    async def append(self, tenant_id: str, entry: AuditEntry) -> None:
        fields: dict[str, str] = {
            "at": repr(entry.at),
            "actor": entry.actor,
            "action": entry.action.value,
            "faces": str(entry.faces),
            "subject": entry.subject,
        }
        key = self._key(tenant_id)
        async with redis_errors():
            if self._retention_s is None:
                await self._redis.xadd(key, fields)  # type: ignore[arg-type]
                return
            oldest_kept_ms = int((time.time() - self._retention_s) * 1000)
            async with self._redis.pipeline(transaction=True) as pipe:
                # Exact trimming: an append removes the few entries that aged out since the last one.
                pipe.xadd(key, fields, minid=f"{max(0, oldest_kept_ms)}-0", approximate=False)  # type: ignore[arg-type]
                pipe.expire(key, self._retention_s)
                await pipe.execute()

    async def page(
        self, tenant_id: str, before: str | None, limit: int
    ) -> tuple[list[AuditEntry], str | None]:
        if before is not None and not _STREAM_ID.fullmatch(before):
            raise ValueError("not an audit cursor")
        newest = f"({before}" if before is not None else "+"
        async with redis_errors():
            raw = await self._redis.xrevrange(self._key(tenant_id), max=newest, min="-", count=limit) or []
        entries = []
        for _, fields in raw:
            values = {text(key): text(value) for key, value in (fields or {}).items()}
            entries.append(
                AuditEntry(
                    at=float(values["at"]),
                    actor=values["actor"],
                    action=AuditAction(values["action"]),
                    faces=int(values["faces"]),
                    subject=values["subject"],
                )
            )
        next_cursor = text(raw[-1][0]) if len(raw) == limit else None
        return entries, next_cursor
