"""Service benchmark: one run on the dev photos, printing one table.

Rows: the fair in-process baseline (no Ray, no HTTP: the worker's own decoding of the uploaded bytes, then
the models the transaction needs: detect+embed for a face search on the identity photos ("faces"),
detect+age for an age estimation on the age crops ("ages")) in images/s; then the running service's face
search (create + polite polling of /result, and create + long poll with `Prefer: wait=10`) on the identity
photos and age estimation (create + poll, and wait_for_result=1) on the age crops, at 1, 8 and 32
concurrent clients, with throughput, its share of the in-process rate on the same photos, and p50/p95/p99
latency.

    python -m bench.service [--requests 64] [--topology in_process split] [--concurrency 1 8 32] [--cpu]

With both topologies (the default) each gets a fresh service in turn, and the one table compares them:
in_process as config/serve.yaml ships it (direct ingress), split through Serve's proxy. The clients are
the SDK (facesearch_client) sending over aiohttp, which leaves the service more of the shared cores than
the SDK's httpx (bench.load_client).

With --cpu, each phase also reads every process's CPU time from /proc before and after, and a table per
topology and client count gives the CPU milliseconds per transaction of each process (Serve's HTTP proxy,
the ingress, the worker, the model replicas, Redis, Milvus, Ray's own daemons, the benchmark's client) for
each kind of call, their total, and the models' own CPU per image (measured in process on the same photos,
decoding excluded) as a share of it. Where the cores are the limit, the total is what one transaction
costs, and the table says which hop to make cheaper. Linux only (/proc).

The service is started on 127.0.0.1 with embedded Redis and milvus-lite in a temporary directory and shut
down at the end. Each phase is bounded by --requests and --phase-timeout.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import contextlib
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.common import format_table, percentile
from bench.load_client import AiohttpFaceSearchClient
from facesearch_client import AsyncFaceSearchClient, Pending, RetryPolicy
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


def in_process_rate(paths: list[Path], workload: str, threads: int, rounds: int) -> InProcessRate:
    """The transaction's own work with no service around it: decode the uploaded bytes exactly as the
    worker does (serve_app.imaging.decode with the service's limits), then run the models the transaction
    needs, in batches of 16 (no run of the CPU worker is larger, so the baseline has every saving that
    batching gives). Best of `rounds`."""
    from models.analyzer import ModelConfig, load_face_analyzer
    from serve_app.imaging.decode import decode_image
    from serve_app.settings import Settings

    limits = Settings.from_env()
    max_pixels, max_side = limits.limits.max_image_pixels, limits.models.analysis_max_side
    embed, estimate_age = WORKLOAD_NEEDS[workload]
    analyzer = load_face_analyzer(ModelConfig(intra_op_threads=threads))
    uploads = [path.read_bytes() for path in paths]
    decoded = [decode_image(data, max_pixels, max_side).pixels for data in uploads]
    analyzer.analyze(decoded[:4], embed=embed, estimate_age=estimate_age)  # warm-up
    best_wall, best_model_cpu = float("inf"), float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for start in range(0, len(uploads), 16):
            pixels = [decode_image(data, max_pixels, max_side).pixels for data in uploads[start : start + 16]]
            analyzer.analyze(pixels, embed=embed, estimate_age=estimate_age)
        best_wall = min(best_wall, time.perf_counter() - started)
        cpu_started = time.process_time()
        for start in range(0, len(decoded), 16):
            analyzer.analyze(decoded[start : start + 16], embed=embed, estimate_age=estimate_age)
        best_model_cpu = min(best_model_cpu, time.process_time() - cpu_started)
    return InProcessRate(len(uploads) / best_wall, best_model_cpu * 1000 / len(uploads))


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


async def run_phase(
    call: Callable[[int], Awaitable[None]], requests: int, concurrency: int, timeout_s: float
) -> tuple[float, list[float], int]:
    latencies: list[float] = []
    failures = 0
    counter = iter(range(requests))

    async def client() -> None:
        nonlocal failures
        for index in counter:
            started = time.perf_counter()
            try:
                await call(index)
                latencies.append(time.perf_counter() - started)
            except Exception:
                failures += 1

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))), timeout_s)
    return time.perf_counter() - started, latencies, failures


# Each kind of call: the ServiceCalls method that makes it, and the workload its photos come from.
CALL_KINDS = {
    "face-search (create+poll)": ("search", "faces"),
    "face-search (create+long poll)": ("search_long_poll", "faces"),
    "age (create+poll)": ("age_poll", "ages"),
    "age (wait_for_result=1)": ("age_wait", "ages"),
}


class ServiceCalls:
    """One client transaction per call, as the benchmark's clients make them (through facesearch_client,
    with no retries so a refused call counts as a failure); `index` picks the photo."""

    def __init__(
        self, client: AsyncFaceSearchClient, faces: list[Path], ages: list[Path], timeout_s: float
    ) -> None:
        self._client = client
        self._faces = [path.read_bytes() for path in faces]
        self._ages = [path.read_bytes() for path in ages]
        self._timeout_s = timeout_s

    def by_name(self) -> dict[str, tuple[Callable[[int], Awaitable[None]], str]]:
        """Each kind of call with the workload ("faces" or "ages") its photos come from."""
        return {name: (getattr(self, method), workload) for name, (method, workload) in CALL_KINDS.items()}

    async def search(self, index: int) -> None:
        # Polite polling: 50 ms growing to 400 ms between polls.
        await self._client.wait(await self._create_search(index), self._timeout_s, long_poll_s=None)

    async def search_long_poll(self, index: int) -> None:
        await self._client.wait(await self._create_search(index), self._timeout_s, long_poll_s=10)

    async def age_poll(self, index: int) -> None:
        photo = self._ages[index % len(self._ages)]
        reference_id = await self._client.submit_age_estimation(photo, enroll_face=False)
        await self._client.wait(reference_id, self._timeout_s, long_poll_s=None)

    async def age_wait(self, index: int) -> None:
        answer = await self._client.age_estimation(self._ages[index % len(self._ages)], enroll_face=False)
        if isinstance(answer, Pending):
            raise RuntimeError(f"{answer.reference_id} not final within wait_for_result")

    async def _create_search(self, index: int) -> str:
        return await self._client.submit_face_search(
            self._faces[index % len(self._faces)],
            as_json=True,
            enroll_face=index % 4 == 0,
            client_reference=f"bench-{index % 50:04d}",
        )


@contextlib.asynccontextmanager
async def client_pool(base_url: str, token: str) -> AsyncIterator[AsyncFaceSearchClient]:
    """The benchmark's clients: the SDK with no retries, sending over aiohttp (bench.load_client), up to 64
    connections."""
    connector = aiohttp.TCPConnector(limit=64)
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session,
        AiohttpFaceSearchClient(session, token=token, retry=RetryPolicy(max_retries=0)) as client,
    ):
        yield client


CpuColumns = dict[int, dict[str, dict[str, float]]]  # clients -> call -> process -> CPU ms per transaction


async def service_rows(
    base_url: str,
    token: str,
    workloads: dict[str, list[Path]],
    baseline: dict[str, InProcessRate],
    args: argparse.Namespace,
) -> tuple[list[list[str]], CpuColumns]:
    """Each kind of call at each client count: the table's rows, and with --cpu the CPU of each process."""
    rows: list[list[str]] = []
    cpu: CpuColumns = defaultdict(dict)
    async with client_pool(base_url, token) as client:
        calls = ServiceCalls(client, workloads["faces"], workloads["ages"], args.phase_timeout)
        await run_phase(calls.search, 8, 4, args.phase_timeout)  # warm-up: replicas, connections, Milvus
        for name, (call, workload) in calls.by_name().items():
            for concurrency in args.concurrency:
                before = cpu_seconds_by_role() if args.cpu else {}
                elapsed, latencies, failures = await run_phase(
                    call, args.requests, concurrency, args.phase_timeout
                )
                if args.cpu and latencies:
                    after = cpu_seconds_by_role()
                    cpu[concurrency][name] = {
                        role: (after[role] - before.get(role, 0.0)) * 1000 / len(latencies) for role in after
                    }
                throughput = len(latencies) / elapsed
                rows.append(
                    [
                        f"service {name}",
                        str(concurrency),
                        f"{throughput:.1f}",
                        f"{throughput / baseline[workload].images_per_s:.0%}",
                        *(f"{percentile(latencies, q) * 1000:.0f}" for q in (50, 95, 99)),
                        str(failures),
                    ]
                )
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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    parser.add_argument("--cpu", action="store_true", help="also CPU ms per transaction in each process")
    args = parser.parse_args()

    dev = load_faces_dev()
    workloads = {
        "faces": [image.path for image in dev.of_kind("identity")],
        "ages": [image.path for image in dev.of_kind("age")],
    }
    # Each service row is compared with the pipeline on the same photos: the identity photos are large
    # JPEGs, the age photos small crops, and they cost very different amounts to decode and analyse. Measured
    # before any service starts, so nothing else competes for the cores.
    baseline = {
        name: in_process_rate(paths, name, args.threads, rounds=2) for name, paths in workloads.items()
    }
    header = ["path", "topology", "clients", "images/s", "vs in-process", "p50 ms", "p95 ms", "p99 ms"]
    header.append("failures")
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
            token = service.token_for(service.new_client("bench"))
            measured, cpu = asyncio.run(service_rows(service.base_url, token, workloads, baseline, args))
        rows += [[row[0], topology, *row[1:]] for row in measured]
        for name, prefix in (("faces", "service face-search"), ("ages", "service age")):
            best = max(float(row[2]) for row in measured if row[0].startswith(prefix))
            summaries.append(
                f"{topology}, {name}: best service throughput {best:.1f} images/s = "
                f"{best / baseline[name].images_per_s:.0%} of in-process"
            )
        for clients, columns in cpu.items():
            cpu_tables.append(f"{topology}, {clients} clients, {args.requests} calls per column\n")
            cpu_tables[-1] += cpu_table(columns, baseline)
    print(format_table(header, [row + [""] * (len(header) - len(row)) for row in rows]))
    print("\n" + "\n".join(summaries))
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
