"""Build models/age_calibration.json: faceres-deep's monotone correction of its estimate.

    python -m model_build.age_calibration [--photos DIR] [--threads N] [--out FILE]

Reads the labelled photo sets under DIR (default: the directory holding FACES_DEV_DIR, by default
../shared/testdata next to the checkout): faces-calib's age crops (UTKFace, true ages 5-70) and the 0-2 and
70+ photos of faces-wild (FairFace, perceived-age groups), which stand in for ages 1 and 75 at the ends of
the correction. The photos are never part of the repository, so this runs from a checkout, never at
install. Each photo's largest face goes through the shipped detector and faceres-deep with the service's
views; the correction is an isotonic fit of true age on the raw estimate. About a minute on two cores.
`python -m bench.age` then reports what the calibrated rule decides; `python -m bench.age
--calibrate-interval` fits models/age_interval.json on top.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from models import age_v2
from models.detector import DetectorOptions, FaceDetector
from models.sessions import SessionOptions
from models.weights import converted, resolve

# faces-wild's groups outside faces-calib's ages (by their lower bound) and the age each stands for.
WILD_END_AGES: dict[int, float] = {0: 1.0, 70: 75.0}


def default_photos_dir() -> Path:
    checkout = Path(__file__).resolve().parent.parent
    faces_dev = os.environ.get("FACES_DEV_DIR", str(checkout.parent / "shared" / "testdata" / "faces-dev"))
    return Path(faces_dev).parent


def labelled(labels: Path, keep: str, age_column: str) -> list[tuple[Path, int]]:
    """(photo, age) of the rows of a labels.csv whose `kind` is `keep` (every row when the file has no
    kind column)."""
    with labels.open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("kind", keep) == keep]
    return [(labels.parent / row["file"], int(row[age_column])) for row in rows]


def raw_estimates(
    photos: Sequence[Path], detector: FaceDetector, estimator: age_v2.FaceresAgeEstimator
) -> np.ndarray:
    """[N] faceres-deep's raw expected age of each photo's largest face (NaN where none was found)."""
    out = np.full(len(photos), np.nan)
    for index, path in enumerate(photos):
        with Image.open(path) as opened:
            rgb = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"), dtype=np.uint8)
        faces = detector.detect([rgb])[0]
        if faces:
            subject = max(faces, key=lambda face: face.area)
            probabilities = estimator.probabilities(age_v2.face_views(rgb, [subject.box]))[0]
            out[index] = float(probabilities @ age_v2.AGE_CLASS_VALUES)
    return out


def isotonic(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators fit of y on x (non-decreasing); returns knots (block mean x, block mean y)."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order].astype(np.float64)
    blocks: list[list[float]] = []  # [sum_x, sum_y, count]
    for xi, yi in zip(xs, ys, strict=True):
        blocks.append([xi, yi, 1.0])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            sx, sy, n = blocks.pop()
            blocks[-1] = [blocks[-1][0] + sx, blocks[-1][1] + sy, blocks[-1][2] + n]
    knots_x = np.array([b[0] / b[2] for b in blocks])
    knots_y = np.array([b[1] / b[2] for b in blocks])
    return knots_x, knots_y


def fit_calibration(
    raw: np.ndarray, ages: np.ndarray, end_raw: np.ndarray | None = None, end_ages: np.ndarray | None = None
) -> dict[str, object]:
    """Monotone correction (isotonic, interpolated linearly between block centres), fitted on faces-calib
    (raw, ages) plus the ends (end_raw, end_ages: faces-wild's 0-2 and 70+ photos, ages calib lacks, so a
    baby or a 75-year-old can be estimated in their own decade)."""
    keep = ~np.isnan(raw)
    raw, ages = raw[keep], ages[keep]
    fit_raw, fit_ages = raw, ages.astype(np.float64)
    if end_raw is not None and end_ages is not None:
        ends = ~np.isnan(end_raw)
        fit_raw = np.concatenate([raw, end_raw[ends]])
        fit_ages = np.concatenate([fit_ages, end_ages[ends].astype(np.float64)])
    knots_x, knots_y = isotonic(fit_raw, fit_ages)
    return {
        "generated_by": "python -m model_build.age_calibration (faces-calib UTKFace age crops; the "
        "correction's ends also from faces-wild's 0-2 and 70+ photos as ages 1 and 75)",
        "faces": int(keep.sum()),
        "end_faces": int(len(fit_raw) - keep.sum()),
        "views": {"margins": list(age_v2.FACE_MARGINS), "mirror": age_v2.FACE_MIRROR},
        "correction": {
            "raw": [round(float(v), 3) for v in knots_x],
            "corrected": [round(float(v), 3) for v in knots_y],
        },
    }


def _dedupe_knots(raw: list[float], corrected: list[float]) -> tuple[list[float], list[float]]:
    out_x: list[float] = []
    out_y: list[float] = []
    for x, y in zip(raw, corrected, strict=True):
        if out_x and x <= out_x[-1]:
            continue
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_build.age_calibration", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--photos", type=Path, default=None, help="holds faces-calib/ and faces-wild/")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--out", type=Path, default=age_v2.CALIBRATION_FILE, help="the file to write")
    args = parser.parse_args(argv)
    root = args.photos or default_photos_dir()
    calib = labelled(root / "faces-calib" / "labels.csv", "age", "age")
    ends = [
        (path, low)
        for path, low in labelled(root / "faces-wild" / "labels.csv", "", "age_low")
        if low in WILD_END_AGES
    ]

    options = SessionOptions(intra_op_threads=args.threads)
    detector = FaceDetector(resolve("yunet_2023mar_int8bq"), DetectorOptions(), options)
    # The correction being fitted is not applied here: only the raw probabilities are read.
    stub = age_v2.AgeCalibration((0.0, 100.0), (0.0, 100.0))
    estimator = age_v2.FaceresAgeEstimator(converted("faceres_deep"), options, stub)
    fitted = fit_calibration(
        raw_estimates([path for path, _ in calib], detector, estimator),
        np.array([age for _, age in calib]),
        raw_estimates([path for path, _ in ends], detector, estimator),
        np.array([WILD_END_AGES[low] for _, low in ends]),
    )
    correction = fitted["correction"]
    assert isinstance(correction, dict)
    correction["raw"], correction["corrected"] = _dedupe_knots(correction["raw"], correction["corrected"])
    args.out.write_text(json.dumps(fitted, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(correction['raw'])} knots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
