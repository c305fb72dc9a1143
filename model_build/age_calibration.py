"""Build models/age_calibration.json: faceres-deep's monotone correction and the under_18 / under_21 bands.

    python -m model_build.age_calibration [--photos DIR] [--threads N] [--out FILE]

Reads the labelled photo sets under DIR (default: the directory holding FACES_DEV_DIR, by default
../shared/testdata next to the checkout): faces-calib's age crops (UTKFace, true ages 5-70) and the 0-2 and
70+ photos of faces-wild (FairFace, perceived-age groups), which stand in for ages 1 and 75 at the ends of
the correction. The photos are never part of the repository, so this runs from a checkout, never at
install. Each photo's largest face goes through the shipped detector and faceres-deep with the service's
views; the correction is an isotonic fit of true age on the raw estimate, and the bands are chosen on
faces-calib alone (fit_bands). About a minute on two cores. `python -m bench.age` then reports what the
calibrated rule decides; `python -m bench.age --calibrate-interval` fits models/age_interval.json on top.
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

# Distance kept between the oldest-looking calib minor's corrected estimate and the 0 band (years), so a face
# a little older-looking than any calib minor still gets 50.
ADULT_CUT_MARGIN = 1.0
# under_21's 0 band: at most this share of calib faces aged 18-20 may fall in it (issue 23's tolerance for an
# age group that holds people just under the limit); no face under 18 ever does (it starts at or above
# under_18's band).
YOUNG_ADULT_CLEARED_SHARE = 0.01
# Share of calib faces at or over the limit that may get 100 ("under the limit").
MINOR_BAND_ADULT_SHARE = 0.01
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
    """Monotone correction (isotonic, interpolated linearly between block centres) and bands. The correction
    is fitted on faces-calib (raw, ages) plus the ends (end_raw, end_ages: faces-wild's 0-2 and 70+ photos,
    ages calib lacks, so a baby or a 75-year-old can be estimated in their own decade); the bands on
    faces-calib alone."""
    keep = ~np.isnan(raw)
    raw, ages = raw[keep], ages[keep]
    fit_raw, fit_ages = raw, ages.astype(np.float64)
    if end_raw is not None and end_ages is not None:
        ends = ~np.isnan(end_raw)
        fit_raw = np.concatenate([raw, end_raw[ends]])
        fit_ages = np.concatenate([fit_ages, end_ages[ends].astype(np.float64)])
    knots_x, knots_y = isotonic(fit_raw, fit_ages)
    corrected = np.interp(raw, knots_x, knots_y)
    bands, checks = fit_bands(corrected, ages)
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
        "bands": bands,
        "checks": checks,
    }


def fit_bands(corrected: np.ndarray, ages: np.ndarray) -> tuple[dict[str, float], dict[str, object]]:
    """The under_18 / under_21 bands on corrected calib estimates, and the numbers that justify them.

    100 only below the estimate that MINOR_BAND_ADULT_SHARE of calib faces at or over the limit fall under
    (never above the limit). under_18 = 0 only above every calib face under 18, with ADULT_CUT_MARGIN: no
    child is ever cleared. under_21 = 0 from the same cut, unless more than YOUNG_ADULT_CLEARED_SHARE of the
    calib faces aged 18-20 would then be cleared; then from just above the estimates of all but that share
    of them (plus the margin). The oldest-looking face under 21 no longer sets under_21's cut alone: in
    faces-calib it is one 20-year-old at 35.2, 3.7 years above the next (docs/age.md)."""
    minor_below = {
        limit: round(
            min(float(np.quantile(corrected[ages >= limit], MINOR_BAND_ADULT_SHARE)), float(limit)), 2
        )
        for limit in (18, 21)
    }
    oldest_child = float(corrected[ages < 18].max())
    under_18_cut = round(oldest_child + ADULT_CUT_MARGIN, 2)
    young = np.sort(corrected[(ages >= 18) & (ages < 21)])[::-1]
    allowed = int(np.floor(YOUNG_ADULT_CLEARED_SHARE * len(young)))
    # Estimates strictly above young[allowed] are at most `allowed` faces; the margin keeps the cut off them.
    young_cut = float(young[allowed]) + ADULT_CUT_MARGIN if len(young) > allowed else 0.0
    bands = {
        "under_18_minor_below": minor_below[18],
        "under_18_adult_from": under_18_cut,
        "under_21_minor_below": minor_below[21],
        "under_21_adult_from": round(max(under_18_cut, young_cut), 2),
    }
    checks: dict[str, object] = {
        "oldest_estimate_under_18": round(oldest_child, 3),
        "faces_18_to_20": len(young),
        "cleared_share_18_to_20_at_most": YOUNG_ADULT_CLEARED_SHARE,
        # The highest estimates of calib faces aged 18-20, one more than may be cleared: a test recounts them.
        "highest_estimates_18_to_20": [round(float(v), 3) for v in young[: allowed + 1]],
    }
    return bands, checks


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
    stub = age_v2.AgeCalibration((0.0, 100.0), (0.0, 100.0), age_v2.AgeBands(16, 34, 19, 37))
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
    print(f"wrote {args.out}: bands {fitted['bands']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
