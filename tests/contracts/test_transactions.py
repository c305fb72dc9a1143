"""TransactionStore and WorkQueue: the fake and the Redis store keep the same promises."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.idempotency import IdempotencyClaim, IdempotencyConflict
from serve_app.domain.outcomes import FaceMatch, FaceSearchOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from tests.contracts.conftest import Opener, QueueKit, make_tx, run_with

MATCHED = FaceSearchOutcome(
    is_face_found=True,
    # As stored: a match keeps its face id and score; the reference is joined from the record when read.
    matches=(FaceMatch(face_id=f"f{new_reference_id()}", score=0.875, client_reference=""),),
    enrolled=True,
)


async def enqueue(kit: QueueKit, how_many: int) -> list[Transaction]:
    txs = [make_tx() for _ in range(how_many)]
    for tx in txs:
        await kit.transactions.create_and_enqueue(tx)
    return txs


# ------------------------------------------------------------------------------------ transactions


def test_a_created_transaction_reads_back_field_for_field(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        plain = make_tx(client_reference=None, kind=TransactionKind.AGE_ESTIMATION)
        rich = make_tx(created_at=1_700_000_000.123456, updated_at=1_700_000_001.5)
        for tx in (plain, rich):
            await kit.transactions.create_and_enqueue(tx)
            assert await kit.transactions.get(tx.reference_id) == tx
        assert await kit.transactions.get(new_reference_id()) is None
        # Values that are not issued reference ids are unknown, whatever they hold.
        for foreign in ("not-an-issued-id", "\ud800", "a" * 31 + "\x00", "queue"):
            assert await kit.transactions.get(foreign) is None

    run_with(open_queue, scenario)


def test_a_key_creates_once_and_answers_its_retries_with_that_transaction(
    open_queue: Opener[QueueKit],
) -> None:
    async def scenario(kit: QueueKit) -> None:
        first, retry = make_tx(), make_tx()
        claim = IdempotencyClaim("tenant-a", "key-1", "fingerprint-1")
        assert await kit.transactions.create_and_enqueue(first, claim) == first.reference_id
        # The retry is another attempt at the same request: it is answered with the first transaction.
        assert await kit.transactions.create_and_enqueue(retry, claim) == first.reference_id
        assert await kit.transactions.get(retry.reference_id) is None
        # The same key with another request is refused; another tenant's key of the same name is its own.
        with pytest.raises(IdempotencyConflict):
            await kit.transactions.create_and_enqueue(
                make_tx(), IdempotencyClaim("tenant-a", "key-1", "other")
            )
        elsewhere = make_tx(tenant_id="tenant-b")
        theirs = IdempotencyClaim("tenant-b", "key-1", "fingerprint-1")
        assert await kit.transactions.create_and_enqueue(elsewhere, theirs) == elsewhere.reference_id
        counts = await kit.transactions.count_by_state()
        assert counts[TransactionState.QUEUED.value] == 2
        entries = await kit.queue.claim("w", 10, 0)
        assert sorted(entry.reference_id for entry in entries) == sorted(
            [first.reference_id, elsewhere.reference_id]
        )

    run_with(open_queue, scenario)


def test_concurrent_creates_with_one_key_make_one_transaction(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        claim = IdempotencyClaim("tenant-a", "racing", "fingerprint")
        txs = [make_tx() for _ in range(8)]
        answers = await asyncio.gather(*(kit.transactions.create_and_enqueue(tx, claim) for tx in txs))
        assert len(set(answers)) == 1 and answers[0] in {tx.reference_id for tx in txs}
        assert (await kit.transactions.count_by_state())[TransactionState.QUEUED.value] == 1
        assert [entry.reference_id for entry in await kit.queue.claim("w", 10, 0)] == answers[:1]

    run_with(open_queue, scenario)


def test_mark_processing_moves_queued_and_processing_and_refuses_final_or_unknown(
    open_queue: Opener[QueueKit],
) -> None:
    async def scenario(kit: QueueKit) -> None:
        (tx,) = await enqueue(kit, 1)
        first = await kit.transactions.mark_processing(tx.reference_id)
        assert first is not None and first.state == TransactionState.PROCESSING and first.attempts == 1
        again = await kit.transactions.mark_processing(tx.reference_id)  # a redelivery after a crash
        assert again is not None and again.state == TransactionState.PROCESSING and again.attempts == 2
        assert again.updated_at >= tx.updated_at
        stored = await kit.transactions.get(tx.reference_id)
        assert stored is not None and stored.attempts == 2
        await kit.transactions.complete(tx.reference_id, MATCHED)
        assert await kit.transactions.mark_processing(tx.reference_id) is None
        assert await kit.transactions.mark_processing(new_reference_id()) is None

    run_with(open_queue, scenario)


@pytest.mark.parametrize("first", ["complete", "fail"])
def test_a_final_state_is_never_overwritten(open_queue: Opener[QueueKit], first: str) -> None:
    async def scenario(kit: QueueKit) -> None:
        (tx,) = await enqueue(kit, 1)
        await kit.transactions.mark_processing(tx.reference_id)
        if first == "complete":
            assert await kit.transactions.complete(tx.reference_id, MATCHED) is True
            await kit.transactions.fail(tx.reference_id, "too late")
            late = FaceSearchOutcome(is_face_found=False)
            assert await kit.transactions.complete(tx.reference_id, late) is False
        else:
            await kit.transactions.fail(tx.reference_id, "the image cannot be decoded")
            assert await kit.transactions.complete(tx.reference_id, MATCHED) is False
        final = await kit.transactions.get(tx.reference_id)
        assert final is not None
        if first == "complete":
            assert (final.state, final.result, final.error) == (TransactionState.COMPLETED, MATCHED, None)
        else:
            assert (final.state, final.result) == (TransactionState.FAILED, None)
            assert final.error == "the image cannot be decoded"
        # Finalising changes the state, its result or error and updated_at; every other field is kept.
        unchanged = {"state", "result", "error", "updated_at"}
        kept = {f.name for f in dataclasses.fields(Transaction)} - unchanged
        assert {name: getattr(final, name) for name in kept} == {name: getattr(tx, name) for name in kept} | {
            "attempts": 1
        }
        # Finalising an unknown transaction creates nothing.
        unknown = new_reference_id()
        assert await kit.transactions.complete(unknown, MATCHED) is False
        await kit.transactions.fail(unknown, "x")
        assert await kit.transactions.get(unknown) is None

    run_with(open_queue, scenario)


def test_a_result_is_kept_without_the_client_references_of_its_matches(open_queue: Opener[QueueKit]) -> None:
    """A match's client_reference is joined from the face record when a result is read, so the store keeps
    the face id and score only: a reference changed or erased later is never read from an old result."""

    async def scenario(kit: QueueKit) -> None:
        (tx,) = await enqueue(kit, 1)
        named = FaceSearchOutcome(
            is_face_found=True,
            matches=(FaceMatch(face_id=MATCHED.matches[0].face_id, score=0.875, client_reference='emp "7"'),),
            enrolled=True,
        )
        assert await kit.transactions.complete(tx.reference_id, named) is True
        final = await kit.transactions.get(tx.reference_id)
        assert final is not None and final.result == MATCHED

    run_with(open_queue, scenario)


def test_wait_final_returns_the_completion_or_the_latest_state_at_the_timeout(
    open_queue: Opener[QueueKit],
) -> None:
    async def scenario(kit: QueueKit) -> None:
        waited, finished = await enqueue(kit, 2)
        timed_out = await kit.transactions.wait_final(waited.reference_id, 0.05)
        assert timed_out is not None and timed_out.state == TransactionState.QUEUED
        assert await kit.transactions.wait_final(new_reference_id(), 0.05) is None

        async def complete_later() -> None:
            await asyncio.sleep(0.05)
            await kit.transactions.complete(waited.reference_id, MATCHED)

        completing = asyncio.create_task(complete_later())
        done = await kit.transactions.wait_final(waited.reference_id, 30.0, seen_pending=True)
        await completing
        assert done is not None and done.state == TransactionState.COMPLETED and done.result == MATCHED

        await kit.transactions.fail(finished.reference_id, "broken")
        at_once = await kit.transactions.wait_final(finished.reference_id, 0.0)
        assert at_once is not None and at_once.state == TransactionState.FAILED

    run_with(open_queue, scenario)


def test_a_final_transaction_answers_every_waiter_without_waiting_out_the_timeout(
    open_queue: Opener[QueueKit],
) -> None:
    """Hour-long waits: run_with's hang guard (a minute) fails the test if one waits for its timeout."""

    async def scenario(kit: QueueKit) -> None:
        (tx,) = await enqueue(kit, 1)
        wait = kit.transactions.wait_final
        waiters = [asyncio.create_task(wait(tx.reference_id, 3600.0)) for _ in range(2)]
        await asyncio.sleep(0.05)  # both are waiting
        await kit.transactions.fail(tx.reference_id, "broken")
        woken = await asyncio.gather(*waiters)
        assert [t.state if t else None for t in woken] == [TransactionState.FAILED] * 2
        # Final already: answered at once, also to a caller that read it pending just before it finished
        # (seen_pending), however many such callers come.
        again = await kit.transactions.wait_final(tx.reference_id, 3600.0)
        assert again is not None and again.state == TransactionState.FAILED
        for _ in range(3):
            seen = await kit.transactions.wait_final(tx.reference_id, 3600.0, seen_pending=True)
            assert seen is not None and seen.state == TransactionState.FAILED

    run_with(open_queue, scenario)


