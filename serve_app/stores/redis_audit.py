"""The gallery audit trail in Redis: one stream per tenant, {p}audit:{tenant}.

Stream entry ids are the cursors (they only grow), so a page that starts before an id never repeats or
skips an entry, whatever is appended meanwhile. Entries are kept: the trail is what an operator shows an
auditor, and an entry is a few dozen bytes.
"""

from __future__ import annotations

import re

from redis.asyncio import Redis

from serve_app.domain.gallery import AuditAction, AuditEntry
from serve_app.stores.redis_support import redis_errors, text

_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


class RedisAuditLog:
    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._redis = redis
        self._prefix = prefix

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
        async with redis_errors():
            await self._redis.xadd(self._key(tenant_id), fields)  # type: ignore[arg-type]

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
