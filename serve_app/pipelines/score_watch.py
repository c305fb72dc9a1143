"""What the face searches score, per tenant, for the metrics that watch for a shift (a new camera, a new
population): observed from the outcome the processor records when it makes a transaction final, so the
processing itself is untouched.

OutcomeReporting is the worker's TransactionStore as its processor sees it: every call goes to the store,
and each face search outcome that a complete() made final (once, whichever attempt) is handed to the
observer with its tenant. The observer must be cheap and must not raise (serve_app.deployments.metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from serve_app.domain.idempotency import IdempotencyClaim
from serve_app.domain.outcomes import FaceSearchOutcome, Outcome
from serve_app.domain.transactions import Transaction
from serve_app.stores.interfaces import TransactionStore

logger = logging.getLogger(__name__)

SearchObserver = Callable[[str, FaceSearchOutcome], None]
# Transactions between mark_processing and their final state, per worker: bounded by its concurrency; the
# bound guards against attempts that die between the two (they never reach complete() or fail()).
_MAX_REMEMBERED = 100_000


class OutcomeReporting:
    def __init__(self, store: TransactionStore, on_search: SearchObserver) -> None:
        self._store = store
        self._on_search = on_search
        self._tenants: dict[str, str] = {}  # reference_id -> tenant, while it is being processed

    async def create_and_enqueue(self, tx: Transaction, claim: IdempotencyClaim | None = None) -> str:
        return await self._store.create_and_enqueue(tx, claim)

    async def get(self, reference_id: str) -> Transaction | None:
        return await self._store.get(reference_id)

    async def mark_processing(self, reference_id: str) -> Transaction | None:
        tx = await self._store.mark_processing(reference_id)
        if tx is not None:
            if len(self._tenants) >= _MAX_REMEMBERED:
                self._tenants.clear()
            self._tenants[reference_id] = tx.tenant_id
        return tx

    async def complete(self, reference_id: str, result: Outcome) -> bool:
        completed = await self._store.complete(reference_id, result)
        tenant = self._tenants.pop(reference_id, None)
        if completed and tenant is not None and isinstance(result, FaceSearchOutcome):
            try:
                self._on_search(tenant, result)
            except Exception as error:  # metrics never fail a transaction
                logger.debug("search score metrics failed: %r", error)
        return completed

    async def fail(self, reference_id: str, error: str) -> None:
        self._tenants.pop(reference_id, None)
        await self._store.fail(reference_id, error)

    async def wait_final(
        self, reference_id: str, timeout_s: float, *, seen_pending: bool = False
    ) -> Transaction | None:
        return await self._store.wait_final(reference_id, timeout_s, seen_pending=seen_pending)

    async def count_by_state(self) -> dict[str, int]:
        return await self._store.count_by_state()

    async def image_keys_in_flight(self) -> set[str]:
        return await self._store.image_keys_in_flight()


def best_score(outcome: FaceSearchOutcome) -> float | None:
    """The best match's score, None when the search returned no match (none reached the threshold)."""
    return max((match.score for match in outcome.matches), default=None)
