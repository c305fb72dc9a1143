"""The fake AuditLog."""

from __future__ import annotations

from serve_app.domain.gallery import AuditEntry
from serve_app.stores.redis_audit import _STREAM_ID as STREAM_ID  # the Redis log's cursor form
from tests.unit.fakes.common import Faults


class FakeAuditLog:
    """Entries per tenant in append order; a cursor is "<position>-0", of the form of the stream ids the
    Redis log uses as cursors (checked by its rule)."""

    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self.entries: dict[str, list[AuditEntry]] = {}

    async def append(self, tenant_id: str, entry: AuditEntry) -> None:
        await self._faults.check("audit.append")
        self.entries.setdefault(tenant_id, []).append(entry)

    async def page(
        self, tenant_id: str, before: str | None, limit: int
    ) -> tuple[list[AuditEntry], str | None]:
        await self._faults.check("audit.page")
        if before is not None and not STREAM_ID.fullmatch(before):
            raise ValueError("not an audit cursor")
        stored = self.entries.get(tenant_id, [])
        end = min(int(before.partition("-")[0]), len(stored)) if before is not None else len(stored)
        positions = list(range(end - 1, -1, -1))[:limit]
        next_cursor = f"{positions[-1]}-0" if len(positions) == limit else None
        return [stored[position] for position in positions], next_cursor
