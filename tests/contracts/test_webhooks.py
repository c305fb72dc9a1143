"""WebhookStore: the fake and the Redis store keep the same promises, events queued by the transaction
store's final write included."""

from __future__ import annotations

import time

from serve_app.domain.outcomes import AgeEstimationOutcome
from serve_app.domain.transactions import Transaction, TransactionKind
from serve_app.domain.webhooks import ClaimedEvent, DeliveryAttempt, Settlement, event_id, secret_key
from tests.contracts.conftest import WEBHOOK_LOG_SIZE, Opener, WebhookKit, make_tx, run_with

TENANT = "cl_0123456789abcdef01234567"
OTHER = "cl_76543210fedcba9876543210"
URL = "https://hooks.example.com/in"
LEASE_S = 30.0


async def finish(kit: WebhookKit, tenant: str = TENANT, *, fail: bool = False) -> Transaction:
    """A transaction of the tenant made final, as a worker does."""
    tx = make_tx(tenant_id=tenant, kind=TransactionKind.AGE_ESTIMATION, enroll_face=False)
    await kit.transactions.create_and_enqueue(tx)
    await kit.transactions.mark_processing(tx.reference_id)
    if fail:
        await kit.transactions.fail(tx.reference_id, "no face found")
    else:
        await kit.transactions.complete(tx.reference_id, AgeEstimationOutcome(age=40, under_18=0, under_21=0))
    return tx


def attempt(event: ClaimedEvent, outcome: str, at: float, status: int | None = None) -> DeliveryAttempt:
    return DeliveryAttempt(
        event_id=event.event_id,
        reference_id=event.reference_id,
        attempt=event.attempt,
        at=at,
        outcome=outcome,
        status_code=status,
        error=None if status is not None else "connect failed",
        duration_ms=1.5,
        next_attempt_at=None,
    )


def test_the_endpoint_is_registered_once_and_its_secret_shown_once(open_webhooks: Opener[WebhookKit]) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        assert await hooks.get(TENANT) is None
        assert await hooks.signing_keys(TENANT) == (None, [])
        secret = await hooks.set_url(TENANT, URL)
        assert secret is not None and secret.startswith("whsec_")
        first = await hooks.get(TENANT)
        assert first is not None and first.url == URL and first.secret_rotated_at is None
        assert first.previous_secret_until is None
        assert await hooks.set_url(TENANT, URL + "2") is None  # shown once only
        changed = await hooks.get(TENANT)
        assert changed is not None and changed.url == URL + "2" and changed.created_at == first.created_at
        assert await hooks.signing_keys(TENANT) == (URL + "2", [secret_key(secret)])
        assert await hooks.remove_url(TENANT) is True
        assert await hooks.remove_url(TENANT) is False
        assert await hooks.signing_keys(TENANT) == (None, [secret_key(secret)])  # the secret stays
        assert await hooks.delete(TENANT) is True
        assert await hooks.get(TENANT) is None and await hooks.delete(TENANT) is False

    run_with(open_webhooks, scenario)


def test_a_rotated_secret_signs_beside_the_new_one_for_its_grace(open_webhooks: Opener[WebhookKit]) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        old = await hooks.set_url(TENANT, URL)
        assert old is not None
        new = await hooks.rotate_secret(TENANT, 3600)
        assert new != old
        assert (await hooks.signing_keys(TENANT))[1] == [secret_key(new), secret_key(old)]
        config = await hooks.get(TENANT)
        assert config is not None and config.secret_rotated_at is not None
        assert config.previous_secret_until is not None and config.previous_secret_until > time.time()
        newest = await hooks.rotate_secret(TENANT, 0)  # no grace: the one before stops signing now
        assert (await hooks.signing_keys(TENANT))[1] == [secret_key(newest)]
        after = await hooks.get(TENANT)
        assert after is not None and after.previous_secret_until is None

    run_with(open_webhooks, scenario)


def test_the_final_write_queues_one_event_for_a_tenant_with_an_endpoint(
    open_webhooks: Opener[WebhookKit],
) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        before = await finish(kit)
        assert await hooks.event_state(event_id(before.reference_id)) == {}  # no endpoint yet
        await hooks.set_url(TENANT, URL)
        finishing_from_ms = int(time.time() * 1000)
        completed, failed = await finish(kit), await finish(kit, fail=True)
        finished_by_ms = int(time.time() * 1000) + 1
        unregistered = await finish(kit, OTHER)
        assert await hooks.event_state(event_id(unregistered.reference_id)) == {}
        state = await hooks.event_state(event_id(completed.reference_id))
        assert (state["state"], state["attempts"], state["tenant"]) == ("pending", "0", TENANT)
        # Final already: making it final again queues nothing more.
        assert not await kit.transactions.complete(
            completed.reference_id, AgeEstimationOutcome(age=1, under_18=100, under_21=100)
        )
        assert (await hooks.stats(time.time())).pending == 2
        claimed = await hooks.claim_due(time.time() + 1, LEASE_S, 10)
        by_ref = {event.reference_id: event for event in claimed}
        assert set(by_ref) == {completed.reference_id, failed.reference_id}
        done = by_ref[completed.reference_id]
        assert (done.event_id, done.tenant, done.state, done.attempt) == (
            event_id(completed.reference_id),
            TENANT,
            "completed",
            1,
        )
        assert done.since_ms == done.final_at_ms
        assert finishing_from_ms <= done.final_at_ms <= finished_by_ms  # the moment it became final
        assert by_ref[failed.reference_id].state == "failed"
        await hooks.remove_url(TENANT)
        assert await hooks.event_state(event_id((await finish(kit)).reference_id)) == {}

    run_with(open_webhooks, scenario)


