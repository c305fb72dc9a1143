"""The fake WebhookStore: endpoints, secrets (kept as they are: sealing them is the Redis store's part), the
event queue and the delivery log in memory. The fake TransactionStore queues a completion event here when
it makes a transaction final, as the Redis store's final write does."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from serve_app.domain.webhooks import (
    OUTCOMES,
    ClaimedEvent,
    DeliveryAttempt,
    QueueStats,
    Settlement,
    WebhookConfig,
    event_id,
    new_secret,
    secret_key,
)
from tests.unit.fakes.common import Faults, _encodable


@dataclasses.dataclass
class _Endpoint:
    url: str | None
    secret: str
    created_at: float
    updated_at: float
    rotated_at: float | None = None
    previous: str | None = None
    previous_until: float = 0.0


@dataclasses.dataclass
class _Event:
    tenant: str
    reference_id: str
    state: str  # of the transaction: completed or failed
    final_at_ms: int
    since_ms: int
    attempts: int = 0
    delivery: str = "pending"  # pending, delivering, delivered, dead
    last: str = ""
    expires_at: float | None = None  # by the store's clock, once settled


class FakeWebhookStore:
    def __init__(
        self,
        *,
        log_size: int = 100,
        event_retention_s: float = 7 * 24 * 3600,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """clock: the store's own time (secret grace, event retention); the queue's is the caller's."""
        self._log_size = log_size
        self._retention_s = event_retention_s
        self._faults = faults or Faults()
        self._clock = clock
        self._endpoints: dict[str, _Endpoint] = {}
        self._events: dict[str, _Event] = {}
        self._due: dict[str, int] = {}  # event id -> due (ms)
        self._logs: dict[str, list[DeliveryAttempt]] = {}
        self._totals: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    # -- what the fake TransactionStore calls (the Redis store's final write does this in its script) ----

    def queue_completion(self, tenant: str, reference_id: str, state: str, final_at: float) -> None:
        endpoint = self._endpoints.get(tenant)
        if endpoint is None or endpoint.url is None:
            return
        now_ms = int(final_at * 1000)
        event = event_id(reference_id)
        self._events[event] = _Event(tenant, reference_id, state, now_ms, now_ms)
        self._due[event] = now_ms

    def _event(self, event: str) -> _Event | None:
        found = self._events.get(event)
        if found is not None and found.expires_at is not None and found.expires_at <= self._clock():
            del self._events[event]
            self._due.pop(event, None)
            return None
        return found

    # -- configuration ----------------------------------------------------------------------------------

    async def get(self, tenant: str) -> WebhookConfig | None:
        await self._faults.check("webhooks.get")
        endpoint = self._endpoints.get(tenant)
        if endpoint is None:
            return None
        in_grace = endpoint.previous is not None and endpoint.previous_until > self._clock()
        return WebhookConfig(
            url=endpoint.url,
            created_at=endpoint.created_at,
            updated_at=endpoint.updated_at,
            secret_rotated_at=endpoint.rotated_at,
            previous_secret_until=endpoint.previous_until if in_grace else None,
        )

    async def set_url(self, tenant: str, url: str) -> str | None:
        await self._faults.check("webhooks.set_url")
        _encodable(tenant, url)
        now = self._clock()
        endpoint = self._endpoints.get(tenant)
        if endpoint is not None:
            endpoint.url, endpoint.updated_at = url, now
            return None
        secret = new_secret()
        self._endpoints[tenant] = _Endpoint(url, secret, now, now)
        return secret

    async def remove_url(self, tenant: str) -> bool:
        await self._faults.check("webhooks.remove_url")
        endpoint = self._endpoints.get(tenant)
        if endpoint is None or endpoint.url is None:
            return False
        endpoint.url, endpoint.updated_at = None, self._clock()
        return True

    async def delete(self, tenant: str) -> bool:
        await self._faults.check("webhooks.delete")
        had_log = self._logs.pop(tenant, None) is not None
        return self._endpoints.pop(tenant, None) is not None or had_log

    async def rotate_secret(self, tenant: str, grace_s: float) -> str:
        await self._faults.check("webhooks.rotate_secret")
        now = self._clock()
        secret = new_secret()
        endpoint = self._endpoints.setdefault(tenant, _Endpoint(None, secret, now, now))
        if grace_s > 0:
            endpoint.previous, endpoint.previous_until = endpoint.secret, now + grace_s
        else:
            endpoint.previous, endpoint.previous_until = None, 0.0
        endpoint.secret, endpoint.rotated_at = secret, now
        return secret

    async def signing_keys(self, tenant: str) -> tuple[str | None, list[bytes]]:
        await self._faults.check("webhooks.signing_keys")
        endpoint = self._endpoints.get(tenant)
        if endpoint is None:
            return None, []
        keys = [secret_key(endpoint.secret)]
        if endpoint.previous is not None and endpoint.previous_until > self._clock():
            keys.append(secret_key(endpoint.previous))
        return endpoint.url, keys

    # -- the queue -------------------------------------------------------------------------------------

    async def claim_due(self, now: float, lease_s: float, count: int) -> list[ClaimedEvent]:
        await self._faults.check("webhooks.claim_due")
        now_ms = int(now * 1000)
        due = sorted((at, event) for event, at in self._due.items() if at <= now_ms)
        claimed: list[ClaimedEvent] = []
        for _, event in due:
            if len(claimed) >= count:
                break
            found = self._event(event)
            if found is None:
                self._due.pop(event, None)
                continue
            found.attempts += 1
            found.delivery = "delivering"
            self._due[event] = now_ms + int(lease_s * 1000)
            claimed.append(
                ClaimedEvent(
                    event,
                    found.tenant,
                    found.reference_id,
                    found.state,
                    found.final_at_ms,
                    found.since_ms,
                    found.attempts,
                )
            )
        return claimed

    async def settle(
        self, event: ClaimedEvent, outcome: Settlement, record: DeliveryAttempt, next_due: float | None = None
    ) -> bool:
        await self._faults.check("webhooks.settle")
        outcome = Settlement(outcome)
        log = self._logs.setdefault(event.tenant, [])
        log.insert(0, record)
        del log[self._log_size :]
        found = self._event(event.event_id)
        if found is None or found.attempts != event.attempt:
            return False  # a later claim holds it
        found.last = record.in_words
        if outcome is Settlement.RETRY:
            found.delivery = "pending"
            self._due[event.event_id] = int((next_due or 0) * 1000)
            self._totals["retried"] += 1
        else:
            found.delivery = outcome.value
            found.expires_at = self._clock() + self._retention_s
            self._due.pop(event.event_id, None)
            self._totals[outcome.value] += 1
        return True

    async def redeliver(self, tenant: str, event_id: str) -> bool | None:
        await self._faults.check("webhooks.redeliver")
        found = self._event(event_id)
        if found is None or found.tenant != tenant:
            return None
        if found.delivery not in ("delivered", "dead"):
            return False
        now_ms = int(self._clock() * 1000)
        found.delivery, found.since_ms, found.expires_at = "pending", now_ms, None
        self._due[event_id] = now_ms
        return True

    async def event_state(self, event_id: str) -> dict[str, str]:
        await self._faults.check("webhooks.event_state")
        found = self._event(event_id)
        if found is None:
            return {}
        fields = {
            "tenant": found.tenant,
            "ref": found.reference_id,
            "type": found.state,
            "final_at": str(found.final_at_ms),
            "since": str(found.since_ms),
            "attempts": str(found.attempts),
            "state": found.delivery,
        }
        return fields | ({"last": found.last} if found.last else {})

    async def deliveries(self, tenant: str, limit: int) -> list[DeliveryAttempt]:
        await self._faults.check("webhooks.deliveries")
        return list(self._logs.get(tenant, [])[: max(0, limit)])

    async def stats(self, now: float) -> QueueStats:
        await self._faults.check("webhooks.stats")
        waiting = [
            found.since_ms
            for event in list(self._events)
            if (found := self._event(event)) is not None and found.delivery not in ("delivered", "dead")
        ]
        oldest = max(0.0, now - min(waiting) / 1000) if waiting else 0.0
        return QueueStats(len(waiting), oldest, dict(self._totals))
