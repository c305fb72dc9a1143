"""The index-switch job's logic (serve_app/pipelines/index_switch.py) over a gallery that keeps its
collections in memory: where a pass goes on from the state a dead holder left, when it gives a switch up,
and that its lease is kept alive through a long step and lost when another holder takes it. The steps
themselves, on a real Milvus server: tests/integration/test_gallery_scale.py."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import pytest

from serve_app.pipelines.index_switch import IndexSwitch, SwitchPolicy, SwitchReport, SwitchTimedOut
from serve_app.stores.interfaces import CopiedPage, IndexSwitchPlan, SwitchStage

PLAN = IndexSwitchPlan(
    served="faces_v1", target="faces_v1__g1", retired="faces_v1__g0", index_type="IVF_FLAT", rows=5
)


class MemoryLease:
    """interfaces.JobLease in memory, expiring on the monotonic clock."""

    def __init__(self) -> None:
        self.holder: tuple[str, float] | None = None
        self.fields: dict[str, str] = {}
        self.renewals = 0

    def _live(self) -> str | None:
        if self.holder is None or self.holder[1] <= time.monotonic():
            return None
        return self.holder[0]

    async def acquire(self, holder: str, ttl_s: float) -> bool:
        if self._live() not in (None, holder):
            return False
        self.holder = (holder, time.monotonic() + ttl_s)
        return True

    async def renew(self, holder: str, ttl_s: float) -> bool:
        if self._live() != holder:
            return False
        self.renewals += 1
        self.holder = (holder, time.monotonic() + ttl_s)
        return True

    async def release(self, holder: str) -> None:
        if self._live() == holder:
            self.holder = None

    async def read(self, field: str) -> str | None:
        return self.fields.get(field)

    async def write(self, holder: str, values: dict[str, str | None]) -> bool:
        if self._live() != holder:
            return False
        for name, value in values.items():
            if value is None:
                self.fields.pop(name, None)
            else:
                self.fields[name] = value
        return True


@dataclass
class MemoryGallery:
    """interfaces.GalleryIndexSwitch over collections in memory: name -> face ids."""

    collections: dict[str, list[str]] = field(default_factory=dict)
    served: str = "faces_v1"
    plan: IndexSwitchPlan | None = PLAN
    calls: list[tuple[str, object]] = field(default_factory=list)
    slow_build_s: float = 0.0  # index_built answers only after this long (a long step)
    sealed: asyncio.Event = field(default_factory=asyncio.Event)

    switch_name = "faces_v1"
    write_window_s = 0.0

    async def plan_switch(self) -> IndexSwitchPlan | None:
        self.calls.append(("plan", None))
        return self.plan

    async def switch_stage(self, target: str) -> SwitchStage:
        if self.served == target:
            return "served"
        return "beside" if target in self.collections else "absent"

    async def begin_switch(self, plan: IndexSwitchPlan) -> None:
        self.calls.append(("begin", plan.target))
        self.collections[plan.target] = []

    async def copy_page(self, target: str, after: str | None, limit: int) -> CopiedPage:
        self.calls.append(("copy", after))
        rows = sorted(face for face in self.collections[self.served] if after is None or face > after)[:limit]
        missing = [face for face in rows if face not in self.collections[target]]
        self.collections[target] += missing
        return CopiedPage(len(rows), len(missing), rows[-1] if len(rows) == limit else None)

    async def seal(self, target: str) -> None:
        self.calls.append(("seal", target))
        self.sealed.set()

    async def index_built(self, target: str) -> bool:
        await asyncio.sleep(self.slow_build_s)
        return True

    async def promote(self, plan: IndexSwitchPlan) -> None:
        self.calls.append(("promote", plan.target))
        self.collections[plan.retired] = self.collections.pop(plan.served)
        self.served = plan.target

    async def drop(self, name: str) -> None:
        self.calls.append(("drop", name))
        self.collections.pop(name, None)


def state(step: str, after: str | None = None) -> str:
    """The job's state field as a holder writes it."""
    return json.dumps({"plan": asdict(PLAN), "step": step, "after": after})


def job(
    gallery: MemoryGallery, lease: MemoryLease, lease_s: float = 30.0, timeout_s: float = 60.0
) -> IndexSwitch:
    policy = SwitchPolicy(lease_s=lease_s, timeout_s=timeout_s, every_s=0, page_rows=2, poll_s=0.01)
    return IndexSwitch(gallery, lease, policy)


