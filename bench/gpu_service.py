"""The service on a GPU box: candidate layouts against the box's own in-process ceiling and its CPU-only
service, in one run, printing one table.

    python -m bench.gpu_service [--layouts cpu-only gpu-workers-4 split] [--rehearse-on-cpu]
                                [--concurrency 8 64 128] [--ceiling-seconds 20] [--deadline-s 480]

Rows:
- the in-process ceiling: as many processes as cores, each decoding the identity photos' uploaded bytes and
  running detect + embed on CUDA in batches of 16 (what a face search costs with no service around it),
  their images/s summed; the same with CPU-only processes (one intra-op thread each);
- each layout's face search (create + long poll, the SDK over aiohttp, no retries) at each client count:
  searches/s, share of the CUDA ceiling, p50/p95/p99 latency and failures.

Layouts (see LAYOUTS): the CPU-only in_process service sized to the box; in_process workers that each own
CUDA sessions and a quarter of the GPU (config/serve-gpu.yaml as shipped); the split topology (a deployment
per model: config/serve-gpu-cluster.yaml). The service runs on 127.0.0.1 with embedded Redis and
milvus-lite (tests.service_harness), on a Ray node declared with every core and the one GPU. Layouts are
measured in the order given; one that would start after --deadline-s is skipped and says so, so the run
fits a fixed machine lease. --rehearse-on-cpu runs the same layouts with CPU sessions and no GPU share: a
dry run on a machine without one.

Needs onnxruntime-gpu with CUDA and cuDNN on the library path (bench/gpu_service.sh sets that up from a
kit on such a machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import format_table, percentile
from bench.service import ServiceCalls, client_pool, run_phase
from serve_app.launch.deploy_config import load_serve_config
from tests.faces_dev import REPO_ROOT, load_faces_dev

CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU_ONLY = ["CPUExecutionProvider"]
SHIPPED_CPU = REPO_ROOT / "config" / "serve.yaml"
SHIPPED_GPU = REPO_ROOT / "config" / "serve-gpu.yaml"
SPLIT_GPU = REPO_ROOT / "config" / "serve-gpu-cluster.yaml"  # the split topology, for GPU clusters


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
        "split: a deployment per model, 1/4 GPU each; 2 workers (config/serve-gpu-cluster.yaml)",
        _shipped(SPLIT_GPU),
        direct_ingress=False,
    ),
}


@contextmanager
def ray_sized_to_the_box(gpus: int) -> Iterator[None]:
    """tests.service_harness starts Ray with the 2 cores of the CI box; here Ray gets every core and the
    GPU (it is the same ray.init otherwise)."""
    import ray

    original = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs["num_cpus"] = os.cpu_count()
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


async def _search_rows(
    base_url: str, token: str, faces: list[Path], concurrency: list[int], timeout_s: float
) -> list[tuple[int, float, list[float], int]]:
    rows = []
    async with client_pool(base_url, token) as client:
        calls = ServiceCalls(client, faces, [], timeout_s)
        await run_phase(calls.search_long_poll, 64, 16, timeout_s)  # warm-up: every replica, every shape
        for clients in concurrency:
            requests = max(128, 6 * clients)
            elapsed, latencies, failures = await run_phase(
                calls.search_long_poll, requests, clients, timeout_s
            )
            rows.append((clients, len(latencies) / elapsed, latencies, failures))
    return rows


def measure_layout(
    layout: Layout, faces: list[Path], concurrency: list[int], timeout_s: float, rehearse_on_cpu: bool
) -> list[tuple[int, float, list[float], int]]:
    from tests.service_harness import running_service

    cpu_env = load_serve_config(SHIPPED_CPU).env_vars  # Serve's switches as the shipped config sets them
    args = layout.args(os.cpu_count() or 1)
    if rehearse_on_cpu:  # the same layout with CPU sessions and no GPU share
        args["model_config"] = {**args["model_config"], "provider_preference": CPU_ONLY}
        for options in args["deployment_options"].values():
            options.get("ray_actor_options", {}).pop("num_gpus", None)
    with (
        tempfile.TemporaryDirectory(prefix="facesearch-gpu-bench-") as data_dir,
        ray_sized_to_the_box(gpus=0 if rehearse_on_cpu else 1),
        running_service(Path(data_dir), args, env=cpu_env, direct_ingress=layout.direct_ingress) as service,
    ):
        token = service.token_for(service.new_client("bench"))
        return asyncio.run(_search_rows(service.base_url, token, faces, concurrency, timeout_s))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="ceiling processes")
    parser.add_argument("--ceiling-seconds", type=float, default=20.0)
    parser.add_argument("--skip-cpu-ceiling", action="store_true")
    parser.add_argument(
        "--rehearse-on-cpu", action="store_true", help="no GPU here: the CUDA rows run on the CPU (a dry run)"
    )
    parser.add_argument("--phase-timeout", type=float, default=120.0)
    parser.add_argument("--deadline-s", type=float, default=480.0, help="start no layout after this")
    args = parser.parse_args()
    started = time.monotonic()
    gpu_providers = CPU_ONLY if args.rehearse_on_cpu else CUDA_FIRST
    faces = [image.path for image in load_faces_dev().of_kind("identity")]

    header = ["row", "clients", "searches/s", "vs CUDA ceiling", "p50 ms", "p95 ms", "p99 ms", "failures"]
    rows: list[list[str]] = []
    cuda = ceiling(gpu_providers, args.processes, faces, args.ceiling_seconds)
    rows.append([f"in-process ceiling, {args.processes} processes on CUDA", "-", f"{cuda:.1f}", "100%"])
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
            measured = measure_layout(
                layout, faces, args.concurrency, args.phase_timeout, args.rehearse_on_cpu
            )
        except Exception as error:  # a layout that cannot start is a row, not the end of the run
            rows.append([f"{name}: failed: {error!r}"[:100], "-", "-"])
            print(f"{name} failed: {error!r}", flush=True)
            continue
        for clients, rate, latencies, failures in measured:
            cells = [f"{name}: {layout.description}", str(clients), f"{rate:.1f}", f"{rate / cuda:.0%}"]
            cells += [f"{percentile(latencies, q) * 1000:.0f}" for q in (50, 95, 99)]
            rows.append([*cells, str(failures)])
            print(rows[-1], flush=True)
        print(f"{name}: {time.monotonic() - layout_started:.0f} s", flush=True)
    print(format_table(header, [row + [""] * (len(header) - len(row)) for row in rows]))


if __name__ == "__main__":
    main()
