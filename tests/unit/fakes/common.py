"""Clocks, armed faults and encoding checks shared by the fakes."""

from __future__ import annotations

import asyncio

from serve_app.domain.errors import BackendUnavailable

EMBEDDING_SIZE = 256  # face model v2 (models.embedder.FUSED_DIM)
MODEL_VERSION = "unit-test-v2"  # of TEST_POLICY and the fake gallery


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Faults:
    """Armed failures, by operation name ("transactions.complete", "gallery.delete", ...)."""

    def __init__(self) -> None:
        self._armed: dict[str, list[BaseException]] = {}
        self.calls: dict[str, int] = {}

    def arm(self, operation: str, times: int = 1, error: BaseException | None = None) -> None:
        failure = error if error is not None else BackendUnavailable(f"{operation} is unavailable")
        self._armed.setdefault(operation, []).extend([failure] * times)

    async def check(self, operation: str) -> None:
        self.calls[operation] = self.calls.get(operation, 0) + 1
        await asyncio.sleep(0)  # a real store round-trips; let other tasks run
        pending = self._armed.get(operation)
        if pending:
            raise pending.pop(0)


def _encodable(*values: str | None) -> None:
    for value in values:
        if value is not None:
            value.encode("utf-8")  # UnicodeEncodeError for lone surrogates, as redis-py would raise