def faces() -> MemoryGallery:
    return MemoryGallery({"faces_v1": [f"f{n}" for n in range(5)]})


def test_a_switch_runs_its_steps_in_order_and_copies_every_row() -> None:
    gallery, lease = faces(), MemoryLease()
    report = asyncio.run(job(gallery, lease).run_once("replica-a"))
    assert report == SwitchReport(True, "IVF_FLAT", PLAN.target, copied=5, resumed=False)
    steps = [name for name, _ in gallery.calls]
    assert steps == ["plan", "begin", "copy", "copy", "copy", "seal", "promote", "drop"]
    assert gallery.served == PLAN.target and sorted(gallery.collections) == [PLAN.target]
    assert "state" not in lease.fields and lease.holder is None  # done, and given back


def test_a_holder_that_died_mid_copy_is_resumed_from_its_cursor() -> None:
    gallery, lease = faces(), MemoryLease()
    gallery.collections[PLAN.target] = ["f0", "f1"]  # its first page
    lease.fields["state"] = state("copy", after="f1")
    report = asyncio.run(job(gallery, lease).run_once("replica-b"))
    assert report is not None and report.switched and report.resumed and report.copied == 3
    assert gallery.calls[0] == ("copy", "f1")  # no new plan, no new collection
    assert sorted(gallery.collections[PLAN.target]) == [f"f{n}" for n in range(5)]


def test_a_holder_that_died_after_naming_the_target_only_retires_the_old_collection() -> None:
    gallery, lease = faces(), MemoryLease()
    gallery.collections[PLAN.target] = [f"f{n}" for n in range(5)]
    asyncio.run(gallery.promote(PLAN))  # it moved the served name, then died before it wrote so
    gallery.calls.clear()
    lease.fields["state"] = state("build")
    report = asyncio.run(job(gallery, lease).run_once("replica-b"))
    assert report is not None and report.switched and report.resumed and report.copied == 0
    assert gallery.calls == [("drop", PLAN.retired)]
    assert gallery.served == PLAN.target and PLAN.retired not in gallery.collections


def test_a_switch_whose_target_was_dropped_starts_over() -> None:
    gallery, lease = faces(), MemoryLease()
    lease.fields["state"] = state("copy", after="f3")  # its collection is gone
    report = asyncio.run(job(gallery, lease).run_once("replica-b"))
    assert report is not None and report.switched and not report.resumed and report.copied == 5
    assert gallery.calls[:3] == [("plan", None), ("begin", PLAN.target), ("copy", None)]


def test_a_switch_past_its_deadline_drops_what_it_built_and_clears_its_state() -> None:
    gallery, lease = faces(), MemoryLease()
    with pytest.raises(SwitchTimedOut):
        asyncio.run(job(gallery, lease, timeout_s=-1.0).run_once("replica-a"))
    assert ("drop", PLAN.target) in gallery.calls and PLAN.target not in gallery.collections
    assert gallery.served == "faces_v1" and "state" not in lease.fields


def test_nothing_due_is_a_report_that_did_not_switch() -> None:
    gallery, lease = faces(), MemoryLease()
    gallery.plan = None
    assert asyncio.run(job(gallery, lease).run_once("replica-a")) == SwitchReport(False)
    assert [name for name, _ in gallery.calls] == ["plan"]


def test_the_lease_is_kept_alive_through_a_long_step_and_a_taken_lease_stops_the_pass() -> None:
    """A build that takes several lease lengths keeps its lease (renewed in the background); when another
    holder has it meanwhile (this one was paused past it), the pass stops inside that step."""

    async def scenario() -> None:
        gallery, lease = faces(), MemoryLease()
        gallery.slow_build_s = 0.6  # four lease lengths
        report = await job(gallery, lease, lease_s=0.15).run_once("replica-a")
        assert report is not None and report.switched
        assert lease.renewals >= 3  # the page checkpoints and, through the build, the beats

        gallery, lease = faces(), MemoryLease()
        gallery.slow_build_s = 0.6
        running = asyncio.create_task(job(gallery, lease, lease_s=0.15).run_once("replica-a"))
        await gallery.sealed.wait()
        lease.holder = ("replica-b", time.monotonic() + 60)  # taken while replica-a builds
        assert await running is None  # lost: it stopped in the build
        assert ("promote", PLAN.target) not in gallery.calls and gallery.served == "faces_v1"
        assert json.loads(lease.fields["state"])["step"] == "build"  # for replica-b to go on from

    asyncio.run(scenario())
