"""Service benchmark: one run on the dev photos, printing one table.

Rows: the in-process pipeline (models/analyzer.py, no Ray) in images/s; the running service's face search
(create + poll /result) and age estimation (create + poll, and wait_for_result=1) at 1, 8 and 32 concurrent
clients with throughput and p50/p95/p99 latency; and the dlib-bin reference pipeline (HOG + 5-point
landmarks + dlib descriptor, the way the face_recognition library does it).

    python -m bench.service [--requests 64] [--topology fused split] [--concurrency 1 8 32]

With both topologies (the default) each gets a fresh service in turn, and the one table compares them.

The service is started on 127.0.0.1 with embedded Redis and milvus-lite in a temporary directory and shut
down at the end. Each phase is bounded by --requests and --phase-timeout.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import base64
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np

from bench.common import format_table, load_image
from tests.faces_dev import load_faces_dev
from tests.service_harness import running_service


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def in_process_images_per_s(paths: list[Path], threads: int, rounds: int) -> float:
    from models.analyzer import ModelConfig, load_face_analyzer

    analyzer = load_face_analyzer(ModelConfig(intra_op_threads=threads))
    images = [load_image(path) for path in paths]
    analyzer.analyze(images[:4])
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for start in range(0, len(images), 16):
            analyzer.analyze(images[start : start + 16], embed=True, estimate_age=True)
        best = min(best, time.perf_counter() - started)
    return len(images) / best


def dlib_reference_images_per_s(paths: list[Path]) -> float:
    import dlib

    from models.weights import resolve

    detector = dlib.get_frontal_face_detector()
    shapes = dlib.shape_predictor(str(resolve("dlib_shape5")))
    descriptor = dlib.face_recognition_model_v1(str(resolve("dlib_resnet_v1")))
    images = [np.asarray(load_image(path).astype(np.uint8)) for path in paths]
    started = time.perf_counter()
    for image in images:
        rgb = (
            image
            if image.ndim == 3 and image.shape[2] == 3
            else np.stack([image[..., 0] if image.ndim == 3 else image] * 3, -1)
        )
        for box in detector(rgb, 1):
            descriptor.compute_face_descriptor(rgb, shapes(rgb, box))
    return len(images) / (time.perf_counter() - started)


async def _poll(
    http: httpx.AsyncClient, headers: dict[str, str], reference_id: str, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    interval = 0.05  # back off like a polite client: 50 ms growing to 400 ms
    while time.monotonic() < deadline:
        response = await http.post("/result", headers=headers, json={"reference_id": reference_id})
        if response.status_code == 200:
            return
        if response.status_code != 202:
            raise RuntimeError(f"/result answered {response.status_code}: {response.text[:200]}")
        await asyncio.sleep(interval)
        interval = min(0.4, interval * 1.5)
    raise TimeoutError(reference_id)


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


async def service_rows(
    base_url: str, token: str, faces: list[Path], ages: list[Path], args: argparse.Namespace
) -> list[list[str]]:
    headers = {"Authorization": f"Bearer {token}"}
    uris = [f"data:image/jpeg;base64,{base64.b64encode(path.read_bytes()).decode()}" for path in faces]
    age_bytes = [(path.name, path.read_bytes()) for path in ages]
    rows: list[list[str]] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:

        async def search(index: int) -> None:
            body = {
                "type": "face_search",
                "file": uris[index % len(uris)],
                "enroll_face": index % 4 == 0,
                "client_reference": f"bench-{index % 50:04d}",
            }
            response = await http.post("/face-search", headers=headers, json=body)
            response.raise_for_status()
            await _poll(http, headers, response.json()["result"]["data"]["reference_id"], args.phase_timeout)

        async def age_poll(index: int) -> None:
            name, data = age_bytes[index % len(age_bytes)]
            form = {"type": "age_estimation", "enroll_face": "0"}
            response = await http.post(
                "/age-estimation", headers=headers, data=form, files={"file": (name, data)}
            )
            response.raise_for_status()
            await _poll(http, headers, response.json()["result"]["data"]["reference_id"], args.phase_timeout)

        async def age_wait(index: int) -> None:
            name, data = age_bytes[index % len(age_bytes)]
            form = {"type": "age_estimation", "enroll_face": "0", "wait_for_result": "1"}
            response = await http.post(
                "/age-estimation", headers=headers, data=form, files={"file": (name, data)}
            )
            if response.status_code != 200:
                raise RuntimeError(response.text[:200])

        await run_phase(search, 8, 4, args.phase_timeout)  # warm-up: replicas, connections, Milvus load
        for name, call in (
            ("face-search (create+poll)", search),
            ("age (create+poll)", age_poll),
            ("age (wait_for_result=1)", age_wait),
        ):
            for concurrency in args.concurrency:
                elapsed, latencies, failures = await run_phase(
                    call, args.requests, concurrency, args.phase_timeout
                )
                rows.append(
                    [
                        f"service {name}",
                        str(concurrency),
                        f"{len(latencies) / elapsed:.1f}",
                        f"{percentile(latencies, 50) * 1000:.0f}",
                        f"{percentile(latencies, 95) * 1000:.0f}",
                        f"{percentile(latencies, 99) * 1000:.0f}",
                        str(failures),
                    ]
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per phase")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--topology", nargs="+", default=["fused", "split"], choices=("fused", "split"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    args = parser.parse_args()

    dev = load_faces_dev()
    faces = [image.path for image in dev.of_kind("identity")]
    ages = [image.path for image in dev.of_kind("age")]
    pipeline_paths = faces + ages[:30]
    in_process = in_process_images_per_s(pipeline_paths, args.threads, rounds=2)
    reference = dlib_reference_images_per_s(pipeline_paths)
    header = ["path", "topology", "clients", "images/s", "p50 ms", "p95 ms", "p99 ms", "failures"]
    rows = [
        ["in-process pipeline (detect+align+embed+age)", "-", "-", f"{in_process:.1f}", "", "", "", ""],
        ["dlib-bin reference (HOG up1 + 5pt + descriptor)", "-", "-", f"{reference:.1f}", "", "", "", ""],
    ]
    summaries = []
    for topology in args.topology:
        topology_rows = [[row[0], topology, *row[1:]] for row in measure_service(topology, faces, ages, args)]
        rows += topology_rows
        best = max(float(row[3]) for row in topology_rows if row[3] != "nan")
        summaries.append(
            f"{topology}: best service throughput / in-process {best / in_process:.0%}, "
            f"service / dlib-bin reference {best / reference:.1f}x, median of p50s "
            f"{statistics.median(float(row[4]) for row in topology_rows):.0f} ms"
        )
    print(format_table(header, rows))
    print(f"\nin-process / reference: {in_process / reference:.1f}x")
    print("\n".join(summaries))


def measure_service(
    topology: str, faces: list[Path], ages: list[Path], args: argparse.Namespace
) -> list[list[str]]:
    with tempfile.TemporaryDirectory(prefix="facesearch-bench-") as data_dir:
        model_config = {"intra_op_threads": args.threads}
        app_args: dict[str, object] = {"topology": topology, "model_config": model_config}
        if topology == "split":
            # Three model replicas must fit next to the ingress and worker on a 2-CPU box.
            share = {"ray_actor_options": {"num_cpus": 0.5}}
            models = ("FaceDetectorModel", "FaceEmbedderModel", "AgeModel")
            app_args["deployment_options"] = {name: share for name in models}
        with running_service(Path(data_dir), app_args) as service:
            token = service.token_for(service.new_client("bench"))
            return asyncio.run(service_rows(service.base_url, token, faces, ages, args))


if __name__ == "__main__":
    main()
