"""Where a transaction's CPU goes: CPU milliseconds per transaction in each process of the running service.

    python -m bench.service_cpu [--topology split] [--requests 96] [--concurrency 8]

Starts the service as bench.service does (127.0.0.1, embedded Redis and milvus-lite, a temporary data
dir), warms it up, then for each kind of client call (face search with polling and with long polling, age
estimation with polling and with wait_for_result=1) reads every process's CPU time from /proc before and
after a bounded phase of --requests calls, and prints CPU ms per transaction by process: Serve's HTTP proxy,
the ingress, the worker, the model replicas, Redis, Milvus, Ray's own daemons and the benchmark's client.
Below them: the models' own CPU per image (measured in this process first, on the same photos, decoding
excluded) as a share of the total, and the rate against the fair in-process baseline of bench.service.
On a machine where the cores are the limit, their sum is what one transaction costs, and the table says
which hop to make cheaper. Linux only (/proc).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import re
import tempfile
from collections import defaultdict
from pathlib import Path

from bench.common import format_table
from bench.service import (
    InProcessRate,
    ServiceCalls,
    benchmarked_service,
    client_pool,
    in_process_rate,
    run_phase,
)
from tests.faces_dev import load_faces_dev

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_REPLICA = re.compile(r"ray::ServeReplica:[^:]+:(\w+)")


def process_role(pid: int, command_line: str) -> str | None:
    """A short name for a process of the service, or None for a process that is not part of it."""
    if pid == os.getpid():
        return "benchmark client"
    if match := _REPLICA.search(command_line):
        return match.group(1)
    for needle, role in (
        ("ray::ProxyActor", "Serve HTTP proxy"),
        ("ray::ServeController", "Serve controller"),
        ("redis-server", "redis-server"),
        ("milvus", "milvus-lite"),
        ("raylet", "Ray daemons"),
        ("gcs_server", "Ray daemons"),
        ("ray::", "Ray daemons"),
        ("ray/", "Ray daemons"),
    ):
        if needle in command_line:
            return role
    return None


def cpu_seconds_by_role() -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command_line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended between the listing and the read
        role = process_role(int(entry), command_line)
        if role is None:
            continue
        # Fields after the command name: utime and stime are the 12th and 13th (man 5 proc).
        fields = stat.rsplit(")", 1)[1].split()
        totals[role] += (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return totals


async def measure(
    base_url: str, token: str, workloads: dict[str, list[Path]], args: argparse.Namespace
) -> tuple[dict[str, dict[str, float]], dict[str, float], dict[str, str]]:
    """CPU ms per transaction by process role, transactions/s, and the workload of each kind of call."""
    faces, ages = workloads["faces"], workloads["ages"]
    columns: dict[str, dict[str, float]] = {}
    rates: dict[str, float] = {}
    kinds: dict[str, str] = {}
    async with client_pool(base_url, token) as client:
        calls = ServiceCalls(client, faces, ages, args.phase_timeout)
        await run_phase(calls.search, 8, 4, args.phase_timeout)  # warm-up
        for name, (call, workload) in calls.by_name().items():
            kinds[name] = workload
            before = cpu_seconds_by_role()
            elapsed, latencies, failures = await run_phase(
                call, args.requests, args.concurrency, args.phase_timeout
            )
            after = cpu_seconds_by_role()
            if failures:
                raise RuntimeError(f"{name}: {failures} calls failed")
            columns[name] = {
                role: (after[role] - before.get(role, 0.0)) * 1000 / len(latencies) for role in after
            }
            rates[name] = len(latencies) / elapsed
    return columns, rates, kinds


def table(
    columns: dict[str, dict[str, float]],
    rates: dict[str, float],
    kinds: dict[str, str],
    baseline: dict[str, InProcessRate],
) -> tuple[list[str], list[list[str]]]:
    """The per-process table, then the models' share of the total (the models' CPU per image measured in
    process on the same photos, decoding excluded) and the rate against the fair in-process baseline."""
    first = next(iter(columns.values()))
    roles = sorted({role for column in columns.values() for role in column}, key=lambda r: -first.get(r, 0.0))
    header = ["CPU ms per transaction", *columns]
    rows = [[role, *(f"{column.get(role, 0.0):.1f}" for column in columns.values())] for role in roles]
    totals = {name: sum(column.values()) for name, column in columns.items()}
    rows.append(["total", *(f"{totals[name]:.1f}" for name in columns)])
    rows.append(
        ["models alone (in process)", *(f"{baseline[kinds[name]].model_cpu_ms:.1f}" for name in columns)]
    )
    rows.append(
        [
            "models' share of the total",
            *(f"{baseline[kinds[name]].model_cpu_ms / totals[name]:.0%}" for name in columns),
        ]
    )
    rows.append(["transactions/s", *(f"{rates[name]:.1f}" for name in columns)])
    rows.append(
        [
            "vs fair in-process rate",
            *(f"{rates[name] / baseline[kinds[name]].images_per_s:.0%}" for name in columns),
        ]
    )
    return header, rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default="in_process", choices=("in_process", "split"))
    parser.add_argument("--requests", type=int, default=96, help="calls per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    args = parser.parse_args()
    dev = load_faces_dev()
    workloads = {
        "faces": [image.path for image in dev.of_kind("identity")],
        "ages": [image.path for image in dev.of_kind("age")],
    }
    # Measured before the service starts, so nothing else competes for the cores.
    baseline = {
        name: in_process_rate(paths, name, args.threads, rounds=2) for name, paths in workloads.items()
    }
    with (
        tempfile.TemporaryDirectory(prefix="facesearch-bench-") as data_dir,
        benchmarked_service(Path(data_dir), args.topology, args.threads) as service,
    ):
        token = service.token_for(service.new_client("bench"))
        columns, rates, kinds = asyncio.run(measure(service.base_url, token, workloads, args))
    header, rows = table(columns, rates, kinds, baseline)
    print(
        f"topology {args.topology}, {args.concurrency} concurrent clients, {args.requests} calls per column"
    )
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
