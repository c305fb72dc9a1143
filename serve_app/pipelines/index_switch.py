"""The gallery's switch of index, FLAT to the large index once the collection is past flat_max_rows: a leased
job of the workers (pipelines/jobs.py), run in steps the gallery store gives (interfaces.GalleryIndexSwitch;
how each step keeps searches and writes whole: stores/milvus_gallery.py, "Index by size").

Every worker replica's index-switch loop tries a pass every index_switch_every_s. The replica that takes the
lease (named after the served collection: one switch per collection across the cluster) counts the
collection, at most once per interval across the cluster, and when its size calls for the large index:
1. creates the target beside the served collection (every replica's writes reach both from then on) and
   waits out a write's window;
2. copies the served rows a page at a time, writing its cursor after each page;
3. flushes the target and waits until its index covers the rows;
4. names the target in place of the served collection, waits out a write's window, drops the old one.

The lease is short (index_switch_lease_s, a minute by default) and renewed after every page and, in the
background, through every wait and every step (JobPass.kept_alive), so a holder that dies mid-switch loses
it within its ttl and the next pass, on any replica, goes on from the state the job keeps beside its lease:
the plan, the step and the copy cursor. Each step is safe to run again (a page copied twice keeps the newer
row; promote finishes a rename whose alias is missing). A pass stopped by an outage (BackendUnavailable)
keeps that state for the next one; a pass that ran out of switch_timeout_s or that Milvus refused drops the
target and clears it, and the next pass starts over if the size still calls for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.pipelines.jobs import JobPass, LeasedJob, LeaseLost
from serve_app.stores.interfaces import GalleryIndexSwitch, IndexSwitchPlan, JobLease

logger = logging.getLogger(__name__)

_STATE = "state"  # the job's fields: the switch under way, and when a pass last looked at the size
_LAST_CHECK = "last-check"
_STEPS = ("window", "copy", "build", "retire")  # "window": created, its write window not yet waited out


def lease_name(gallery: GalleryIndexSwitch) -> str:
    """The switch's lease: one per served collection."""
    return f"milvus-index:{gallery.switch_name}"


class SwitchTimedOut(BackendUnavailable):
    """The copy or the build ran past switch_timeout_s: the half-built collection is dropped."""


@dataclass(frozen=True)
class SwitchPolicy:
    lease_s: float = 60.0  # a holder that stops renewing (it died) loses the switch after this
    timeout_s: float = 1800.0  # bound on one pass' copy and build
    every_s: float = 60.0  # how often the size is looked at, across the cluster
    page_rows: int = 10_000  # rows copied per page (Milvus' query limit is 16,384)
    poll_s: float = 1.0  # how often the index build is asked about


@dataclass(frozen=True)
class SwitchReport:
    switched: bool  # False: no switch was due (or the size was looked at less than every_s ago)
    index_type: str = ""
    target: str = ""
    copied: int = 0  # rows this pass copied
    resumed: bool = False  # went on with a switch an earlier holder left unfinished


@dataclass
class _State:
    plan: IndexSwitchPlan
    step: str
    after: str | None = None

    def dump(self) -> str:
        return json.dumps({"plan": asdict(self.plan), "step": self.step, "after": self.after})

    @classmethod
    def load(cls, raw: str | None) -> _State | None:
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            plan = IndexSwitchPlan(**data["plan"])
            step = str(data["step"])
            return cls(plan, step, data.get("after")) if step in _STEPS else None
        except (ValueError, KeyError, TypeError):
            return None  # written by another version: look at the size again


