"""Service benchmark: one run on the dev photos, printing one table.

Rows: the fair in-process baseline (no Ray, no HTTP: the worker's own decoding of the uploaded bytes, then
the models the transaction needs: detect+embed for a face search on the identity photos ("faces"),
detect+age for an age estimation on the age crops ("ages")) in images/s; then the running service's calls
(bench.load_client.CALL_KINDS, `--calls`): face search in one request (`Prefer: wait=10` on the create,
a long poll only when not final in time), create + long poll of /result, create + polite polling; age
estimation with wait_for_result=1 and create + polling; at each client count, with throughput, its share
of the in-process rate on the same photos, and p50/p95/p99 latency.

    python -m bench.service [--requests 64] [--topology in_process split] [--concurrency 1 8 32]
                            [--calls NAME ...] [--client-processes N] [--cpu] [--baseline-per-phase]

With both topologies (the default) each gets a fresh service in turn, and the one table compares them:
in_process as config/serve.yaml ships it (direct ingress), split through Serve's proxy. The clients are
the SDK (facesearch_client) sending over aiohttp from `--client-processes` worker processes
(bench.load_client.LoadGenerator, pools as large as the client count); the table's last column is the
busiest client process' CPU as a share of one core (near 100 %: the client set the pace, not the service).
On a machine shared with other work, --baseline-per-phase measures the in-process rate again right before
each phase and compares the phase with that ("74% of 20.3"), so a change in the machine's load between the
start and a phase does not land in the share.

With --cpu, each phase also reads the CPU time of every process of this benchmark's own process tree (the
service it started, its Ray node, Redis, Milvus and the client processes; other programs on the machine
are not counted) from /proc before and after, and a table per topology and client count gives the CPU
milliseconds per transaction of each process (Serve's HTTP proxy, the ingress, the worker, the model
replicas, Redis, Milvus, Ray's own daemons, the benchmark's client) for each kind of call, their total,
and the models' own CPU per image (measured in process on the same photos, decoding excluded) as a share
of it. Where the cores are the limit, the total is what one transaction costs, and the table says which
hop to make cheaper. Linux only (/proc).

The service is started on 127.0.0.1 with embedded Redis and milvus-lite in a temporary directory and shut
down at the end. Each phase is bounded by --requests and --phase-timeout.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import contextlib
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import format_table, percentile
from bench.load_client import CALL_KINDS, Credentials, LoadGenerator, default_processes
from tests.faces_dev import load_faces_dev
from tests.service_harness import RunningService, running_service

# What one transaction of each workload asks of the models (the worker's pipeline): a face search
# embeds every face and estimates no age; an age estimation (not enrolling) only estimates ages.
WORKLOAD_NEEDS = {"faces": (True, False), "ages": (False, True)}


@dataclass(frozen=True)
class InProcessRate:
    """The fair in-process baseline on one workload: images/s, and the CPU the models alone spend on an
    image (decoding excluded), which is what a transaction cannot do without."""

    images_per_s: float
    model_cpu_ms: float


class InProcessBaseline:
    """The transaction's own work with no service around it: decode the uploaded bytes exactly as the
    worker does (serve_app.imaging.decode with the service's limits), then run the models the transaction
    needs, in batches of 16 (no run of the CPU worker is larger, so the baseline has every saving that
    batching gives). The models load once; measure() may run again before each phase."""

    def __init__(self, paths: list[Path], workload: str, threads: int) -> None:
        from models.analyzer import ModelConfig, load_face_analyzer
        from serve_app.settings import Settings

        limits = Settings.from_env()
        self._max_pixels, self._max_side = limits.limits.max_image_pixels, limits.models.analysis_max_side
        self._embed, self._estimate_age = WORKLOAD_NEEDS[workload]
        self._analyzer = load_face_analyzer(ModelConfig(intra_op_threads=threads))
        self._uploads = [path.read_bytes() for path in paths]
        self._decoded = [self._decode(data) for data in self._uploads]
        self._analyze(self._decoded[:4])  # warm-up

    def _decode(self, data: bytes) -> Any:
        from serve_app.imaging.decode import decode_image

        return decode_image(data, self._max_pixels, self._max_side).pixels

    def _analyze(self, pixels: list[Any]) -> None:
        self._analyzer.analyze(pixels, embed=self._embed, estimate_age=self._estimate_age)

    def measure(self, rounds: int) -> InProcessRate:
        """Best of `rounds`."""
        best_wall, best_model_cpu = float("inf"), float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            for start in range(0, len(self._uploads), 16):
                self._analyze([self._decode(data) for data in self._uploads[start : start + 16]])
            best_wall = min(best_wall, time.perf_counter() - started)
            cpu_started = time.process_time()
            for start in range(0, len(self._decoded), 16):
                self._analyze(self._decoded[start : start + 16])
            best_model_cpu = min(best_model_cpu, time.process_time() - cpu_started)
        count = len(self._uploads)
        return InProcessRate(count / best_wall, best_model_cpu * 1000 / count)


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_REPLICA = re.compile(r"ray::ServeReplica:[^:]+:(\w+)")
CLIENT_ROLE = "benchmark client"


def process_role(command_line: str) -> str:
    """A short name for a process of the service by its command line."""
    if match := _REPLICA.search(command_line):
        return match.group(1)
    for needle, role in (
        ("ray::ProxyActor", "Serve HTTP proxy"),
        ("ray::ServeController", "Serve controller"),
        ("redis-server", "redis-server"),
        ("milvus", "milvus-lite"),
        ("haproxy", "HAProxy"),
    ):
        if needle in command_line:
            return role
    return "Ray daemons"  # raylet, GCS, dashboard, Ray's idle workers and log monitor


@dataclass(frozen=True)
class ProcessCpu:
    role: str
    started: int  # start time in clock ticks since boot: a pid reused meanwhile is another process
    cpu_s: float  # its own CPU and that of its children it has reaped


def process_tree_cpu(client_pids: Collection[int] = ()) -> dict[int, ProcessCpu]:
    """Every process descending from this one (the service it started, its Ray node, the embedded Redis and
    Milvus, the load generator's workers) by pid, read from /proc. Other programs on the machine, a test
    run's own Ray node say, are not in the tree and not counted."""
    parents: dict[int, int] = {}
    stats: dict[int, tuple[list[str], str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command_line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended between the listing and the read
        # Fields after the command name (man 5 proc): ppid is the 4th, utime..cstime the 14th-17th,
        # starttime the 22nd; here counted from the state, the 3rd.
        fields = stat.rsplit(")", 1)[1].split()
        parents[int(entry)] = int(fields[1])
        stats[int(entry)] = (fields, command_line)
    me = os.getpid()
    tree: dict[int, ProcessCpu] = {}
    for pid, (fields, command_line) in stats.items():
        ancestor = pid
        while ancestor not in (me, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor != me:
            continue
        role = CLIENT_ROLE if pid == me or pid in client_pids else process_role(command_line)
        ticks = sum(int(value) for value in fields[11:15])
        tree[pid] = ProcessCpu(role, int(fields[19]), ticks / _TICKS_PER_S)
    return tree


def cpu_by_role(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> dict[str, float]:
    """CPU seconds each role spent between the two readings. A process that started meanwhile counts
    whole; one that ended meanwhile counts what its parent reaped of it (its parent's role)."""
    totals: dict[str, float] = defaultdict(float)
    for pid, now in after.items():
        then = before.get(pid)
        spent = now.cpu_s - then.cpu_s if then is not None and then.started == now.started else now.cpu_s
        totals[now.role] += spent
    return totals


CpuColumns = dict[int, dict[str, dict[str, float]]]  # clients -> call -> process -> CPU ms per transaction


@dataclass(frozen=True)
class Workloads:
    faces: list[Path]
    ages: list[Path]

    def of(self, name: str) -> list[Path]:
        return self.faces if name == "faces" else self.ages


def service_rows(
    service: RunningService,
    workloads: Workloads,
    baseline: dict[str, InProcessRate],
    args: argparse.Namespace,
    baselines: dict[str, InProcessBaseline] | None = None,
) -> tuple[list[list[str]], CpuColumns]:
    """Each kind of call at each client count: the table's rows, and with --cpu the CPU of each process.
    With `baselines` (--baseline-per-phase) each phase is compared with the in-process rate measured just
    before it, on the same photos, rather than with the one measured before the service started."""
    rows: list[list[str]] = []
    cpu: CpuColumns = defaultdict(dict)
    client = service.new_client("bench")
    credentials = Credentials(client.client_id, client.client_secret)
    with LoadGenerator(
        service.base_url, credentials, workloads.faces, workloads.ages, args.client_processes
    ) as load:
        # Warm-up: replicas, connections, Milvus.
        load.run("face-search (create+long poll)", 8, 4, args.phase_timeout)
        for name in args.calls:
            workload = CALL_KINDS[name][1]
            for concurrency in args.concurrency:
                reference = baselines[workload].measure(1).images_per_s if baselines else None
                before = process_tree_cpu(load.pids) if args.cpu else {}
                phase = load.run(name, args.requests, concurrency, args.phase_timeout)
                if args.cpu and phase.latencies:
                    spent = cpu_by_role(before, process_tree_cpu(load.pids))
                    count = len(phase.latencies)
                    cpu[concurrency][name] = {role: seconds * 1000 / count for role, seconds in spent.items()}
                throughput = len(phase.latencies) / phase.elapsed_s
                share = f"{throughput / (reference or baseline[workload].images_per_s):.0%}"
                rows.append(
                    [
                        f"service {name}",
                        str(concurrency),
                        f"{throughput:.1f}",
                        f"{share} of {reference:.1f}" if reference else share,
                        *(f"{percentile(phase.latencies, q) * 1000:.0f}" for q in (50, 95, 99)),
                        str(phase.failures),
                        f"{phase.busiest_client_share:.0%}",
                    ]
                )
                print(" ".join(rows[-1]), flush=True)
    return rows, cpu


def cpu_table(columns: dict[str, dict[str, float]], baseline: dict[str, InProcessRate]) -> str:
    """CPU ms per transaction by process (rows) and kind of call (columns), the total, and the share of it
    the models alone need."""
    kinds = {name: workload for name, (_, workload) in CALL_KINDS.items()}
    first = next(iter(columns.values()))
    roles = sorted({role for column in columns.values() for role in column}, key=lambda r: -first.get(r, 0.0))
    rows = [[role, *(f"{column.get(role, 0.0):.1f}" for column in columns.values())] for role in roles]
    totals = {name: sum(column.values()) for name, column in columns.items()}
    models = {name: baseline[kinds[name]].model_cpu_ms for name in columns}
    rows.append(["total", *(f"{totals[name]:.1f}" for name in columns)])
    rows.append(["models alone (in process)", *(f"{models[name]:.1f}" for name in columns)])
    rows.append(["models' share of the total", *(f"{models[name] / totals[name]:.0%}" for name in columns)])
    return format_table(["CPU ms per transaction", *columns], rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per phase")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--topology", nargs="+", default=["in_process", "split"], choices=("in_process", "split")
    )
    parser.add_argument("--calls", nargs="+", default=list(CALL_KINDS), choices=list(CALL_KINDS))
    parser.add_argument("--client-processes", type=int, default=default_processes())
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    parser.add_argument("--cpu", action="store_true", help="also CPU ms per transaction in each process")
    parser.add_argument(
        "--baseline-per-phase",
        action="store_true",
        help="measure the in-process rate again right before each phase and compare the phase with it "
        "(for a machine whose load from other work changes during the run)",
    )
    args = parser.parse_args()

    dev = load_faces_dev()
    workloads = Workloads(
        faces=[image.path for image in dev.of_kind("identity")],
        ages=[image.path for image in dev.of_kind("age")],
    )
    needed = {CALL_KINDS[name][1] for name in args.calls}
    # Each service row is compared with the pipeline on the same photos: the identity photos are large
    # JPEGs, the age photos small crops, and they cost very different amounts to decode and analyse. Measured
    # before any service starts, so nothing else competes for the cores.
    baselines = {name: InProcessBaseline(workloads.of(name), name, args.threads) for name in sorted(needed)}
    baseline = {name: reference.measure(rounds=2) for name, reference in baselines.items()}
    header = ["path", "topology", "clients", "images/s", "vs in-process", "p50 ms", "p95 ms", "p99 ms"]
    header += ["failures", "client CPU"]
    rows = []
    for name, rate in baseline.items():
        work = "decode+detect+embed" if name == "faces" else "decode+detect+age"
        rows.append([f"in-process pipeline, {name} ({work})", "-", "-", f"{rate.images_per_s:.1f}"])
    summaries, cpu_tables = [], []
    for topology in args.topology:
        with (
            tempfile.TemporaryDirectory(prefix="facesearch-bench-") as data_dir,
            benchmarked_service(Path(data_dir), topology, args.threads) as service,
        ):
            per_phase = baselines if args.baseline_per_phase else None
            measured, cpu = service_rows(service, workloads, baseline, args, per_phase)
        rows += [[row[0], topology, *row[1:]] for row in measured]
        for name, prefix in (("faces", "service face-search"), ("ages", "service age")):
            rates = [float(row[2]) for row in measured if row[0].startswith(prefix)]
            if rates:
                summaries.append(
                    f"{topology}, {name}: best service throughput {max(rates):.1f} images/s = "
                    f"{max(rates) / baseline[name].images_per_s:.0%} of in-process"
                )
        for clients, columns in cpu.items():
            cpu_tables.append(f"{topology}, {clients} clients, {args.requests} calls per column\n")
            cpu_tables[-1] += cpu_table(columns, baseline)
    print(format_table(header, [row + [""] * (len(header) - len(row)) for row in rows]))
    print(f"\nclient: {args.client_processes} processes; client CPU: the busiest one's share of a core")
    print("\n".join(summaries))
    for table in cpu_tables:
        print(f"\n{table}")


@contextlib.contextmanager
def benchmarked_service(data_dir: Path, topology: str, threads: int) -> Iterator[RunningService]:
    """The service on 127.0.0.1: in_process as config/serve.yaml ships it (with its environment and direct
    ingress, as `make run` starts it); split through Serve's proxy, sized to this box (split_app_args)."""
    with running_service(data_dir, None if topology == "in_process" else split_app_args(threads)) as service:
        yield service


def split_app_args(threads: int) -> dict[str, object]:
    """build_app arguments of the split topology on this box: `threads` intra-op threads per model."""
    # Three model replicas must fit next to the ingress and worker on a 2-CPU box.
    share = {"ray_actor_options": {"num_cpus": 0.5}}
    models = ("FaceDetectorModel", "FaceEmbedderModel", "AgeModel")
    return {
        "topology": "split",
        "model_config": {"intra_op_threads": threads},
        "deployment_options": {name: share for name in models},
    }


if __name__ == "__main__":
    main()
