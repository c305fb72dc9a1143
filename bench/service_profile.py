"""Where the plumbing's CPU goes inside each process: py-spy samples of the running service under load.

    python -m bench.service_profile [--topology in_process] [--call "face-search (create+long poll)"]
                                    [--seconds 20] [--top 15]

Starts the service as bench.service does (127.0.0.1, embedded Redis and milvus-lite, a temporary data dir),
warms it up, then keeps --concurrency clients making one kind of call while `py-spy record` samples Serve's
HTTP proxy, the ingress and the worker (which runs the models in the in_process topology) for --seconds. By
default only the thread holding the GIL is sampled: that is the Python work, the plumbing this benchmark is
about (native code that releases the GIL, such as ONNX Runtime's kernels or Pillow's decoder, is then not
seen; --all-threads samples it too, though py-spy then also counts some threads blocked in native calls as
busy). For each process it prints the functions with the most samples on the CPU: by self time (the frame
that was running) and by total time (the frame was anywhere on the stack; frames on nearly every stack, such
as the event loop's, are left out). The load stops by itself after the sampling window. Needs py-spy (a dev
dependency) and ptrace rights.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Collection
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
from bench.service_cpu import process_role
from tests.faces_dev import load_faces_dev

PROFILED_ROLES = ("Serve HTTP proxy", "ApiIngress", "TransactionWorker")
# Frames on more than this share of the samples (the event loop, a thread's run()) say nothing.
_ROOT_SHARE = 0.85


@dataclass(frozen=True)
class Profile:
    role: str
    samples: int
    by_self: list[tuple[str, int]]
    by_total: list[tuple[str, int]]


def role_pids(roles: Collection[str] = PROFILED_ROLES) -> dict[str, int]:
    """The pid of each running process of the service in one of `roles` (bench.service_cpu's names)."""
    pids: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command_line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        role = process_role(int(entry), command_line)
        if role is not None and role in roles:
            pids[role] = int(entry)
    return pids


def short_frame(frame: str) -> str:
    """`function (path/to/file.py:line)` -> `function (file.py)`: lines differ per call site, and the table
    is about where time goes, not which line."""
    name, _, location = frame.partition(" (")
    path = location.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    where = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({where})"


def summarise(role: str, raw: Path, top: int) -> Profile:
    """py-spy's raw format: one line per distinct stack, `frame;frame;...;leaf count`, root first."""
    by_self: Counter[str] = Counter()
    by_total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame for frame in stack.split(";") if frame]
        samples += count
        if frames:
            by_self[short_frame(frames[-1])] += count
        for frame in {short_frame(frame) for frame in frames}:
            by_total[frame] += count
    informative = [
        (frame, count) for frame, count in by_total.most_common() if count <= _ROOT_SHARE * samples
    ]
    return Profile(role, samples, by_self.most_common(top), informative[:top])


async def load(base_url: str, token: str, call_name: str, args: argparse.Namespace) -> None:
    dev = load_faces_dev()
    faces = [image.path for image in dev.of_kind("identity")]
    ages = [image.path for image in dev.of_kind("age")]
    async with client_pool(base_url, token, args.client) as client:
        calls = ServiceCalls(client, faces, ages, args.phase_timeout)
        await run_phase(calls.search, 8, 4, args.phase_timeout)  # warm-up
        call, _ = calls.by_name()[call_name]
        stop_at = asyncio.get_running_loop().time() + args.seconds + 5
        while asyncio.get_running_loop().time() < stop_at:
            await run_phase(call, 4 * args.concurrency, args.concurrency, args.phase_timeout)


def record(
    pids: dict[str, int], out_dir: Path, seconds: int, rate: int, gil: bool
) -> list[subprocess.Popen[bytes]]:
    beside_python = Path(sys.executable).parent / "py-spy"  # the virtual environment's, when not on PATH
    py_spy = str(beside_python) if beside_python.exists() else shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    return [
        subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(seconds),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--nonblocking",
                *(["--gil"] if gil else []),
                "--output",
                str(out_dir / f"{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in pids.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default="in_process", choices=("in_process", "split"))
    parser.add_argument("--call", default="face-search (create+long poll)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--keep", type=Path, help="keep py-spy's raw profiles in this directory")
    parser.add_argument(
        "--all-threads",
        action="store_true",
        help="sample every thread py-spy thinks busy, not only the one holding the GIL",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    add_service_arguments(parser)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="facesearch-bench-") as data_dir,
        benchmarked_service(Path(data_dir), args.topology, args.threads, args.ingress) as service,
    ):
        token = service.token_for(service.new_client("bench"))
        out_dir = args.keep or Path(data_dir) / "profiles"
        out_dir.mkdir(parents=True, exist_ok=True)

        async def run() -> list[subprocess.Popen[bytes]]:
            load_task = asyncio.create_task(load(service.base_url, token, args.call, args))
            await asyncio.sleep(5)  # past the warm-up, at full load
            recorders = record(role_pids(), out_dir, args.seconds, args.rate, not args.all_threads)
            await load_task
            return recorders

        recorders = asyncio.run(run())
        for recorder in recorders:
            recorder.wait(timeout=60)
        profiles = [
            summarise(path.stem, path, args.top)
            for path in sorted(out_dir.glob("*.txt"))
            if path.stat().st_size > 0
        ]
    print(
        f"topology {ingress_label(args.topology, args.ingress)}, {args.call}, {args.concurrency} clients, "
        f"{args.seconds} s sampled"
    )
    for profile in profiles:
        print(f"\n{profile.role}: {profile.samples} samples on the CPU")
        rows = [
            [
                self_name,
                f"{self_count / profile.samples:.0%}",
                total_name,
                f"{total_count / profile.samples:.0%}",
            ]
            for (self_name, self_count), (total_name, total_count) in zip(
                profile.by_self, profile.by_total + [("", 0)] * len(profile.by_self), strict=False
            )
        ]
        print(format_table(["self", "%", "inclusive", "%"], rows))


if __name__ == "__main__":
    main()
