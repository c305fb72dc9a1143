"""TransactionProcessor over in-memory stores and a scripted analysis backend."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.faces import GalleryEntry
from serve_app.domain.outcomes import (
    AgeDecisionReport,
    AgeEstimationOutcome,
    FaceSearchOutcome,
    QualityReport,
)
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.pipelines.commands import AgeEstimationCommand, FaceSearchCommand
from serve_app.pipelines.processing import enrolled_face_id
from tests.unit.fakes import (
    TEST_POLICY,
    Color,
    FakeGalleryStore,
    NonExclusiveRecordStore,
    World,
    at_cosine,
    embedding,
    face,
    face_quality,
    quality,
    solid_png,
    wait_until,
)

TENANT = "tenant-a"
OTHER_TENANT = "tenant-b"
RED: Color = (200, 30, 30)
GREEN: Color = (30, 200, 30)
BLUE: Color = (30, 30, 200)


async def submit_search(
    world: World,
    color: Color,
    *,
    tenant_id: str = TENANT,
    client_reference: str | None = None,
    allow_override: bool = False,
    enroll_face: bool = True,
) -> Transaction:
    command = FaceSearchCommand(
        tenant_id=tenant_id,
        image=solid_png(color),
        client_reference=client_reference,
        allow_override=allow_override,
        enroll_face=enroll_face,
    )
    return await world.transaction_service().create_face_search(command)


async def submit_age(world: World, color: Color, *, enroll_face: bool = True) -> Transaction:
    command = AgeEstimationCommand(tenant_id=TENANT, image=solid_png(color), enroll_face=enroll_face)
    return await world.transaction_service().create_age_estimation(command)


async def matched(world: World, tx: Transaction) -> list[list[object]]:
    """The matches as the owner reads them: the references joined from the face records."""
    final = await world.transaction_service().readable(world.transactions.peek(tx.reference_id))
    assert final.state is TransactionState.COMPLETED, final
    assert isinstance(final.result, FaceSearchOutcome)
    return triples(final.result)


def triples(outcome: FaceSearchOutcome) -> list[list[object]]:
    return [[match.face_id, match.score, match.client_reference] for match in outcome.matches]


def test_search_runs_before_enrolment_so_a_probe_never_matches_itself() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        first = await submit_search(world, RED, client_reference="customer-1")
        await world.processor().process(first.reference_id)

        assert await matched(world, first) == []
        own = enrolled_face_id(first.reference_id)
        assert world.gallery.face_ids(TENANT) == {own}
        record = await world.record_store.get(TENANT, own)
        assert record is not None
        assert record.reference_id == first.reference_id
        assert record.client_reference == "customer-1"
        assert record.proof_key == first.image_key
        assert record.model_version == TEST_POLICY.model_version
        assert first.image_key in world.blobs.items  # the upload is now the proof image

        # The same face again matches the first enrolment (cosine 1), never its own new one.
        second = await submit_search(world, RED)
        await world.processor().process(second.reference_id)
        assert await matched(world, second) == [[own, pytest.approx(1.0, abs=1e-4), "customer-1"]]
        assert world.gallery.face_ids(TENANT) == {own, enrolled_face_id(second.reference_id)}

    asyncio.run(scenario())


def test_matches_are_the_tenants_own_closest_first_within_the_minimum_score() -> None:
    async def scenario() -> None:
        world = World(policy=dataclasses.replace(TEST_POLICY, max_matches=3))
        calibration = TEST_POLICY.calibration
        probe = embedding(1)
        edge = calibration.cosine_for_score(0.5)  # TEST_POLICY's minimum score
        cosines = {"near": 0.98, "mid": 0.9, "edge": edge + 0.002, "far": edge - 0.002, "farther": 0.5}
        for index, (face_id, cosine) in enumerate(cosines.items()):
            reference = None if face_id == "mid" else f"ref-{face_id}"
            await world.enrol(TENANT, face_id, at_cosine(probe, cosine, index), reference)
        await world.enrol(OTHER_TENANT, "foreign", probe, "someone-else")  # identical, other tenant
        world.analysis.faces_by_color[RED] = [face(probe)]

        tx = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(tx.reference_id)

        result = await matched(world, tx)
        assert [entry[0] for entry in result] == ["near", "mid", "edge"]
        assert [entry[2] for entry in result] == ["ref-near", "", "ref-edge"]
        scores = [float(str(entry[1])) for entry in result]
        assert all(isinstance(entry[1], float) for entry in result)
        expected = [calibration.score(cosines[str(entry[0])]) for entry in result]
        assert scores == pytest.approx(expected, abs=1e-4)
        assert all(0.5 <= score <= 1.0 for score in scores)
        assert scores == sorted(scores, reverse=True)
        tenant, limit, min_similarity = world.gallery.searches[-1]
        assert tenant == TENANT
        assert limit == 4  # one extra in case the transaction's own face is among them
        assert min_similarity == pytest.approx(edge)

    asyncio.run(scenario())


def test_match_list_is_capped_at_max_matches() -> None:
    async def scenario() -> None:
        world = World(policy=dataclasses.replace(TEST_POLICY, max_matches=2))
        probe = embedding(1)
        for index in range(5):
            await world.enrol(TENANT, f"face-{index}", at_cosine(probe, 0.99 - 0.03 * index, index))
        world.analysis.faces_by_color[RED] = [face(probe)]
        tx = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(tx.reference_id)
        assert [entry[0] for entry in await matched(world, tx)] == ["face-0", "face-1"]

    asyncio.run(scenario())


def test_retry_after_a_crash_between_enrolment_and_completion_enrols_once_and_skips_its_own_face() -> None:
    async def scenario() -> None:
        world = World(policy=dataclasses.replace(TEST_POLICY, max_matches=1))
        probe = embedding(1)
        await world.enrol(TENANT, "other", at_cosine(probe, 0.95), "customer-2")
        world.analysis.faces_by_color[RED] = [face(probe)]
        tx = await submit_search(world, RED, client_reference="customer-1")
        own = enrolled_face_id(tx.reference_id)

        world.faults.arm("transactions.complete")  # the worker dies after enrolling, before completing
        with pytest.raises(BackendUnavailable):
            await world.processor().process(tx.reference_id)
        assert world.transactions.peek(tx.reference_id).state is TransactionState.PROCESSING
        assert world.gallery.face_ids(TENANT) == {"other", own}

        await world.processor().process(tx.reference_id)

        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.COMPLETED
        assert final.attempts == 2
        # The earlier attempt's face is identical and comes back from the gallery first; it is dropped,
        # and max_matches=1 still leaves room for the real match.
        assert [entry[0] for entry in await matched(world, tx)] == ["other"]
        assert world.gallery.face_ids(TENANT) == {"other", own}
        assert sorted(record.face_id for record in world.record_store.records(TENANT)) == sorted(
            ["other", own]
        )
        assert tx.image_key in world.blobs.items

    asyncio.run(scenario())


def test_an_override_retried_after_a_crash_before_completion_leaves_only_its_own_face() -> None:
    async def scenario() -> None:
        world = World()
        old = await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        world.faults.arm("transactions.complete")
        with pytest.raises(BackendUnavailable):
            await world.processor().process(tx.reference_id)
        await world.processor().process(tx.reference_id)
        own = enrolled_face_id(tx.reference_id)
        assert [record.face_id for record in world.record_store.for_reference(TENANT, "customer-1")] == [own]
        assert world.gallery.face_ids(TENANT) == {own}
        assert set(world.blobs.items) == {tx.image_key}
        assert old.proof_key not in world.blobs.items
        assert world.transactions.peek(tx.reference_id).state is TransactionState.COMPLETED

    asyncio.run(scenario())


def test_the_same_transaction_processed_twice_at_once_enrols_one_face() -> None:
    """A slow worker and the one that reclaimed its entry may both run a transaction."""

    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        await asyncio.gather(
            world.processor().process(tx.reference_id), world.processor().process(tx.reference_id)
        )
        own = enrolled_face_id(tx.reference_id)
        assert world.gallery.face_ids(TENANT) == {own}
        assert [record.face_id for record in world.record_store.records(TENANT)] == [own]
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.COMPLETED
        assert isinstance(final.result, FaceSearchOutcome) and final.result.matches == ()

    asyncio.run(scenario())


def test_backend_outage_during_search_leaves_the_transaction_retryable() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED)
        world.faults.arm("gallery.search")
        with pytest.raises(BackendUnavailable):
            await world.processor().process(tx.reference_id)
        assert not world.transactions.peek(tx.reference_id).state.is_final
        assert world.gallery.face_ids() == set()
        assert tx.image_key in world.blobs.items

        await world.processor().process(tx.reference_id)
        assert world.transactions.peek(tx.reference_id).state is TransactionState.COMPLETED
        assert world.gallery.face_ids() == {enrolled_face_id(tx.reference_id)}

    asyncio.run(scenario())


def test_allow_override_replaces_the_latest_face_of_the_reference() -> None:
    async def scenario() -> None:
        world = World()
        older = await world.enrol(TENANT, "older", embedding(5), "customer-1", created_at=1000.0)
        latest = await world.enrol(TENANT, "latest", embedding(6), "customer-1", created_at=2000.0)
        unrelated = await world.enrol(TENANT, "unrelated", embedding(7), "customer-9", created_at=3000.0)
        foreign = await world.enrol(OTHER_TENANT, "foreign", embedding(8), "customer-1", created_at=4000.0)
        world.analysis.faces_by_color[RED] = [face(embedding(1))]

        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        await world.processor().process(tx.reference_id)

        own = enrolled_face_id(tx.reference_id)
        assert {record.face_id for record in world.record_store.for_reference(TENANT, "customer-1")} == {
            "older",
            own,
        }
        assert world.gallery.face_ids(TENANT) == {"older", "unrelated", own}
        assert world.gallery.face_ids(OTHER_TENANT) == {"foreign"}
        assert await world.record_store.get(TENANT, "latest") is None
        assert latest.proof_key not in world.blobs.items
        for kept in (older, unrelated, foreign):
            assert kept.proof_key in world.blobs.items
        assert tx.image_key in world.blobs.items
        assert world.record_store.lock_acquisitions == [(TENANT, "customer-1")]

    asyncio.run(scenario())


def test_enrolment_without_override_keeps_earlier_faces_of_the_reference() -> None:
    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, "earlier", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1")
        await world.processor().process(tx.reference_id)
        assert world.gallery.face_ids(TENANT) == {"earlier", enrolled_face_id(tx.reference_id)}
        # Every enrolment under a reference holds its lock, so an erasure of it cannot interleave.
        assert world.record_store.lock_acquisitions == [(TENANT, "customer-1")]

    asyncio.run(scenario())


async def _race_overrides(world: World, count: int) -> list[Transaction]:
    """`count` override transactions of one reference, processed concurrently from the same point on."""
    await world.enrol(TENANT, "original", embedding(99), "customer-1")
    transactions = []
    for index in range(count):
        color: Color = (10 + index * 20, 100, 100)
        world.analysis.faces_by_color[color] = [face(embedding(index))]
        transactions.append(
            await submit_search(world, color, client_reference="customer-1", allow_override=True)
        )
    world.analysis.gate = asyncio.Event()
    processors = [world.processor() for _ in transactions]
    run = asyncio.gather(
        *(p.process(tx.reference_id) for p, tx in zip(processors, transactions, strict=True))
    )
    started = asyncio.ensure_future(run)
    # Every processor is inside analyze(): release them together (a count, not one event to await).
    while world.analysis.started < count:  # noqa: ASYNC110
        await asyncio.sleep(0.002)
    world.analysis.gate.set()
    await asyncio.wait_for(started, 10)
    return transactions


def test_concurrent_overrides_of_one_reference_leave_exactly_one_face() -> None:
    async def scenario() -> None:
        world = World()
        transactions = await _race_overrides(world, 6)

        survivors = world.record_store.for_reference(TENANT, "customer-1")
        assert len(survivors) == 1
        survivor = survivors[0]
        assert survivor.face_id in {enrolled_face_id(tx.reference_id) for tx in transactions}
        assert world.gallery.face_ids(TENANT) == {survivor.face_id}
        assert set(world.blobs.items) == {survivor.proof_key}
        for tx in transactions:
            assert world.transactions.peek(tx.reference_id).state is TransactionState.COMPLETED
        assert world.record_store.max_lock_holders == 1
        assert len(world.record_store.lock_acquisitions) == 6

    asyncio.run(scenario())


def test_without_the_reference_lock_the_same_race_leaves_several_faces() -> None:
    """Control for the test above: the fakes really interleave, so the lock is what makes it pass."""

    async def scenario() -> None:
        world = World(records=NonExclusiveRecordStore())
        await _race_overrides(world, 6)
        assert len(world.record_store.for_reference(TENANT, "customer-1")) > 1

    asyncio.run(scenario())


def test_override_retried_after_a_crash_before_removal_still_replaces_the_old_face() -> None:
    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        world.faults.arm("gallery.delete")  # new face enrolled, removal of the old one interrupted
        with pytest.raises(BackendUnavailable):
            await world.processor().process(tx.reference_id)
        await world.processor().process(tx.reference_id)
        assert world.transactions.peek(tx.reference_id).state is TransactionState.COMPLETED
        faces = {record.face_id for record in world.record_store.for_reference(TENANT, "customer-1")}
        assert faces == {enrolled_face_id(tx.reference_id)}

    asyncio.run(scenario())


def test_override_interrupted_then_overridden_again_leaves_one_face() -> None:
    """First override crashes before removing the old face; a second override of the same reference runs
    before the retry. The second removes the first's face and finishes its pending removal; the retry of the
    first (now superseded) enrols nothing. Exactly the newest image remains."""

    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        first = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        world.faults.arm("gallery.delete")
        with pytest.raises(BackendUnavailable):
            await world.processor().process(first.reference_id)
        world.analysis.faces_by_color[BLUE] = [face(embedding(9))]
        second = await submit_search(world, BLUE, client_reference="customer-1", allow_override=True)
        await world.processor().process(second.reference_id)
        await world.processor().process(first.reference_id)
        faces = {record.face_id for record in world.record_store.for_reference(TENANT, "customer-1")}
        assert faces == {enrolled_face_id(second.reference_id)}
        assert world.gallery.face_ids() == {enrolled_face_id(second.reference_id)}

    asyncio.run(scenario())


def test_no_face_found_reports_it_deletes_the_upload_and_enrols_nothing() -> None:
    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, "someone", embedding(1))
        tx = await submit_search(world, GREEN, client_reference="customer-1")  # GREEN: no faces scripted
        await world.processor().process(tx.reference_id)
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.COMPLETED
        assert final.result is not None
        assert final.result == FaceSearchOutcome(is_face_found=False, matches=(), enrolled=False)
        assert tx.image_key not in world.blobs.items
        assert world.gallery.face_ids() == {"someone"}
        assert world.gallery.searches == []

    asyncio.run(scenario())


def test_the_largest_face_is_the_probe() -> None:
    async def scenario() -> None:
        world = World()
        small, large = embedding(1), embedding(2)
        world.analysis.faces_by_color[RED] = [
            face(small, size=40),
            face(large, size=120),
            face(None, size=10),
        ]
        tx = await submit_search(world, RED)
        await world.processor().process(tx.reference_id)
        entry = world.gallery.entry(TENANT, enrolled_face_id(tx.reference_id))
        assert entry.embedding.tolist() == large.tolist()

    asyncio.run(scenario())


def test_enroll_face_false_never_writes_to_the_gallery() -> None:
    async def scenario() -> None:
        world = World()
        probe = embedding(1)
        await world.enrol(TENANT, "known", at_cosine(probe, 0.95), "customer-7")
        adds_before = world.faults.calls.get("gallery.add", 0)
        puts_before = world.faults.calls.get("records.put", 0)
        world.analysis.faces_by_color[RED] = [face(probe, age=30)]

        search = await submit_search(world, RED, client_reference="customer-1", enroll_face=False)
        age = await submit_age(world, RED, enroll_face=False)
        override = await submit_search(
            world, RED, client_reference="customer-7", allow_override=True, enroll_face=False
        )
        for tx in (search, age, override):
            await world.processor().process(tx.reference_id)
            assert world.transactions.peek(tx.reference_id).state is TransactionState.COMPLETED
            assert tx.image_key not in world.blobs.items

        assert [entry[0] for entry in await matched(world, search)] == ["known"]
        assert world.faults.calls.get("gallery.add", 0) == adds_before
        assert world.faults.calls.get("records.put", 0) == puts_before
        assert world.gallery.face_ids() == {"known"}
        assert world.record_store.lock_acquisitions == []
        # Age estimation without enrolment does not even ask for a descriptor.
        assert world.analysis.calls[1] == (RED, False, True)

    asyncio.run(scenario())


def test_age_estimation_result_has_the_interface_keys_and_enrols_the_face() -> None:
    async def scenario() -> None:
        world = World()
        vector = embedding(3)
        world.analysis.faces_by_color[BLUE] = [face(vector, age=15, quality=face_quality(True))]
        tx = await submit_age(world, BLUE)
        await world.processor().process(tx.reference_id)
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.COMPLETED
        assert final.result is not None
        assert final.result == AgeEstimationOutcome(
            age=15,
            under_18=50,
            under_21=100,
            enrolled=True,
            age_decision=AgeDecisionReport(reason="uncertain_age"),
        )
        assert world.analysis.calls == [(BLUE, True, True)]
        own = enrolled_face_id(tx.reference_id)
        assert world.gallery.entry(TENANT, own).embedding.tolist() == vector.tolist()
        assert tx.image_key in world.blobs.items

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("faces", "flags", "reason"),
    [
        # A cleared adult alone in a good photo: 0, and no age_decision.
        ([face(age=40, quality=face_quality(True))], (0, 0), None),
        # A second face of comparable size that could be a minor: the photo may be about that face.
        (
            [
                face(age=40, quality=face_quality(True)),
                face(age=8, size=60.0, x=200.0, quality=face_quality(True)),
            ],
            (50, 50),
            "another_face",
        ),
        # ... one that is not estimated, or whose own photo quality is too poor to tell, counts as such.
        ([face(age=40, quality=face_quality(True)), face(size=60.0, x=200.0)], (50, 50), "another_face"),
        (
            [
                face(age=40, quality=face_quality(True)),
                face(age=40, size=90.0, x=200.0, quality=face_quality(False)),
            ],
            (50, 50),
            "another_face",
        ),
        # A second clear adult of comparable size does not cost the 0.
        (
            [
                face(age=40, quality=face_quality(True)),
                face(age=35, size=90.0, x=200.0, quality=face_quality(True)),
            ],
            (0, 0),
            None,
        ),
        # Only the flag the other face could break is withheld: a face estimated at 33 is cleared for under_18
        # but not for under_21 (models/age_interval.json at the default rate).
        (
            [
                face(age=40, quality=face_quality(True)),
                face(age=33, size=90.0, x=200.0, quality=face_quality(True)),
            ],
            (0, 50),
            "another_face",
        ),
        # A small background face does not count (under a quarter of the subject's area).
        ([face(age=40, quality=face_quality(True)), face(age=8, size=40.0, x=200.0)], (0, 0), None),
        # The subject's photo is worse than any calibration photo, or its quality was not measured: an
        # unbounded interval, 50, never 0 or 100.
        ([face(age=40, quality=face_quality(False))], (50, 50), "face_quality"),
        ([face(age=40)], (50, 50), "face_quality"),
        (
            [face(age=8, quality=face_quality(False)), face(age=40, size=90.0, x=200.0)],
            (50, 50),
            "face_quality",
        ),
        # A child subject in a good photo stays 100 whatever the other faces are.
        ([face(age=8, quality=face_quality(True)), face(age=40, size=90.0, x=200.0)], (100, 100), None),
        # The interval straddles both limits: 50 because of the estimate itself.
        ([face(age=18, quality=face_quality(True))], (50, 50), "uncertain_age"),
        ([face(age=15, quality=face_quality(True))], (50, 100), "uncertain_age"),
    ],
)
def test_age_flags_follow_the_safety_rules(
    faces: list[Any], flags: tuple[int, int], reason: str | None
) -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[BLUE] = faces
        tx = await submit_age(world, BLUE, enroll_face=False)
        await world.processor().process(tx.reference_id)
        final = world.transactions.peek(tx.reference_id)
        assert final.result is not None
        result = final.result
        assert isinstance(result, AgeEstimationOutcome)
        assert (result.under_18, result.under_21) == flags
        assert result.age == faces[0].age.age  # the largest face is the subject
        # The reason is there exactly when a flag is 50.
        assert (result.age_decision.reason if result.age_decision is not None else None) == reason
        if reason == "face_quality" and faces[0].quality is not None:
            assert result.age_decision is not None and result.age_decision.quality is not None
            assert result.age_decision.quality.reasons == ("blurry",)
            assert result.age_decision.quality.sharpness == 5.0

    asyncio.run(scenario())


def test_age_estimation_asks_for_descriptors_only_when_it_enrols() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[BLUE] = [face(embedding(4), age=30, quality=face_quality(True))]
        for enroll in (False, True):
            tx = await submit_age(world, BLUE, enroll_face=enroll)
            await world.processor().process(tx.reference_id)
        # (colour, embed, estimate_age) per analysis call: no descriptor without enrolment.
        assert world.analysis.calls == [(BLUE, False, True), (BLUE, True, True)]

    asyncio.run(scenario())


def test_age_estimation_without_a_face_returns_nulls_and_deletes_the_upload() -> None:
    async def scenario() -> None:
        world = World()
        tx = await submit_age(world, GREEN)
        await world.processor().process(tx.reference_id)
        final = world.transactions.peek(tx.reference_id)
        assert final.result is not None
        assert final.result == AgeEstimationOutcome(age=None, under_18=None, under_21=None, enrolled=False)
        assert tx.image_key not in world.blobs.items
        assert world.gallery.face_ids() == set()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: None, id="upload missing"),
        pytest.param(lambda data: data[: len(data) // 2], id="upload truncated"),
        pytest.param(lambda data: b"GIF89a" + data[6:], id="upload replaced by another format"),
    ],
)
def test_an_unusable_stored_image_fails_the_transaction_without_analysis(
    damage: Callable[[bytes], bytes | None],
) -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED)
        data, content_type = world.blobs.items[tx.image_key]
        damaged = damage(data)
        if damaged is None:
            del world.blobs.items[tx.image_key]
        else:
            world.blobs.items[tx.image_key] = (damaged, content_type)
        await world.processor().process(tx.reference_id)
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED
        assert final.error
        assert world.analysis.calls == []
        assert world.gallery.face_ids() == set()
        assert tx.image_key not in world.blobs.items  # nothing will ever use the upload: not kept

    asyncio.run(scenario())


def test_a_final_transaction_is_not_processed_again() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED)
        await world.processor().process(tx.reference_id)
        first = world.transactions.peek(tx.reference_id)
        await world.processor().process(tx.reference_id)
        await world.processor().process("no-such-reference")
        assert world.transactions.peek(tx.reference_id) == first
        assert len(world.analysis.calls) == 1

    asyncio.run(scenario())


def test_match_references_come_from_the_face_records_and_vectors_without_a_record_never_match() -> None:
    async def scenario() -> None:
        world = World()
        reference = "顔認証" * 80 + "😀🧑‍🚀"  # 242 characters, over 700 UTF-8 bytes
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        await world.enrol(TENANT, "kept", at_cosine(embedding(1), 0.95), client_reference=reference)
        debris = await world.enrol(TENANT, "debris", at_cosine(embedding(1), 0.97, seed=1))
        await world.record_store.delete(TENANT, debris.face_id)  # a removal interrupted after the record
        probe = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(probe.reference_id)
        [(face_id, _score, returned)] = [tuple(entry) for entry in await matched(world, probe)]
        assert face_id == "kept"
        assert isinstance(returned, str) and returned.encode() == reference.encode()

    asyncio.run(scenario())


def test_default_minimum_score_follows_the_tenants_gallery_size() -> None:
    async def scenario() -> None:
        world = World(policy=dataclasses.replace(TEST_POLICY, min_score=None))
        calibration = TEST_POLICY.calibration
        probe = embedding(1)
        world.analysis.faces_by_color[RED] = [face(probe)]
        # Score 0.45 (FMR 3e-5): enough against 100 faces (bar 0.4), not against 1,000 (bar 0.5).
        await world.enrol(TENANT, "mate", at_cosine(probe, calibration.cosine_for_score(0.45)), "ref")
        for index in range(99):
            await world.enrol(TENANT, f"filler-{index}", embedding(100 + index))
        tx = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(tx.reference_id)
        assert [entry[0] for entry in await matched(world, tx)] == ["mate"]
        assert world.gallery.searches[-1][2] == pytest.approx(calibration.cosine_for_score(0.4), abs=1e-4)

        for index in range(99, 999):
            await world.enrol(TENANT, f"filler-{index}", embedding(100 + index))
        tx = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(tx.reference_id)
        assert await matched(world, tx) == []
        assert world.gallery.searches[-1][2] == pytest.approx(calibration.cosine_for_score(0.5), abs=1e-4)

    asyncio.run(scenario())


def test_a_tenants_own_minimum_score_and_match_count_come_first() -> None:
    async def scenario() -> None:
        world = World()  # service-wide minimum score 0.5
        calibration = TEST_POLICY.calibration
        tenant, _ = await world.clients.create("tenant")
        probe = embedding(1)
        world.analysis.faces_by_color[RED] = [face(probe)]
        for index, score in enumerate((0.3, 0.35, 0.9, 0.95)):
            vector = at_cosine(probe, calibration.cosine_for_score(score), index)
            await world.enrol(tenant.client_id, f"face-{round(score * 100)}", vector)

        async def search() -> list[object]:
            tx = await submit_search(world, RED, tenant_id=tenant.client_id, enroll_face=False)
            await world.processor().process(tx.reference_id)
            return [entry[0] for entry in await matched(world, tx)]

        assert await search() == ["face-95", "face-90"]
        await world.clients.update_search_settings(tenant.client_id, min_score=0.25, max_matches=3)
        assert await search() == ["face-95", "face-90", "face-35"]
        await world.clients.update_search_settings(tenant.client_id, min_score=None, max_matches=None)
        assert await search() == ["face-95", "face-90"]

    asyncio.run(scenario())


def test_a_face_below_the_enrolment_bar_is_searched_but_not_enrolled() -> None:
    async def scenario() -> None:
        world = World()
        probe = embedding(1)
        await world.enrol(TENANT, "known", at_cosine(probe, 0.95), "customer-7")
        blurry = quality(enrol_ok=False, search_ok=True, reasons=("blurry",))
        world.analysis.faces_by_color[RED] = [face(probe, quality=blurry)]
        tx = await submit_search(world, RED, client_reference="customer-1")
        await world.processor().process(tx.reference_id)
        final = world.transactions.peek(tx.reference_id)
        assert final.result is not None
        result = final.result
        assert isinstance(result, FaceSearchOutcome) and not result.enrolled
        assert [entry[0] for entry in triples(result)] == ["known"]
        assert result.probe_quality is None  # it meets the search bar
        [unindexed] = result.unindexed_faces
        assert isinstance(unindexed, QualityReport) and unindexed.reasons == ("blurry",)
        assert world.gallery.face_ids(TENANT) == {"known"}
        assert await world.record_store.get(TENANT, enrolled_face_id(tx.reference_id)) is None
        assert tx.image_key not in world.blobs.items  # not enrolled: the upload is not kept

        # Age estimation that asks to enrol is gated the same way.
        world.analysis.faces_by_color[GREEN] = [face(embedding(2), age=30, quality=blurry)]
        age = await submit_age(world, GREEN)
        await world.processor().process(age.reference_id)
        age_result = world.transactions.peek(age.reference_id).result
        assert isinstance(age_result, AgeEstimationOutcome) and age_result.age == 30
        assert age_result.unindexed_faces[0].reasons == ("blurry",) and not age_result.enrolled
        assert world.gallery.face_ids(TENANT) == {"known"}

    asyncio.run(scenario())


def test_a_probe_below_the_search_bar_cannot_produce_certainty() -> None:
    async def scenario() -> None:
        world = World(policy=dataclasses.replace(TEST_POLICY, min_score=None))
        calibration = TEST_POLICY.calibration
        probe = embedding(1)
        for index, score in enumerate((0.99, 0.35)):
            await world.enrol(
                TENANT,
                f"face-{round(score * 100)}",
                at_cosine(probe, calibration.cosine_for_score(score), index),
            )
        poor = quality(enrol_ok=False, search_ok=False, reasons=("small_face", "blurry"))
        world.analysis.faces_by_color[RED] = [face(probe)]
        world.analysis.faces_by_color[BLUE] = [face(probe, quality=poor)]

        good = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(good.reference_id)
        # Two faces: bar 0.23 (FPIR 1 %); both match, the best with its full score.
        assert [(entry[0], entry[1]) for entry in await matched(world, good)] == [
            ("face-99", pytest.approx(0.99, abs=1e-3)),
            ("face-35", pytest.approx(0.35, abs=1e-3)),
        ]

        weak = await submit_search(world, BLUE, enroll_face=False)
        await world.processor().process(weak.reference_id)
        result = world.transactions.peek(weak.reference_id).result
        assert isinstance(result, FaceSearchOutcome)
        # A ten times stricter FPIR (bar 0.33 for two faces) and every score capped at 0.5.
        assert [(entry[0], entry[1]) for entry in triples(result)] == [
            ("face-99", pytest.approx(TEST_POLICY.low_quality_score_cap)),
            ("face-35", pytest.approx(0.35, abs=1e-3)),
        ]
        assert result.probe_quality is not None
        assert result.probe_quality.reasons == ("small_face", "blurry")
        assert world.gallery.searches[-1][2] == pytest.approx(
            calibration.cosine_for_score(calibration.min_score_for_gallery(2, TEST_POLICY.low_quality_fpir))
        )

    asyncio.run(scenario())


def test_face_search_never_asks_for_an_age_and_age_estimation_embeds_only_to_enrol() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1), age=30)]
        for tx in (
            await submit_search(world, RED, enroll_face=True),
            await submit_search(world, RED, enroll_face=False),
            await submit_age(world, RED, enroll_face=False),
            await submit_age(world, RED, enroll_face=True),
        ):
            await world.processor().process(tx.reference_id)
        assert world.analysis.calls == [
            (RED, True, False),
            (RED, True, False),
            (RED, False, True),
            (RED, True, True),
        ]

    asyncio.run(scenario())


# -- a failed transaction leaves nothing enrolled -------------------------------------------------------

GIVE_UP = "The transaction could not be processed."


def own_face_gone(world: World, tx: Transaction) -> bool:
    own = enrolled_face_id(tx.reference_id)
    return (
        own not in world.gallery.face_ids()
        and own not in {record.face_id for record in world.record_store.records()}
        and tx.image_key not in world.blobs.items
    )


async def crash_after_enrolment(world: World, tx: Transaction) -> None:
    """An attempt that enrols and dies before completing (the worker was killed in between)."""
    world.faults.arm("transactions.complete")
    with pytest.raises(BackendUnavailable):
        await world.processor().process(tx.reference_id)
    assert enrolled_face_id(tx.reference_id) in world.gallery.face_ids(TENANT)


def test_a_transaction_given_up_after_its_face_was_enrolled_leaves_nothing_and_a_retry_enrols_once() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED)
        await crash_after_enrolment(world, tx)

        await world.processor().give_up(tx.reference_id, GIVE_UP)

        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED and final.error == GIVE_UP
        assert own_face_gone(world, tx)
        assert world.gallery.face_ids() == set() and world.record_store.records() == []
        # The client reads `failed` and submits again: the person is enrolled once, and matches nobody.
        retry = await submit_search(world, RED)
        await world.processor().process(retry.reference_id)
        assert await matched(world, retry) == []
        assert world.gallery.face_ids() == {enrolled_face_id(retry.reference_id)}

    asyncio.run(scenario())


def test_a_give_up_interrupted_half_way_is_finished_by_the_next_delivery() -> None:
    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1")
        await crash_after_enrolment(world, tx)
        world.faults.arm("records.delete")  # failed, vector removed, then the worker dies
        with pytest.raises(BackendUnavailable):
            await world.processor().give_up(tx.reference_id, GIVE_UP)
        assert world.transactions.peek(tx.reference_id).state is TransactionState.FAILED
        assert world.gallery.face_ids() == set()  # never searchable once failed

        await world.processor().give_up(tx.reference_id, GIVE_UP)
        assert own_face_gone(world, tx)
        assert world.record_store.for_reference(TENANT, "customer-1") == []

    asyncio.run(scenario())


def test_a_given_up_override_that_had_not_yet_removed_the_earlier_face_leaves_it_in_place() -> None:
    async def scenario() -> None:
        world = World()
        old = await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        world.faults.arm("gallery.delete")  # new face enrolled; the worker dies before removing the old
        with pytest.raises(BackendUnavailable):
            await world.processor().process(tx.reference_id)

        await world.processor().give_up(tx.reference_id, GIVE_UP)

        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED and final.error == GIVE_UP
        assert own_face_gone(world, tx)
        # As if the override never ran: the reference keeps its earlier face, proof image included.
        assert world.record_store.for_reference(TENANT, "customer-1") == [old]
        assert world.gallery.face_ids() == {"old"}
        assert old.proof_key in world.blobs.items

    asyncio.run(scenario())


def test_a_given_up_override_that_had_removed_the_earlier_face_says_so_and_a_retry_enrols_it() -> None:
    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        await crash_after_enrolment(world, tx)  # the override replaced "old", then its worker died
        assert world.gallery.face_ids() == {enrolled_face_id(tx.reference_id)}

        await world.processor().give_up(tx.reference_id, GIVE_UP)

        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED
        assert final.error is not None and final.error.startswith(GIVE_UP)
        assert "no longer stored" in final.error and "submit the image again" in final.error
        assert own_face_gone(world, tx)
        assert world.record_store.for_reference(TENANT, "customer-1") == []
        assert world.gallery.face_ids() == set()

        retry = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        await world.processor().process(retry.reference_id)
        faces = [record.face_id for record in world.record_store.for_reference(TENANT, "customer-1")]
        assert faces == [enrolled_face_id(retry.reference_id)]

    asyncio.run(scenario())


@pytest.mark.parametrize("client_reference", [None, "customer-1"])
def test_an_attempt_that_outlives_its_give_up_takes_back_its_face(client_reference: str | None) -> None:
    """A worker stalls past its lease mid-analysis; another worker gives the transaction up meanwhile;
    the stalled attempt then enrols, and its complete() changes nothing. The face must not stay."""

    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference=client_reference)
        world.analysis.gate = asyncio.Event()
        stalled = asyncio.create_task(world.processor().process(tx.reference_id))
        await wait_until(lambda: world.analysis.started == 1, what="the attempt analysing")
        await world.processor().give_up(tx.reference_id, GIVE_UP)
        world.analysis.gate.set()
        await stalled

        assert world.transactions.peek(tx.reference_id).state is TransactionState.FAILED
        assert own_face_gone(world, tx)
        assert world.gallery.face_ids() == set() and world.record_store.records() == []

    asyncio.run(scenario())


class PausingGallery(FakeGalleryStore):
    """Holds every add() until `release` is set: the point between an enrolment's record and its vector."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        self.waiting.set()
        await self.release.wait()
        await super().add(entries)