class IndexSwitch:
    """The job; one pass per call of run_once, by whichever replica holds the lease."""

    def __init__(
        self,
        gallery: GalleryIndexSwitch,
        lease: JobLease,
        policy: SwitchPolicy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._gallery = gallery
        self._lease = lease
        self._policy = policy
        self._clock = clock

    async def run_once(self, holder: str) -> SwitchReport | None:
        """None when another replica holds the lease, or when this one lost it during the pass (what the
        pass did is kept for the next holder)."""
        async with LeasedJob(self._lease, holder, self._policy.lease_s).hold() as job:
            if job is None:
                return None
            try:
                async with job.kept_alive():
                    return await self._pass(job)
            except LeaseLost:
                logger.warning("index switch: lost its lease; the next holder goes on from its state")
                return None

    async def _pass(self, job: JobPass) -> SwitchReport:
        state = await self._unfinished(job)
        resumed = state is not None
        if state is None:
            last = await job.read(_LAST_CHECK)
            now = self._clock()
            if last is not None and now - float(last) < self._policy.every_s:
                return SwitchReport(False)
            plan = await self._gallery.plan_switch()
            if plan is None:
                await job.checkpoint({_STATE: None, _LAST_CHECK: repr(now)})
                return SwitchReport(False)
            await self._gallery.begin_switch(plan)
            state = _State(plan, "window")
            await job.checkpoint({_STATE: state.dump(), _LAST_CHECK: repr(now)})
        plan = state.plan
        try:
            copied = await self._build(job, state)
        except (SwitchTimedOut, BackendRejected) as error:
            # Not an outage to wait out: start over at a later pass.
            logger.warning("index switch of %s abandoned: %s", self._gallery.switch_name, error)
            if await self._gallery.switch_stage(plan.target) == "beside":  # never the served one
                await self._gallery.drop(plan.target)
                await job.checkpoint({_STATE: None})
            raise
        window = self._gallery.write_window_s
        await asyncio.sleep(window)  # searches and writes that found the old collection end
        await self._gallery.drop(plan.retired)
        await job.checkpoint({_STATE: None, _LAST_CHECK: repr(self._clock())})
        logger.info(
            "index switch of %s done: %s serves, %s", self._gallery.switch_name, plan.target, plan.index_type
        )
        return SwitchReport(True, plan.index_type, plan.target, copied, resumed)

    async def _unfinished(self, job: JobPass) -> _State | None:
        """The switch an earlier pass left, at the step where the collections stand now; None if none."""
        state = _State.load(await job.read(_STATE))
        if state is None:
            return None
        stage = await self._gallery.switch_stage(state.plan.target)
        if stage == "absent":
            return None  # dropped (abandoned): look at the size again
        if stage == "served":
            state.step = "retire"  # named already; its holder died before it said so
        elif state.step == "retire":
            state.step = "build"  # beside again (never in practice): name it
        logger.info("index switch of %s: going on at %s", self._gallery.switch_name, state.step)
        return state

    async def _build(self, job: JobPass, state: _State) -> int:
        """Steps 1-3 and the naming of step 4, from wherever `state` stands; returns the rows copied."""
        gallery, plan, policy = self._gallery, state.plan, self._policy
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.timeout_s
        copied = 0
        if state.step == "window":
            # Writes of every replica that looked before the target existed end before the copy reads.
            await asyncio.sleep(gallery.write_window_s)
            state.step = "copy"
            await job.checkpoint({_STATE: state.dump()})
        while state.step == "copy":
            if loop.time() > deadline:
                raise SwitchTimedOut(f"copying {plan.served} to {plan.target} ran past its deadline")
            page = await gallery.copy_page(plan.target, state.after, policy.page_rows)
            copied += page.copied
            state.after = page.after
            if page.after is None:
                state.step = "build"
            await job.checkpoint({_STATE: state.dump()})
        if state.step == "build":
            await gallery.seal(plan.target)
            while not await gallery.index_built(plan.target):
                if loop.time() > deadline:
                    raise SwitchTimedOut(f"building the index of {plan.target} ran past its deadline")
                await asyncio.sleep(policy.poll_s)
            await gallery.promote(plan)
            state.step = "retire"
            await job.checkpoint({_STATE: state.dump()})
        return copied
