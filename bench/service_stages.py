"""Where the ingress's and the worker's CPU goes, step by step: CPU milliseconds per transaction of each
blocking step (decoding, the model runs, Milvus, file I/O), of each process's event loop, and of what runs
outside Python threads, for one kind of call under load.

    python -m bench.service_stages [--call "face-search (create+long poll)"] [--requests 384]
                                   [--concurrency 8] [--topology in_process]

Starts the service as bench.service does (127.0.0.1, embedded Redis and milvus-lite, a temporary data dir)
with bench/stage_probe first on PYTHONPATH: its sitecustomize, loaded by every process of the service, times
each call handed to asyncio.to_thread with thread CPU and reads each thread's CPU from /proc (see that
file). After a warm-up, one bounded phase of --requests calls runs at --concurrency clients, and the table
gives, per process, each step's calls and CPU per transaction, then the threads: the event loop's (the
requests' Python: HTTP, FastAPI, Redis, the pipelines), the executor's (the steps above, plus the hand-off),
other Python threads, and the rest of the process (Ray's core worker, gRPC), whose sum is the process's CPU
as /proc counts it. bench.service_cpu gives the same totals for every process, Redis and Milvus included.
Linux only (/proc).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import format_table
from bench.service import (
    ServiceCalls,
    add_service_arguments,
    benchmarked_service,
    client_pool,
    ingress_label,
    run_phase,
)
from bench.service_profile import role_pids
from tests.faces_dev import load_faces_dev

PROBE_DIR = Path(__file__).resolve().parent / "stage_probe"
PROBED_ROLES = ("ApiIngress", "TransactionWorker", "FaceDetectorModel", "FaceEmbedderModel", "AgeModel")


@dataclass(frozen=True)
class Snapshot:
    process_cpu_s: float
    threads_cpu_s: dict[str, float]
    steps: dict[str, tuple[float, float]]  # name -> (calls, thread CPU seconds)


def read_snapshots(probe_out: Path, not_before: float) -> dict[str, Snapshot]:
    """The probed processes' snapshots by role, each the first written after not_before (the probe writes
    every 0.5 s, so a snapshot taken right after a phase includes at most that much idle time)."""
    snapshots: dict[str, Snapshot] = {}
    deadline = time.monotonic() + 10
    for role, pid in role_pids(PROBED_ROLES).items():
        path = probe_out / f"{pid}.json"
        while True:
            data = json.loads(path.read_text()) if path.exists() else None
            if data is not None and data["written_at"] >= not_before:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stage probe of {role} (pid {pid}) wrote nothing; was it loaded?")
            time.sleep(0.1)
        snapshots[role] = Snapshot(
            data["process_cpu_s"],
            data["threads_cpu_s"],
            {name: (calls, cpu) for name, (calls, cpu) in data["steps"].items()},
        )
    return snapshots


def rows_for(role: str, before: Snapshot, after: Snapshot, transactions: int) -> list[list[str]]:
    def per_tx(seconds: float) -> str:
        return f"{seconds * 1000 / transactions:.2f}"

    rows: list[list[str]] = []
    steps = {
        name: (calls - before.steps.get(name, (0.0, 0.0))[0], cpu - before.steps.get(name, (0.0, 0.0))[1])
        for name, (calls, cpu) in after.steps.items()
    }
    for name, (calls, cpu) in sorted(steps.items(), key=lambda item: -item[1][1]):
        if calls:
            rows.append([role, f"step {name}", f"{calls / transactions:.2f}", per_tx(cpu)])
    threads = {name: cpu - before.threads_cpu_s.get(name, 0.0) for name, cpu in after.threads_cpu_s.items()}
    for name, cpu in sorted(threads.items(), key=lambda item: -item[1]):
        if cpu > 0:
            rows.append([role, f"thread {name}", "", per_tx(cpu)])
    process = after.process_cpu_s - before.process_cpu_s
    rows.append(
        [role, "outside Python threads (Ray core, gRPC, ...)", "", per_tx(process - sum(threads.values()))]
    )
    rows.append([role, "process total", "", per_tx(process)])
    return rows


async def measure(
    base_url: str, token: str, probe_out: Path, args: argparse.Namespace
) -> tuple[dict[str, Snapshot], dict[str, Snapshot], int, float]:
    dev = load_faces_dev()
    faces = [image.path for image in dev.of_kind("identity")]
    ages = [image.path for image in dev.of_kind("age")]
    async with client_pool(base_url, token, args.client) as client:
        calls = ServiceCalls(client, faces, ages, args.phase_timeout)
        call, _ = calls.by_name()[args.call]
        await run_phase(call, 16, 4, args.phase_timeout)  # warm-up
        before = await asyncio.to_thread(read_snapshots, probe_out, time.time())
        elapsed, latencies, failures = await run_phase(
            call, args.requests, args.concurrency, args.phase_timeout
        )
        after = await asyncio.to_thread(read_snapshots, probe_out, time.time())
    if failures:
        raise RuntimeError(f"{args.call}: {failures} calls failed")
    return before, after, len(latencies), len(latencies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default="in_process", choices=("in_process", "split"))
    parser.add_argument("--call", default="face-search (create+long poll)")
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    add_service_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="facesearch-stages-") as probe_out:
        # Before Ray starts: its daemons, and through them every worker process, inherit the environment.
        os.environ["FACESEARCH_STAGE_PROBE_DIR"] = probe_out
        os.environ["PYTHONPATH"] = os.pathsep.join(
            path for path in (str(PROBE_DIR), os.environ.get("PYTHONPATH")) if path
        )
        with (
            tempfile.TemporaryDirectory(prefix="facesearch-bench-") as data_dir,
            benchmarked_service(Path(data_dir), args.topology, args.threads, args.ingress) as service,
        ):
            token = service.token_for(service.new_client("bench"))
            before, after, transactions, rate = asyncio.run(
                measure(service.base_url, token, Path(probe_out), args)
            )
    rows = [
        row
        for role in PROBED_ROLES
        if role in before and role in after
        for row in rows_for(role, before[role], after[role], transactions)
    ]
    print(
        f"topology {ingress_label(args.topology, args.ingress)}, {args.call}, {args.concurrency} concurrent "
        f"clients, {transactions} transactions, {rate:.1f}/s"
    )
    print(format_table(["process", "where", "calls per tx", "CPU ms per tx"], rows))


if __name__ == "__main__":
    main()
