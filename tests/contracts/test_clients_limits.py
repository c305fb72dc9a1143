"""ClientStore, RequestAdmission and RateLimiter: the fakes and the Redis stores keep the same promises."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.domain.identifiers import is_client_id, new_client_id
from serve_app.stores.interfaces import Admission, ClientInfo, ClientStore, RateLimiter, request_counter_key
from tests.contracts.conftest import AdmissionKit, Opener, run_with

# ----------------------------------------------------------------------------------------- clients


def test_a_created_client_verifies_by_id_or_secret(open_clients: Opener[ClientStore]) -> None:
    async def scenario(store: ClientStore) -> None:
        before = time.time()
        info, secret = await store.create("Tenant ünïcode")
        assert (info.name, info.revoked, info.min_score, info.max_matches) == (
            "Tenant ünïcode",
            False,
            None,
            None,
        )
        assert before - 1 <= info.created_at <= time.time() + 1
        # An issued client id, and a secret of 256 random bits (43 URL-safe characters).
        assert is_client_id(info.client_id) and len(secret) >= 43
        assert await store.get(info.client_id) == info
        assert await store.verify(info.client_id, secret) == info
        assert await store.find_by_secret(secret) == info
        other, other_secret = await store.create("other")
        assert await store.verify(info.client_id, other_secret) is None
        assert await store.verify(info.client_id, secret + "x") is None
        assert await store.verify(new_client_id(), secret) is None
        assert await store.verify("not-a-client-id", secret) is None
        assert await store.find_by_secret("no such secret") is None
        assert await store.get(new_client_id()) is None
        assert await store.get("not-a-client-id") is None
        assert await store.find_by_secret(other_secret) == other

    run_with(open_clients, scenario)


@pytest.mark.parametrize("secret", ["\ud800", "\udcff-lone-surrogate", "\x00", ""])
def test_an_odd_secret_matches_nothing(open_clients: Opener[ClientStore], secret: str) -> None:
    async def scenario(store: ClientStore) -> None:
        info, _ = await store.create("tenant")
        assert await store.verify(info.client_id, secret) is None
        assert await store.find_by_secret(secret) is None

    run_with(open_clients, scenario)


def test_clients_are_listed_oldest_first(open_clients: Opener[ClientStore]) -> None:
    async def scenario(store: ClientStore) -> None:
        assert await store.list() == []
        created: list[ClientInfo] = []
        for name in ("first", "second", "third"):
            created.append((await store.create(name))[0])
            await asyncio.sleep(0.01)
        assert await store.list() == created

    run_with(open_clients, scenario)


def test_a_revoked_client_no_longer_verifies(open_clients: Opener[ClientStore]) -> None:
    async def scenario(store: ClientStore) -> None:
        info, secret = await store.create("tenant")
        kept, kept_secret = await store.create("kept")
        assert await store.revoke(info.client_id) is True
        assert await store.verify(info.client_id, secret) is None
        assert await store.find_by_secret(secret) is None
        revoked = await store.get(info.client_id)
        assert revoked is not None and revoked.revoked
        assert [client.revoked for client in await store.list()] == [True, False]
        assert await store.revoke(new_client_id()) is False
        assert await store.revoke("not-a-client-id") is False
        assert await store.verify(kept.client_id, kept_secret) == kept

    run_with(open_clients, scenario)


def test_search_settings_are_set_and_cleared(open_clients: Opener[ClientStore]) -> None:
    async def scenario(store: ClientStore) -> None:
        info, secret = await store.create("tenant")
        updated = await store.update_search_settings(info.client_id, 0.0, 7)
        assert updated is not None and (updated.min_score, updated.max_matches) == (0.0, 7)
        assert await store.get(info.client_id) == updated
        assert await store.verify(info.client_id, secret) == updated
        partly = await store.update_search_settings(info.client_id, 0.625, None)
        assert partly is not None and (partly.min_score, partly.max_matches) == (0.625, None)
        assert [(c.min_score, c.max_matches) for c in await store.list()] == [(0.625, None)]
        cleared = await store.update_search_settings(info.client_id, None, None)
        assert cleared == info
        unknown = new_client_id()
        assert await store.update_search_settings(unknown, 0.5, 3) is None
        assert await store.update_search_settings("not-a-client-id", 0.5, 3) is None
        assert await store.get(unknown) is None  # no record was made for it
        assert await store.list() == [info]

    run_with(open_clients, scenario)


def test_the_service_wide_minimum_score_is_set_and_cleared_apart_from_any_client(
    open_clients: Opener[ClientStore],
) -> None:
    async def scenario(store: ClientStore) -> None:
        assert await store.default_min_score() is None
        info, _ = await store.create("tenant")
        await store.set_default_min_score(0.4375)
        assert await store.default_min_score() == 0.4375
        assert await store.get(info.client_id) == info  # no client's own settings change
        assert await store.list() == [info]  # and it is no client
        await store.set_default_min_score(0.0)
        assert await store.default_min_score() == 0.0
        await store.set_default_min_score(None)
        assert await store.default_min_score() is None

    run_with(open_clients, scenario)


# --------------------------------------------------------------------------------------- admission


def test_admission_counts_active_clients_only(open_admission: Opener[AdmissionKit]) -> None:
    async def scenario(kit: AdmissionKit) -> None:
        info, _ = await kit.clients.create("tenant")
        revoked, _ = await kit.clients.create("revoked")
        await kit.clients.revoke(revoked.client_id)
        for client_id in (revoked.client_id, new_client_id(), "not-a-client-id"):
            for _ in range(3):
                admission = await kit.admission.admit(client_id, 1, 60)
                assert (admission.active, admission.retry_after_s) == (False, 0)
            # Nothing was counted for them: a hit under their key is the first of its window.
            assert await kit.limiter.hit(request_counter_key(client_id), 1, 60) == 0

        assert [await kit.admission.admit(info.client_id, 3, 60) for _ in range(2)] == [Admission(True)] * 2
        key = request_counter_key(info.client_id)
        # Both requests were counted under the limiter's key: a third event there is over a limit of 2.
        assert await kit.limiter.hit(key, 2, 60) > 0
        # And the limiter's events count against the admission: a fourth request is over a limit of 3.
        refused = await kit.admission.admit(info.client_id, 3, 60)
        assert refused.active and 1 <= refused.retry_after_s <= 60

    run_with(open_admission, scenario)


# ------------------------------------------------------------------------------------------ limits


def test_hit_counts_every_event_in_a_fixed_window(open_limiter: Opener[RateLimiter]) -> None:
    async def scenario(limiter: RateLimiter) -> None:
        assert [await limiter.hit("k", 2, 60) for _ in range(2)] == [0, 0]
        refused = await limiter.hit("k", 2, 60)
        assert 1 <= refused <= 60
        # The refused hit was counted too: a fourth event is over a limit of 3.
        assert 1 <= await limiter.hit("k", 3, 60) <= 60
        assert await limiter.hit("other", 2, 60) == 0  # keys are independent
        assert 1 <= await limiter.hit("none allowed", 0, 60) <= 60  # a limit of 0 refuses the first event
        await limiter.reset("k")
        assert [await limiter.hit("k", 2, 60) for _ in range(2)] == [0, 0]  # counting starts again

    run_with(open_limiter, scenario)


def test_a_window_ends_window_s_after_its_first_event(open_limiter: Opener[RateLimiter]) -> None:
    async def scenario(limiter: RateLimiter) -> None:
        assert await limiter.hit("k", 1, 1) == 0
        assert await limiter.hit("k", 1, 1) == 1
        await asyncio.sleep(1.2)
        assert await limiter.hit("k", 1, 1) == 0

    run_with(open_limiter, scenario)


def test_attempts_back_off_doubling_up_to_the_maximum(open_limiter: Opener[RateLimiter]) -> None:
    async def scenario(limiter: RateLimiter) -> None:
        # Two free attempts; then 1.5 s before the next, doubling, at most 2.5 s.
        assert [await limiter.attempt("k", 2, 1.5, 2.5, 60) for _ in range(2)] == [0, 0]
        assert await limiter.attempt("k", 2, 1.5, 2.5, 60) == 2  # 1.5 s, in whole seconds
        await asyncio.sleep(1.6)
        assert await limiter.attempt("k", 2, 1.5, 2.5, 60) == 0
        assert await limiter.attempt("k", 2, 1.5, 2.5, 60) == 3  # 3.0 s capped at 2.5 s
        await limiter.reset("k")
        assert [await limiter.attempt("k", 2, 1.5, 2.5, 60) for _ in range(2)] == [0, 0]
        assert await limiter.attempt("other", 2, 1.5, 2.5, 60) == 0

    run_with(open_limiter, scenario)


def test_attempts_are_forgotten_after_memory_s(open_limiter: Opener[RateLimiter]) -> None:
    async def scenario(limiter: RateLimiter) -> None:
        assert await limiter.attempt("k", 1, 0.2, 10, 0.3) == 0
        await asyncio.sleep(0.7)  # past the 0.2 s wait and the 0.3 s memory after it
        assert await limiter.attempt("k", 1, 1.5, 10, 0.3) == 0
        assert await limiter.attempt("k", 1, 1.5, 10, 0.3) == 2  # the first attempt again: base_s

    run_with(open_limiter, scenario)


def test_fewer_than_one_free_attempt_counts_as_one(open_limiter: Opener[RateLimiter]) -> None:
    async def scenario(limiter: RateLimiter) -> None:
        assert await limiter.attempt("k", 0, 1.5, 10, 60) == 0
        assert await limiter.attempt("k", 0, 1.5, 10, 60) == 2  # base_s, as with one free attempt

    run_with(open_limiter, scenario)