def test_a_give_up_between_an_attempts_record_and_vector_leaves_neither() -> None:
    async def scenario() -> None:
        world = World()
        gallery = PausingGallery()
        world.gallery = gallery
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED)
        stalled = asyncio.create_task(world.processor().process(tx.reference_id))
        await gallery.waiting.wait()  # its record is written, its vector not yet
        await world.processor().give_up(tx.reference_id, GIVE_UP)
        gallery.release.set()
        await stalled

        assert world.transactions.peek(tx.reference_id).state is TransactionState.FAILED
        assert own_face_gone(world, tx)
        assert world.gallery.face_ids() == set() and world.record_store.records() == []

    asyncio.run(scenario())


def test_a_late_override_attempt_after_its_give_up_replaces_nothing() -> None:
    async def scenario() -> None:
        world = World()
        old = await world.enrol(TENANT, "old", embedding(5), "customer-1")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED, client_reference="customer-1", allow_override=True)
        world.analysis.gate = asyncio.Event()
        stalled = asyncio.create_task(world.processor().process(tx.reference_id))
        await wait_until(lambda: world.analysis.started == 1, what="the attempt analysing")
        await world.processor().give_up(tx.reference_id, GIVE_UP)
        world.analysis.gate.set()
        await stalled

        assert world.transactions.peek(tx.reference_id).error == GIVE_UP
        assert own_face_gone(world, tx)
        assert world.record_store.for_reference(TENANT, "customer-1") == [old]
        assert world.gallery.face_ids() == {"old"} and old.proof_key in world.blobs.items

    asyncio.run(scenario())


def test_an_image_unusable_on_a_retry_after_a_partial_enrolment_fails_and_leaves_nothing() -> None:
    """The stored bytes do not change, but the decode limits can between two attempts (a redeploy that
    lowers max_image_pixels): the retry finds the upload unusable although an earlier attempt enrolled it."""

    async def scenario() -> None:
        world = World()
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        tx = await submit_search(world, RED)
        await crash_after_enrolment(world, tx)
        world.policy = dataclasses.replace(TEST_POLICY, max_image_pixels=100)  # 16x16 uploads: 256 pixels

        await world.processor().process(tx.reference_id)

        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED and final.error
        assert own_face_gone(world, tx)
        assert world.gallery.face_ids() == set() and world.record_store.records() == []

    asyncio.run(scenario())