def test_a_claim_leases_its_events_and_a_settle_moves_them_on(open_webhooks: Opener[WebhookKit]) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        await hooks.set_url(TENANT, URL)
        tx = await finish(kit)
        now = time.time() + 1
        (first,) = await hooks.claim_due(now, LEASE_S, 10)
        assert (await hooks.event_state(first.event_id))["state"] == "delivering"
        assert await hooks.claim_due(now + LEASE_S - 1, LEASE_S, 10) == []  # leased
        # The claimer died: due again once the lease lapsed, as a new attempt.
        (second,) = await hooks.claim_due(now + LEASE_S + 1, LEASE_S, 10)
        assert second.attempt == 2 and second.since_ms == first.since_ms
        # The first claim comes back late: logged, but the event is the second claim's.
        assert not await hooks.settle(first, Settlement.DELIVERED, attempt(first, "delivered", now, 200))
        assert (await hooks.event_state(second.event_id))["state"] == "delivering"
        retry_at = now + LEASE_S + 5
        retried = attempt(second, "retrying", now + LEASE_S + 1)
        assert await hooks.settle(second, Settlement.RETRY, retried, retry_at)
        state = await hooks.event_state(second.event_id)
        assert (state["state"], state["last"]) == ("pending", "connect failed")
        assert await hooks.claim_due(retry_at - 1, LEASE_S, 10) == []
        (third,) = await hooks.claim_due(retry_at, LEASE_S, 10)
        assert third.attempt == 3
        assert await hooks.settle(third, Settlement.DELIVERED, attempt(third, "delivered", retry_at, 204))
        assert (await hooks.event_state(third.event_id))["state"] == "delivered"
        assert await hooks.claim_due(retry_at + 10 * LEASE_S, LEASE_S, 10) == []
        stats = await hooks.stats(retry_at)
        assert (stats.pending, stats.oldest_age_s) == (0, 0.0)
        assert stats.totals == {"delivered": 1, "retried": 1, "dead": 0}
        log = await hooks.deliveries(TENANT, 10)
        assert [(a.attempt, a.outcome) for a in log] == [(3, "delivered"), (2, "retrying"), (1, "delivered")]
        assert log[0].reference_id == tx.reference_id and log[0].status_code == 204

    run_with(open_webhooks, scenario)


def test_claims_take_the_earliest_due_first_and_at_most_count(open_webhooks: Opener[WebhookKit]) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        await hooks.set_url(TENANT, URL)
        refs = [(await finish(kit)).reference_id for _ in range(3)]
        now = time.time() + 1
        stats = await hooks.stats(now + 9)
        assert stats.pending == 3 and stats.oldest_age_s >= 9
        claimed = await hooks.claim_due(now, LEASE_S, 2)
        assert len(claimed) == 2
        (last,) = await hooks.claim_due(now, LEASE_S, 2)
        assert {event.reference_id for event in [*claimed, last]} == set(refs)
        assert max(event.final_at_ms for event in claimed) <= last.final_at_ms

    run_with(open_webhooks, scenario)


def test_a_dead_event_is_redelivered_with_a_fresh_window_only_to_its_tenant(
    open_webhooks: Opener[WebhookKit],
) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        await hooks.set_url(TENANT, URL)
        tx = await finish(kit)
        event = event_id(tx.reference_id)
        assert await hooks.redeliver(TENANT, event) is False  # queued already
        now = time.time() + 1
        (claimed,) = await hooks.claim_due(now, LEASE_S, 10)
        assert await hooks.settle(claimed, Settlement.DEAD, attempt(claimed, "dead", now))
        assert (await hooks.event_state(event))["state"] == "dead"
        assert (await hooks.stats(now)).totals["dead"] == 1
        assert await hooks.redeliver(OTHER, event) is None
        assert await hooks.redeliver(TENANT, event_id("0" * 32)) is None
        assert await hooks.redeliver(TENANT, event) is True
        (again,) = await hooks.claim_due(time.time() + 1, LEASE_S, 10)
        assert again.event_id == event and again.attempt == 2 and again.since_ms > claimed.since_ms - 1
        assert again.since_ms >= claimed.final_at_ms and again.final_at_ms == claimed.final_at_ms

    run_with(open_webhooks, scenario)


def test_the_delivery_log_keeps_the_newest_attempts(open_webhooks: Opener[WebhookKit]) -> None:
    async def scenario(kit: WebhookKit) -> None:
        hooks = kit.webhooks
        await hooks.set_url(TENANT, URL)
        await finish(kit)
        now = time.time() + 1
        for n in range(WEBHOOK_LOG_SIZE + 2):
            (claimed,) = await hooks.claim_due(now + n, LEASE_S, 1)
            await hooks.settle(claimed, Settlement.RETRY, attempt(claimed, "retrying", now + n), now + n + 1)
        log = await hooks.deliveries(TENANT, 100)
        assert [a.attempt for a in log] == list(range(WEBHOOK_LOG_SIZE + 2, 2, -1))
        assert [a.attempt for a in await hooks.deliveries(TENANT, 2)] == [
            WEBHOOK_LOG_SIZE + 2,
            WEBHOOK_LOG_SIZE + 1,
        ]
        assert await hooks.deliveries(OTHER, 10) == []
        assert await hooks.delete(TENANT) and await hooks.deliveries(TENANT, 10) == []

    run_with(open_webhooks, scenario)
