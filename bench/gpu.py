"""The model layer on a GPU: where each model's nodes run, faces/s per model at batch 1, 16 and 64, and the
whole in-process pipeline on CUDA next to the same machine's CPU.

    python -m bench.gpu [--faces-dev DIR] [--repeats R] [--pipeline-batches 8 32] [--cpu-threads 1]

Needs onnxruntime-gpu with its CUDA and cuDNN libraries on the library path. It imports only the model layer
(no Ray, Redis or Milvus), so it runs where just those packages are installed. Node placement comes from
ONNX Runtime's own profiler: a session that lists CUDA can still run some nodes on the CPU (shape ops, or
operators CUDA has no kernel for), and those show up there. Model timings are the best of R runs after one
untimed run per batch size (cuDNN picks its algorithms on the first run of each shape); the pipeline is
timed over two passes with the shipped ModelConfig (fixed run sizes: SessionOptions.gpu_run_size), the
first paying for every new batch shape, as a fresh replica does, next to the same photos on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.common import best_seconds, format_table, load_image, tile_to
from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.arrays import to_rgb
from models.embedder import FusedEmbedder
from models.weights import converted
from tests.faces_dev import load_faces_dev

BATCH_SIZES = (1, 16, 64)
STAGES = ("detect", "align+crop", "embed", "age")
CUDA_FIRST = ("CUDAExecutionProvider", "CPUExecutionProvider")
_DTYPES = {"tensor(float)": np.float32, "tensor(uint8)": np.uint8}


def nvidia_smi(fields: str) -> str:
    """`nvidia-smi --query-gpu=<fields>` as CSV without header or units, or "?" where it cannot run."""
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        return subprocess.run(query, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def zeros_feed(session: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    """Zeros for every input, symbolic dimensions set to `batch`."""
    feed = {}
    for node in session.get_inputs():
        shape = [dim if isinstance(dim, int) else batch for dim in node.shape]
        feed[node.name] = np.zeros(shape, dtype=_DTYPES[node.type])
    return feed


def node_placement(model: Path | bytes) -> Counter[str]:
    """Nodes per execution provider in one profiled CUDA-first run of the model at batch 4."""
    with tempfile.TemporaryDirectory(prefix="facesearch-gpu-profile-") as directory:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(directory) / "profile")
        source = str(model) if isinstance(model, Path) else model
        session = ort.InferenceSession(source, sess_options=options, providers=list(CUDA_FIRST))
        session.run(None, zeros_feed(session, 4))
        events = json.loads(Path(session.end_profiling()).read_text())
    placed = {
        event["name"]: event["args"]["provider"]
        for event in events
        if event.get("cat") == "Node" and "provider" in event.get("args", {})
    }
    return Counter(placed.values())


def placement_rows(config: ModelConfig) -> list[list[str]]:
    models: list[tuple[str, Path | bytes]] = [
        ("YuNet detector", converted("yunet_2023mar_int8bq", config.models_dir)),
        ("dlib ResNet descriptor", converted("dlib_resnet_v1", config.models_dir)),
        ("SFace descriptor", converted("sface_2021dec_int8bq", config.models_dir)),
        ("faceres-deep age", converted("faceres_deep", config.models_dir)),
    ]
    rows = []
    for name, model in models:
        counts = node_placement(model)
        other = {provider: n for provider, n in counts.items() if provider != "CUDAExecutionProvider"}
        rows.append(
            [
                name,
                str(counts["CUDAExecutionProvider"]),
                ", ".join(f"{p}: {n}" for p, n in other.items()) or "0",
            ]
        )
    return rows


def model_rows(analyzer: FaceAnalyzer, images: Sequence[np.ndarray], repeats: int) -> list[list[str]]:
    detections = analyzer.detect(images)
    crops = [analyzer.align_and_crop(image, found) for image, found in zip(images, detections, strict=True)]
    dlib_chips = np.concatenate([c.descriptor_chips for c in crops if c.descriptor_chips is not None])
    sface_chips = np.concatenate([c.sface_chips for c in crops if c.sface_chips is not None])
    age_views = np.concatenate([c.age_views for c in crops if c.age_views is not None])
    prepared = [analyzer.detector.prepare(to_rgb(image)) for image in images]
    v2 = analyzer.embedder
    assert isinstance(v2, FusedEmbedder)  # the stages of face model v2
    rows = []
    for batch in BATCH_SIZES:
        batch_prepared = [prepared[i % len(prepared)] for i in range(batch)]
        stages = [
            ("detection (YuNet 640 px), images/s", analyzer.detector.detect_prepared, batch_prepared),
            ("dlib descriptor, faces/s", v2.dlib.embed, tile_to(dlib_chips, batch)),
            ("SFace descriptor, faces/s", v2.sface.embed, tile_to(sface_chips, batch)),
            ("age (faceres-deep), faces/s", analyzer.age_estimator.estimate, tile_to(age_views, batch)),
        ]
        for stage, run, argument in stages:
            seconds = best_seconds(run, argument, repeats)  # type: ignore[arg-type]
            rows.append([stage, str(batch), f"{batch / seconds:.0f}", f"{1000 * seconds:.2f}"])
    return rows


def staged_pass(
    analyzer: FaceAnalyzer, images: Sequence[np.ndarray], batch: int
) -> tuple[float, dict[str, float]]:
    """Wall seconds of one pass over the images, `batch` per call, and seconds per stage (and of CPU)."""
    stages: dict[str, float] = dict.fromkeys(STAGES, 0.0)
    cpu_started, started = time.process_time(), time.perf_counter()
    for first in range(0, len(images), batch):
        chunk = images[first : first + batch]
        clock = time.perf_counter()
        detections = analyzer.detect(chunk)
        stages["detect"] += time.perf_counter() - clock
        clock = time.perf_counter()
        crops = [
            analyzer.align_and_crop(image, found) for image, found in zip(chunk, detections, strict=True)
        ]
        stages["align+crop"] += time.perf_counter() - clock
        dlib_sets = [c.descriptor_chips for c in crops if c.descriptor_chips is not None]
        sface_sets = [c.sface_chips for c in crops if c.sface_chips is not None]
        age_sets = [c.age_views for c in crops if c.age_views is not None]
        clock = time.perf_counter()
        if dlib_sets:
            analyzer.embedder.embed(np.concatenate(dlib_sets), np.concatenate(sface_sets))
        stages["embed"] += time.perf_counter() - clock
        clock = time.perf_counter()
        if age_sets:
            analyzer.age_estimator.estimate(np.concatenate(age_sets))
        stages["age"] += time.perf_counter() - clock
    stages["CPU"] = time.process_time() - cpu_started
    return time.perf_counter() - started, stages


def pipeline_rows(
    label: str, analyzer: FaceAnalyzer, images: Sequence[np.ndarray], batches: Sequence[int]
) -> list[list[str]]:
    rows = []
    for batch in batches:
        for run in ("first pass", "second pass"):
            seconds, stages = staged_pass(analyzer, images, batch)
            per_image = [f"{1000 * stages[stage] / len(images):.1f}" for stage in (*STAGES, "CPU")]
            rows.append([label, str(batch), run, f"{len(images) / seconds:.1f}", *per_image])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faces-dev", type=Path, default=None, help="labelled dev photos (default: shared)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model and batch size")
    parser.add_argument("--pipeline-batches", type=int, nargs="+", default=[8, 32], help="images per call")
    parser.add_argument("--cpu-threads", type=int, default=1, help="intra-op threads of the CPU pipeline")
    args = parser.parse_args(argv)

    images = [to_rgb(load_image(item.path)) for item in load_faces_dev(args.faces_dev).images]
    print(f"# Machine\nGPU: {nvidia_smi('name,driver_version,memory.total')}\nCPU cores: {os.cpu_count()}")
    print(f"onnxruntime {ort.__version__}, available providers: {ort.get_available_providers()}")

    config = ModelConfig(provider_preference=CUDA_FIRST)  # CUDA first is a requirement: no quiet fallback
    analyzer = load_face_analyzer(config)
    print(f"GPU memory used with the four sessions loaded: {nvidia_smi('memory.used')} MiB")
    print("\n# Node placement (ONNX Runtime profiler, one run at batch 4)")
    print(format_table(["model", "nodes on CUDA", "nodes elsewhere"], placement_rows(config)))

    print(f"\n# Models on CUDA (best of {args.repeats}; batches cycle through the dev photos' real faces)")
    print(
        f"(each run padded or split to {config.gpu_image_run_size} images / {config.gpu_face_run_size} faces)"
    )
    print(
        format_table(
            ["stage", "batch", "per second", "ms per batch"], model_rows(analyzer, images, args.repeats)
        )
    )

    batches = args.pipeline_batches
    runs = f"runs of {config.gpu_image_run_size} images / {config.gpu_face_run_size} faces"
    rows = pipeline_rows(
        f"CUDA, {config.cuda_conv_algo_search} conv search, {runs}", analyzer, images, batches
    )
    cpu = load_face_analyzer(
        ModelConfig(intra_op_threads=args.cpu_threads, provider_preference=("CPUExecutionProvider",))
    )
    rows += pipeline_rows(f"CPU, {args.cpu_threads} intra-op thread(s)", cpu, images, batches)
    print(f"\n# Whole in-process pipeline, one process ({len(images)} dev photos per pass)")
    header = ["models on", "images/call", "pass", "images/s", *(f"{s} ms/image" for s in (*STAGES, "CPU"))]
    print(format_table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