def test_count_by_state_names_every_state(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        assert await kit.transactions.count_by_state() == {state.value: 0 for state in TransactionState}
        queued, processing, completed, failed, _queued_too = await enqueue(kit, 5)
        for tx in (processing, completed, failed):
            await kit.transactions.mark_processing(tx.reference_id)
        await kit.transactions.complete(completed.reference_id, MATCHED)
        await kit.transactions.fail(failed.reference_id, "broken")
        await kit.transactions.complete(queued.reference_id, MATCHED)  # straight from queued
        assert await kit.transactions.count_by_state() == {
            "queued": 1,
            "processing": 1,
            "completed": 2,
            "failed": 1,
        }

    run_with(open_queue, scenario)


def test_image_keys_in_flight_are_those_of_unacknowledged_entries(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        assert await kit.transactions.image_keys_in_flight() == set()
        undelivered, pending, acked = await enqueue(kit, 3)
        entries = {e.reference_id: e for e in await kit.queue.claim("c1", 2, 0)}
        assert set(entries) == {undelivered.reference_id, pending.reference_id}
        await kit.queue.ack([entries[undelivered.reference_id].entry_id])
        # undelivered was claimed and acknowledged; the third is still on the queue, never delivered.
        assert await kit.transactions.image_keys_in_flight() == {pending.image_key, acked.image_key}

    run_with(open_queue, scenario)


# -------------------------------------------------------------------------------------- work queue


def test_claim_hands_out_each_entry_once_in_order(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        txs = await enqueue(kit, 3)
        first = await kit.queue.claim("c1", 2, 0)
        second = await kit.queue.claim("c2", 10, 0)
        assert [e.reference_id for e in first + second] == [tx.reference_id for tx in txs]
        assert [e.deliveries for e in first + second] == [1, 1, 1]
        assert len({e.entry_id for e in first + second}) == 3
        assert await kit.queue.claim("c1", 10, 0) == []
        assert await kit.queue.depth() == 3  # delivered, not acknowledged

    run_with(open_queue, scenario)


def test_claim_waits_up_to_block_ms_for_an_entry(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        assert await kit.queue.claim("c1", 1, 20) == []

        async def enqueue_later() -> Transaction:
            await asyncio.sleep(0.05)
            (tx,) = await enqueue(kit, 1)
            return tx

        adding = asyncio.create_task(enqueue_later())
        claimed = await kit.queue.claim("c1", 1, 30_000)
        tx = await adding
        assert [e.reference_id for e in claimed] == [tx.reference_id]

    run_with(open_queue, scenario)


def test_asking_for_no_entries_is_refused(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        await enqueue(kit, 1)
        with pytest.raises(BackendUnavailable):
            await kit.queue.claim("c1", 0, 0)
        with pytest.raises(BackendUnavailable):
            await kit.queue.reclaim_stale("c1", 0, 0)
        assert [e.deliveries for e in await kit.queue.claim("c1", 1, 0)] == [1]

    run_with(open_queue, scenario)


def test_ack_removes_entries_for_good(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        await enqueue(kit, 3)
        entries = await kit.queue.claim("c1", 3, 0)
        await kit.queue.ack([entries[0].entry_id, entries[2].entry_id])
        await kit.queue.ack([entries[0].entry_id])  # again: nothing happens
        await kit.queue.ack([])
        assert await kit.queue.depth() == 1
        reclaimed = await kit.queue.reclaim_stale("c2", 0, 10)
        assert [e.entry_id for e in reclaimed] == [entries[1].entry_id]

    run_with(open_queue, scenario)


def test_reclaim_stale_takes_over_idle_entries_and_counts_the_delivery(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        txs = await enqueue(kit, 3)
        await kit.queue.claim("c1", 3, 0)
        assert await kit.queue.reclaim_stale("c2", 60_000, 10) == []  # not idle for a minute
        taken = await kit.queue.reclaim_stale("c2", 0, 2)
        assert [e.reference_id for e in taken] == [tx.reference_id for tx in txs[:2]]
        assert [e.deliveries for e in taken] == [2, 2]
        again = await kit.queue.reclaim_stale("c3", 0, 10)
        assert [(e.reference_id, e.deliveries) for e in again] == [
            (txs[0].reference_id, 3),
            (txs[1].reference_id, 3),
            (txs[2].reference_id, 2),
        ]
        assert await kit.queue.depth() == 3

    run_with(open_queue, scenario)


def test_renew_keeps_the_lease_without_counting_a_delivery(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        await enqueue(kit, 3)
        kept, idle, acked = await kit.queue.claim("c1", 3, 0)
        await kit.queue.ack([acked.entry_id])
        await asyncio.sleep(1.0)
        held = await kit.queue.renew("c1", [kept.entry_id, acked.entry_id, "999999-0"])
        assert held == [kept.entry_id]  # an acknowledged or unknown entry is not held
        assert await kit.queue.renew("c1", []) == []
        # Idle since the renewal (well under 0.8 s) vs. since the claim (over 1 s): only `idle` is stale.
        stale = await kit.queue.reclaim_stale("c2", 800, 10)
        assert [(e.entry_id, e.deliveries) for e in stale] == [(idle.entry_id, 2)]
        # c2 now holds `idle`: c1 cannot renew it, and c2's renewal does not count a delivery.
        assert await kit.queue.renew("c1", [idle.entry_id]) == []
        assert await kit.queue.renew("c2", [idle.entry_id]) == [idle.entry_id]
        everything = await kit.queue.reclaim_stale("c3", 0, 10)
        assert [(e.entry_id, e.deliveries) for e in everything] == [(kept.entry_id, 2), (idle.entry_id, 3)]

    run_with(open_queue, scenario)


def test_requeue_puts_the_transaction_back_as_a_new_undelivered_entry(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        first, second = await enqueue(kit, 2)
        await kit.queue.claim("c1", 1, 0)
        (redelivered,) = await kit.queue.reclaim_stale("c2", 0, 1)
        assert (redelivered.reference_id, redelivered.deliveries) == (first.reference_id, 2)
        await kit.queue.requeue(redelivered)
        assert await kit.queue.depth() == 2
        assert await kit.queue.reclaim_stale("c3", 0, 10) == []  # the old entry is gone
        assert await kit.transactions.image_keys_in_flight() == {first.image_key, second.image_key}
        claimed = await kit.queue.claim("c3", 10, 0)
        # Behind the entries already waiting, with a fresh delivery count.
        assert [(e.reference_id, e.deliveries) for e in claimed] == [
            (second.reference_id, 1),
            (first.reference_id, 1),
        ]
        assert redelivered.entry_id not in {e.entry_id for e in claimed}

    run_with(open_queue, scenario)


def test_requeue_of_an_acknowledged_entry_puts_nothing_back(open_queue: Opener[QueueKit]) -> None:
    async def scenario(kit: QueueKit) -> None:
        await enqueue(kit, 1)
        (entry,) = await kit.queue.claim("c1", 1, 0)
        await kit.queue.ack([entry.entry_id])  # done (by its lease's new holder, say)
        await kit.queue.requeue(entry)  # a late outage report of the first holder
        assert await kit.queue.depth() == 0
        assert await kit.queue.claim("c2", 10, 0) == []
        assert await kit.transactions.image_keys_in_flight() == set()

    run_with(open_queue, scenario)
