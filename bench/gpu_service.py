"""The service on a GPU box: candidate layouts against the box's own in-process ceiling and its CPU-only
service, in one run, printing one table.

    python -m bench.gpu_service [--layouts cpu-only gpu-workers-4 split] [--concurrency 8 64 128]
                                [--ceiling-seconds 20] [--deadline-s 420] [--rehearse-on-cpu] [--dry-run]
                                [--json results.json]

Rows:
- the in-process ceiling: as many processes as cores, each decoding the identity photos' uploaded bytes and
  running detect + embed on CUDA in batches of 16 (what a face search costs with no service around it),
  their images/s summed; the same with CPU-only processes (one intra-op thread each);
- each layout's face search in one request (`Prefer: wait` on the create, bench.load_client) at each
  client count: searches/s, share of the CUDA ceiling, p50/p95/p99 latency, failures, and the busiest
  client process' CPU as a share of a core (the clients run in --client-processes processes, pools as
  large as their client count, so the load generator is not the limit; this column shows it).

Layouts (see LAYOUTS): the CPU-only in_process service sized to the box; in_process workers that each own
CUDA sessions and a quarter of the GPU (config/serve-gpu.yaml as shipped, ingress replicas included); the
split topology (a deployment per model: config/serve-gpu-cluster.yaml). The service runs on 127.0.0.1 with
embedded Redis and milvus-lite (tests.service_harness), on a Ray node declared with every core and the one
GPU. Layouts are measured in the order given; one that would start after --deadline-s is skipped and says
so, so the run fits a fixed machine lease. --rehearse-on-cpu runs the same layouts with CPU sessions and no
GPU share (a machine without one); --dry-run makes every count tiny (a rehearsal of the whole script in a
few minutes on the 2-core development box: `python -m bench.gpu_service --rehearse-on-cpu --dry-run`).

Needs onnxruntime-gpu with CUDA and cuDNN on the library path: bench/gpu_service.sh installs the GPU
offline kit and sets that up on such a machine (docs/performance.md, "Measuring a GPU box").
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import json
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import format_table, percentile
from bench.load_client import Credentials, LoadGenerator, PhaseResult, default_processes
from serve_app.launch.deploy_config import load_serve_config
from tests.faces_dev import REPO_ROOT, load_faces_dev

CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU_ONLY = ["CPUExecutionProvider"]
SHIPPED_CPU = REPO_ROOT / "config" / "serve.yaml"
SHIPPED_GPU = REPO_ROOT / "config" / "serve-gpu.yaml"
SPLIT_GPU = REPO_ROOT / "config" / "serve-gpu-cluster.yaml"  # the split topology, for GPU clusters
DRY_RUN_CPUS = 16


@dataclass(frozen=True)
class Layout:
    description: str
    args: Callable[[int], dict[str, Any]]  # build_app args for a box of this many cores
    direct_ingress: bool = True


def _cpu_only(cores: int) -> dict[str, Any]:
    """config/serve.yaml's in_process application sized to the box: a worker per 2 cores (2 batches each)."""
    options = dict(load_serve_config(SHIPPED_CPU).args.deployment_options)
    options["TransactionWorker"] = {
        "num_replicas": max(1, (cores - 2) // 2),
        "max_ongoing_requests": 16,
        "ray_actor_options": {"num_cpus": min(2.0, cores - 1.0)},
        "user_config": {"concurrency": 64},
    }
    return {
        "topology": "in_process",
        "model_config": {"intra_op_threads": 1, "provider_preference": CPU_ONLY},
        "concurrent_batches": 2,
        "deployment_options": options,
    }


def _shipped(config: Path) -> Callable[[int], dict[str, Any]]:
    """A shipped config's application, whatever the box's cores."""
    return lambda cores: load_serve_config(config).args.model_dump(by_alias=True)


LAYOUTS: dict[str, Layout] = {
    "cpu-only": Layout("in_process, CPU only: workers x 2 cores, 2 batches each", _cpu_only),
    "gpu-workers-4": Layout(
        "in_process, 4 workers x (3 cores, 1/4 GPU), 3 batches each (config/serve-gpu.yaml)",
        _shipped(SHIPPED_GPU),
    ),
    "split": Layout(
        "a deployment per model, 1/4 GPU each; 2 workers (config/serve-gpu-cluster.yaml)",
        _shipped(SPLIT_GPU),
        direct_ingress=False,
    ),
}


@contextmanager
def ray_sized_to_the_box(gpus: int, cpus: int | None = None) -> Iterator[None]:
    """tests.service_harness starts Ray with the 2 cores of the CI box; here Ray gets every core (or `cpus`
    logical ones) and the GPU (it is the same ray.init otherwise)."""
    import ray

    original = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs["num_cpus"] = cpus or os.cpu_count()
        kwargs["num_gpus"] = gpus
        return original(*args, **kwargs)

    ray.init = init
    try:
        yield
    finally:
        ray.init = original


# ----- the in-process ceiling: N processes, each the whole face-search work of the models -----


def _ceiling_worker(
    providers: list[str], paths: list[str], seconds: float, barrier: Any, results: Any
) -> None:
    from models.analyzer import ModelConfig, load_face_analyzer
    from serve_app.imaging.decode import decode_image
    from serve_app.settings import Settings

    limits = Settings.from_env()
    max_pixels, max_side = limits.limits.max_image_pixels, limits.models.analysis_max_side
    analyzer = load_face_analyzer(ModelConfig(intra_op_threads=1, provider_preference=tuple(providers)))
    uploads = [Path(path).read_bytes() for path in paths]

    def one_pass() -> int:
        for start in range(0, len(uploads), 16):
            chunk = uploads[start : start + 16]
            pixels = [decode_image(data, max_pixels, max_side).pixels for data in chunk]
            analyzer.analyze(pixels, embed=True, estimate_age=False)
        return len(uploads)

    one_pass()  # warm-up: every run shape seen once
    barrier.wait()
    images, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        images += one_pass()
    results.put(images / (time.perf_counter() - started))


def ceiling(providers: list[str], processes: int, paths: list[Path], seconds: float) -> float:
    """Summed images/s of `processes` processes, each timed for `seconds` after a common start."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(
            target=_ceiling_worker, args=(providers, [str(p) for p in paths], seconds, barrier, results)
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    rates = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return float(sum(rates))


# ----- the service -----

SEARCH = "face-search (one request)"  # bench.load_client.CALL_KINDS: Prefer: wait on the create


@dataclass(frozen=True)
class Counts:
    """How much each phase sends: max(min_requests, requests_per_client x clients) searches."""

    requests_per_client: int
    min_requests: int
    warm_up: tuple[int, int]  # (requests, clients) before the first measured phase

    def requests(self, clients: int) -> int:
        return max(self.min_requests, self.requests_per_client * clients)


def _search_rows(
    base_url: str,
    credentials: Credentials,
    faces: list[Path],
    concurrency: list[int],
    counts: Counts,
    client_processes: int,
    timeout_s: float,
) -> list[tuple[int, PhaseResult]]:
    rows = []
    with LoadGenerator(base_url, credentials, faces, [], client_processes) as load:
        load.run(SEARCH, *counts.warm_up, timeout_s)  # warm-up: every replica, every shape
        for clients in concurrency:
            phase = load.run(SEARCH, counts.requests(clients), clients, timeout_s)
            rows.append((clients, phase))
    return rows


def layout_args(layout: Layout, rehearse_on_cpu: bool) -> dict[str, Any]:
    args = layout.args(os.cpu_count() or 1)
    if rehearse_on_cpu:  # the same layout with CPU sessions and no GPU share
        args["model_config"] = {**args["model_config"], "provider_preference": CPU_ONLY}
        for options in args["deployment_options"].values():
            options.get("ray_actor_options", {}).pop("num_gpus", None)
    return args


def measure_layout(
    layout: Layout,
    faces: list[Path],
    concurrency: list[int],
    counts: Counts,
    options: argparse.Namespace,
) -> list[tuple[int, PhaseResult]]:
    from tests.service_harness import running_service

    cpu_env = load_serve_config(SHIPPED_CPU).env_vars  # Serve's switches as the shipped config sets them
    args = layout_args(layout, options.rehearse_on_cpu)
    with (
        tempfile.TemporaryDirectory(prefix="facesearch-gpu-bench-") as data_dir,
        # A dry run declares the CPUs of a 16-core GPU box, so every layout's replicas are placed on a
        # smaller machine too (oversubscribed: it checks that the script runs, not how fast).
        ray_sized_to_the_box(0 if options.rehearse_on_cpu else 1, DRY_RUN_CPUS if options.dry_run else None),
        running_service(Path(data_dir), args, env=cpu_env, direct_ingress=layout.direct_ingress) as service,
    ):
        client = service.new_client("bench")
        return _search_rows(
            service.base_url,
            Credentials(client.client_id, client.client_secret),
            faces,
            concurrency,
            counts,
            options.client_processes,
            options.phase_timeout,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--requests-per-client", type=int, default=6)
    parser.add_argument("--min-requests", type=int, default=128)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="ceiling processes")
    parser.add_argument("--client-processes", type=int, default=default_processes())
    parser.add_argument("--ceiling-seconds", type=float, default=20.0)
    parser.add_argument("--skip-cpu-ceiling", action="store_true")
    parser.add_argument(
        "--rehearse-on-cpu", action="store_true", help="no GPU here: the CUDA rows run on the CPU (a dry run)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny counts everywhere (2 ceiling processes for 2 s, 2 and 4 clients, a few requests): checks "
        "that the whole script runs, measures nothing",
    )
    parser.add_argument("--phase-timeout", type=float, default=120.0)
    parser.add_argument("--deadline-s", type=float, default=420.0, help="start no layout after this")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.processes = min(args.processes, 2)
        args.ceiling_seconds = min(args.ceiling_seconds, 2.0)
        args.concurrency = [2, 4]
        args.requests_per_client, args.min_requests = 2, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    gpu_providers = CPU_ONLY if args.rehearse_on_cpu else CUDA_FIRST
    faces = [image.path for image in load_faces_dev().of_kind("identity")]
    counts = Counts(args.requests_per_client, args.min_requests, (4, 2) if args.dry_run else (64, 16))

    header = ["row", "clients", "searches/s", "vs CUDA ceiling", "p50 ms", "p95 ms", "p99 ms", "failures"]
    header.append("client CPU")
    rows: list[list[str]] = []
    cuda = ceiling(gpu_providers, args.processes, faces, args.ceiling_seconds)
    on = "CUDA (rehearsed on the CPU)" if args.rehearse_on_cpu else "CUDA"
    rows.append([f"in-process ceiling, {args.processes} processes on {on}", "-", f"{cuda:.1f}", "100%"])
    print(f"CUDA ceiling: {cuda:.1f} images/s", flush=True)
    if not args.skip_cpu_ceiling:
        cpu = ceiling(CPU_ONLY, args.processes, faces, args.ceiling_seconds)
        rows.append([f"in-process ceiling, {args.processes} processes CPU only", "-", f"{cpu:.1f}"])
        print(f"CPU ceiling: {cpu:.1f} images/s", flush=True)
    for name in args.layouts:
        layout = LAYOUTS[name]
        if time.monotonic() - started > args.deadline_s:
            rows.append([f"{name}: skipped (past --deadline-s)", "-", "-"])
            continue
        layout_started = time.monotonic()
        try:
            measured = measure_layout(layout, faces, args.concurrency, counts, args)
        except Exception as error:  # a layout that cannot start is a row, not the end of the run
            rows.append([f"{name}: failed: {error!r}"[:100], "-", "-"])
            print(f"{name} failed: {error!r}", flush=True)
            continue
        for clients, phase in measured:
            rate = len(phase.latencies) / phase.elapsed_s
            cells = [f"{name}: {layout.description}", str(clients), f"{rate:.1f}", f"{rate / cuda:.0%}"]
            cells += [f"{percentile(phase.latencies, q) * 1000:.0f}" for q in (50, 95, 99)]
            rows.append([*cells, str(phase.failures), f"{phase.busiest_client_share:.0%}"])
            print(rows[-1], flush=True)
        print(f"{name}: {time.monotonic() - layout_started:.0f} s", flush=True)
    print(format_table(header, [row + [""] * (len(header) - len(row)) for row in rows]))
    print(f"clients: {args.client_processes} processes; total {time.monotonic() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
