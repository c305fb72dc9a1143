"""A recognition model the operator brings, checked with a real one: SFace behind the ArcFace input
convention (tests/wrapped_sface.py), served through the operator-model path (FACESEARCH_FACE_MODEL_*:
the registry entry, the session factory, ArcFace chips from the detector's landmarks, (x - 127.5) / 127.5),
against SFace alone, on faces-calib's identity photos.

    python -m bench.operator_model [--threads N] [--faces-calib DIR]

SFace alone: bench.identification's embeddings (SFace on the 112 px chip of the largest face). Wrapped: the
service's analysis (models.analyzer with the operator model as the face model) on the same photos. The two
must agree: the same TAR at FAR 1e-2 / 1e-3 / 1e-4, EER and 1:N figures (bench.identification's protocol),
and vectors equal to float precision.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.common import format_table, load_image
from bench.identification import (
    CALIB_DIR,
    FARS,
    FPIRS,
    PhotoSet,
    Variant,
    cosine,
    eer,
    extract,
    fnir_at_fpir,
    pair_scores,
    run_trial,
)
from models.analyzer import ModelConfig, load_face_analyzer
from models.calibration import threshold_at_rate
from models.face_model import OperatorFaceModel
from models.types import largest_face
from tests.faces_dev import LabelledImage, load_faces_dev
from tests.wrapped_sface import write_wrapped_sface


def wrapped_embeddings(images: Sequence[LabelledImage], model: OperatorFaceModel, threads: int) -> np.ndarray:
    analyzer = load_face_analyzer(ModelConfig(intra_op_threads=threads, face_model=model))
    vectors = np.zeros((len(images), model.dim), np.float32)
    started = time.perf_counter()
    for index, item in enumerate(images):
        face = largest_face(analyzer.analyze([load_image(item.path)], embed=True, estimate_age=False)[0])
        if face is not None and face.embedding is not None:
            vectors[index] = face.embedding
        if index % 300 == 299:
            print(f"  {index + 1}/{len(images)} photos, {time.perf_counter() - started:.0f} s", flush=True)
    return vectors


def row(name: str, vectors: np.ndarray, photos: PhotoSet) -> list[str]:
    variant = Variant(name, vectors, cosine)
    genuine, impostor = pair_scores(cosine(vectors, vectors), photos.identities, photos.found)
    tars = [f"{np.mean(genuine >= threshold_at_rate(impostor, far)):.4f}" for far in FARS]
    trial = run_trial(variant, photos.identities, photos.found)
    return [
        name,
        *tars,
        f"{100 * eer(genuine, impostor):.2f}%",
        f"{100 * np.mean(trial.mated_rank1):.1f}%",
        *[f"{100 * fnir_at_fpir(trial, fpir):.1f}%" for fpir in FPIRS],
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.operator_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--faces-calib", type=Path, default=CALIB_DIR)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    images = load_faces_dev(args.faces_calib).of_kind("identity")
    photos = extract(images, args.threads)
    with tempfile.TemporaryDirectory() as folder:
        path, sha256 = write_wrapped_sface(Path(folder))
        model = OperatorFaceModel(path=path, sha256=sha256, dim=128)
        started = time.perf_counter()
        wrapped = wrapped_embeddings(images, model, args.threads)
        seconds = time.perf_counter() - started
    found = photos.found
    difference = float(np.abs(wrapped[found] - photos.sface[found]).max())
    header = ["faces-calib", *(f"TAR@FAR {far:g}" for far in FARS), "EER", "rank-1"]
    header += [f"FNIR@FPIR {int(f * 100)}%" for f in FPIRS]
    print(
        f"{int(found.sum())}/{len(images)} photos with a face; wrapped SFace through the service path in "
        f"{seconds:.0f} s ({model.version}); largest |difference| of the vectors: {difference:.2e}\n"
        + format_table(
            header,
            [
                row("SFace alone", photos.sface, photos),
                row("SFace wrapped, operator-model path", wrapped, photos),
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
