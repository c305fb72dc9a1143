"""The fake TransactionStore."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

from serve_app.domain.idempotency import IdempotencyClaim, IdempotencyConflict
from serve_app.domain.identifiers import is_reference_id
from serve_app.domain.outcomes import Outcome
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.stores.outcome_codec import outcome_fields, outcome_from_fields
from tests.unit.fakes.common import Faults, _encodable
from tests.unit.fakes.webhooks import FakeWebhookStore
from tests.unit.fakes.work_queue import FakeWorkQueue


class FakeTransactionStore:
    """Transactions by reference id; create_and_enqueue also adds the entry to `queue`, and making one final
    queues its completion event in `webhooks` (when given) for a tenant with an endpoint."""

    def __init__(
        self,
        queue: FakeWorkQueue | None = None,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.time,
        webhooks: FakeWebhookStore | None = None,
    ) -> None:
        self.queue = queue if queue is not None else FakeWorkQueue(faults)
        self.webhooks = webhooks
        self._faults = faults or Faults()
        self._clock = clock
        # (reference_id, timeout asked for, whether it ended on a final state) per wait_final call: what a
        # test checks instead of the wall clock.
        self.waits: list[tuple[str, float, bool]] = []
        self._items: dict[str, Transaction] = {}
        self.entry_of: dict[str, str] = {}  # reference_id -> stream entry id
        self._claims: dict[str, tuple[str, str]] = {}  # Idempotency-Key digest -> (fingerprint, reference_id)

    async def create_and_enqueue(self, tx: Transaction, claim: IdempotencyClaim | None = None) -> str:
        await self._faults.check("transactions.create_and_enqueue")
        _encodable(tx.reference_id, tx.tenant_id, tx.client_reference, tx.image_key)
        if claim is not None:
            held = self._claims.get(claim.digest)
            if held is not None:
                if held[0] != claim.fingerprint:
                    raise IdempotencyConflict("The Idempotency-Key was already used for a different request.")
                return held[1]
            self._claims[claim.digest] = (claim.fingerprint, tx.reference_id)
        self._items[tx.reference_id] = copy.deepcopy(tx)
        self.entry_of[tx.reference_id] = self.queue.add(tx.reference_id)
        return tx.reference_id

    async def image_keys_in_flight(self) -> set[str]:
        await self._faults.check("transactions.image_keys_in_flight")
        queued = self.queue.reference_ids()
        return {self._items[ref].image_key for ref in queued if ref in self._items}

    async def get(self, reference_id: str) -> Transaction | None:
        await self._faults.check("transactions.get")
        if not is_reference_id(reference_id):
            return None  # never issued, so never stored (as the Redis store answers)
        tx = self._items.get(reference_id)
        return copy.deepcopy(tx) if tx is not None else None

    async def mark_processing(self, reference_id: str) -> Transaction | None:
        await self._faults.check("transactions.mark_processing")
        tx = self._items.get(reference_id)
        if tx is None or tx.state.is_final:
            return None
        tx.state = TransactionState.PROCESSING
        tx.attempts += 1
        tx.updated_at = self._clock()
        return copy.deepcopy(tx)

    async def complete(self, reference_id: str, result: Outcome) -> bool:
        await self._faults.check("transactions.complete")
        tx = self._items.get(reference_id)
        # Through the stores' one stored form, as Redis would keep it.
        stored = outcome_from_fields(tx.kind, outcome_fields(result)) if tx is not None else result
        return self._finalise(reference_id, TransactionState.COMPLETED, result=stored)

    async def fail(self, reference_id: str, error: str) -> None:
        await self._faults.check("transactions.fail")
        self._finalise(reference_id, TransactionState.FAILED, error=error)

    def _finalise(
        self, reference_id: str, state: TransactionState, result: Any = None, error: str | None = None
    ) -> bool:
        tx = self._items.get(reference_id)
        if tx is None or tx.state.is_final:
            return False  # a final state is never overwritten
        tx.state = state
        tx.result = result
        tx.error = error
        tx.updated_at = self._clock()
        if self.webhooks is not None:  # in the same step, as the Redis store's final write does
            self.webhooks.queue_completion(tx.tenant_id, reference_id, state.value, tx.updated_at)
        return True

    async def wait_final(
        self, reference_id: str, timeout_s: float, *, seen_pending: bool = False
    ) -> Transaction | None:
        await self._faults.check("transactions.wait_final")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            tx = self._items.get(reference_id)
            if tx is None or tx.state.is_final or loop.time() >= deadline:
                self.waits.append((reference_id, timeout_s, tx is not None and tx.state.is_final))
                return copy.deepcopy(tx) if tx is not None else None
            await asyncio.sleep(0.005)

    async def count_by_state(self) -> dict[str, int]:
        await self._faults.check("transactions.count_by_state")
        counts = {state.value: 0 for state in TransactionState}
        for tx in self._items.values():
            counts[tx.state.value] = counts.get(tx.state.value, 0) + 1
        return counts

    # Test helpers (not part of the Protocol).
    def peek(self, reference_id: str) -> Transaction:
        return copy.deepcopy(self._items[reference_id])

    def force(self, tx: Transaction) -> None:
        self._items[tx.reference_id] = copy.deepcopy(tx)
