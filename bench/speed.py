"""Speed of the model layer on the dev photos, next to dlib-bin's own pipeline.

    python -m bench.speed [--faces-dev DIR] [--images N] [--repeats R]

Prints ms per image for detection, ms per face for the descriptor and the age model at batch 1, 16 and 64
with 1 and 2 intra-op threads, and images/s for the whole detect + align + embed + age pipeline next to the
reference pipeline of the `face_recognition` library (dlib HOG detector with upsample 1, 5-point shape
predictor, dlib.face_recognition_model_v1.compute_face_descriptor), which has no age step. Timings are the
minimum over repeats (micro-benchmarks) or one pass over the images (pipelines); cores may be shared, so
compare ratios from one run.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import dlib
import numpy as np

from bench.common import format_table, load_image
from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.arrays import to_rgb
from models.weights import resolve
from tests.faces_dev import load_faces_dev

_Arg = TypeVar("_Arg")

BATCH_SIZES = (1, 16, 64)
THREADS = (1, 2)


def best_seconds(run: Callable[[_Arg], object], argument: _Arg, repeats: int) -> float:
    """Minimum wall time of `repeats` calls, after one untimed call (first-shape allocations)."""
    run(argument)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(argument)
        times.append(time.perf_counter() - started)
    return min(times)


def tile_to(chips: np.ndarray, count: int) -> np.ndarray:
    """`count` chips taken cyclically from the real ones, so every batch holds real faces."""
    return chips[np.arange(count) % len(chips)]


def dlib_reference(images: Sequence[np.ndarray]) -> tuple[float, int]:
    """Seconds and faces for face_recognition's pipeline: HOG upsample 1, 5 landmarks, one descriptor each."""
    detector = dlib.get_frontal_face_detector()
    predictor = dlib.shape_predictor(str(resolve("dlib_shape5")))
    recognizer = dlib.face_recognition_model_v1(str(resolve("dlib_resnet_v1")))
    faces = 0
    started = time.perf_counter()
    for image in images:
        for box in detector(image, 1):
            shape = predictor(image, box)
            recognizer.compute_face_descriptor(image, shape, 1)
            faces += 1
    return time.perf_counter() - started, faces


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ours(analyzer: FaceAnalyzer, images: Sequence[np.ndarray], batch: int) -> tuple[float, int, float]:
    """(wall seconds, faces found, CPU seconds of this process) for the whole pipeline over the images."""
    faces = 0
    cpu_started = process_cpu_seconds()
    started = time.perf_counter()
    for start in range(0, len(images), batch):
        faces += sum(map(len, analyzer.analyze(images[start : start + batch])))
    return time.perf_counter() - started, faces, process_cpu_seconds() - cpu_started


def time_models(
    analyzer: FaceAnalyzer, images: Sequence[np.ndarray], repeats: int
) -> tuple[list[tuple[str, str]], int]:
    """(stage, time) rows for detection, descriptor and age at each batch size; and the number of faces."""
    detect_s = sum(best_seconds(analyzer.detect, [image], 1) for image in images)
    rows = [("detection (YuNet, batch 1), ms/image", f"{1000 * detect_s / len(images):.2f}")]
    # Chips of every face in the photos, cut by the production cropper; batches cycle through them.
    detections = analyzer.detect(images)
    crops = [analyzer.align_and_crop(image, found) for image, found in zip(images, detections, strict=True)]
    descriptor_chips = np.concatenate([c.descriptor_chips for c in crops if c.descriptor_chips is not None])
    sface_chips = np.concatenate([c.sface_chips for c in crops if c.sface_chips is not None])
    age_chips = np.concatenate([c.age_views for c in crops if c.age_views is not None])
    for batch in BATCH_SIZES:
        dlib_batch, sface_batch = tile_to(descriptor_chips, batch), tile_to(sface_chips, batch)
        seconds = best_seconds(analyzer.embedder.dlib.embed, dlib_batch, repeats)
        rows.append((f"dlib descriptor, batch {batch}, ms/face", f"{1000 * seconds / batch:.2f}"))
        seconds = best_seconds(analyzer.embedder.sface.embed, sface_batch, repeats)
        rows.append((f"SFace fp32, batch {batch}, ms/face", f"{1000 * seconds / batch:.2f}"))
    for batch in BATCH_SIZES:
        seconds = best_seconds(analyzer.age_estimator.estimate, tile_to(age_chips, batch), repeats)
        rows.append(
            (f"age ({age_chips.shape[1]} views), batch {batch}, ms/face", f"{1000 * seconds / batch:.2f}")
        )
    return rows, len(descriptor_chips)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faces-dev", type=Path, default=None, help="labelled dev photos (default: shared)")
    parser.add_argument("--images", type=int, default=0, help="use only the first N photos (0: all)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per micro-benchmark")
    parser.add_argument("--pipeline-batch", type=int, default=8, help="images per analyze() call")
    args = parser.parse_args(argv)

    dev = load_faces_dev(args.faces_dev)
    labelled = list(dev.images)[: args.images or None]
    images = [to_rgb(load_image(item.path)) for item in labelled]

    model_rows: list[list[str]] = []
    pipeline: dict[tuple[int, bool], tuple[float, int, float]] = {}
    faces = 0
    for threads in THREADS:
        analyzer = load_face_analyzer(ModelConfig(intra_op_threads=threads))
        rows, faces = time_models(analyzer, images, args.repeats)
        model_rows += [[stage, str(threads), value] for stage, value in rows]
        pipeline[threads, False] = ours(analyzer, images, args.pipeline_batch)
    # ONNX Runtime's own default, busy-waiting intra-op threads, for comparison in the same run.
    spinning = load_face_analyzer(ModelConfig(intra_op_threads=max(THREADS), allow_spinning=True))
    ours(spinning, images[:8], args.pipeline_batch)
    pipeline[max(THREADS), True] = ours(spinning, images, args.pipeline_batch)

    print(f"# Models ({len(images)} photos, {faces} faces)")
    print(format_table(["stage", "threads", "time"], model_rows))

    reference_s, reference_faces = dlib_reference(images)
    reference_rate = len(images) / reference_s
    pipeline_rows = [
        [
            "dlib-bin reference (HOG up 1 + shape5 + ResNet)",
            "1",
            str(reference_faces),
            f"{reference_s:.2f}",
            f"{reference_rate:.2f}",
            "",
            "1.00x",
        ]
    ]
    for (threads, spin), (seconds, found, cpu_seconds) in pipeline.items():
        rate = len(images) / seconds
        pipeline_rows.append(
            [
                f"ours (YuNet + shape5 + ResNet + SFace + age, {args.pipeline_batch} images/call)"
                + (", ORT spinning on" if spin else ""),
                str(threads),
                str(found),
                f"{seconds:.2f}",
                f"{rate:.2f}",
                f"{cpu_seconds / len(images) * 1000:.1f}",
                f"{rate / reference_rate:.2f}x",
            ]
        )
    print(f"\n# Whole pipeline ({len(images)} photos)")
    header = ["pipeline", "threads", "faces", "seconds", "images/s", "CPU ms/image", "speed-up"]
    print(format_table(header, pipeline_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
