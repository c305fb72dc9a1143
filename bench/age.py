"""Age benchmark: age-v1 against faceres-deep (age-v2) by true-age band, on faces-calib and faces-dev.

    python -m bench.age                  # the age table for both models on both sets, and ms/face
    python -m bench.age --choose-views   # faceres-deep crop margins x mirror on faces-calib (MAE, bias)
    python -m bench.age --calibrate      # fit the correction and bands on faces-calib, write
                                         # models/age_calibration.json, then print the tables

The face box is the largest YuNet face of each photo, as in the service. Model outputs are cached per
photo set and view under var/bench-cache/age (keyed by the model files' hashes), so reruns are fast.
Choices are made on faces-calib only; faces-dev is reported, never fitted.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import format_table, load_image
from models import age_v2
from models.age import AgeEstimator, age_chip_views
from models.age_policy import COMPARABLE_AREA_RATIO, several_comparable_faces
from models.align import FaceAligner
from models.arrays import to_rgb
from models.detector import DetectorOptions, FaceDetector
from models.quality import assess_image_faces
from models.sessions import SessionOptions
from models.weights import NPM_WEIGHTS, WEIGHTS, resolve
from tests.faces_dev import REPO_ROOT, load_faces_dev

CALIB_DIR = REPO_ROOT.parent / "shared" / "testdata" / "faces-calib"
CACHE_DIR = REPO_ROOT / "var" / "bench-cache" / "age"
GROUPS: tuple[tuple[int, int], ...] = ((5, 11), (12, 17), (18, 20), (21, 25), (26, 40), (41, 70))
CANDIDATE_MARGINS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3)
# Distance kept between the oldest-looking calib minor's corrected estimate and the 0 band (years), so a face
# a little older-looking than any calib minor still gets 50.
ADULT_CUT_MARGIN = 1.0
# Share of calib faces at or over the limit that may get 100 ("under the limit").
MINOR_BAND_ADULT_SHARE = 0.01


@dataclass(frozen=True)
class PhotoSet:
    name: str
    paths: tuple[Path, ...]
    ages: np.ndarray  # int, true ages


def calib_set(root: Path = CALIB_DIR) -> PhotoSet:
    with (root / "labels.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["kind"] == "age"]
    return PhotoSet(
        "faces-calib", tuple(root / r["file"] for r in rows), np.array([int(r["age"]) for r in rows])
    )


def dev_set() -> PhotoSet:
    items = [item for item in load_faces_dev().of_kind("age") if item.age is not None]
    return PhotoSet("faces-dev", tuple(i.path for i in items), np.array([int(i.age or 0) for i in items]))


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _cached(name: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
    path = CACHE_DIR / f"{name}.npy"
    if path.is_file():
        return np.load(path)
    value = np.asarray(compute())
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    np.save(path, value)
    return value


def detections(photos: PhotoSet, detector: FaceDetector) -> np.ndarray:
    """[N, 4] box of the largest face per photo (NaN where none), cached."""

    def compute() -> np.ndarray:
        boxes = np.full((len(photos.paths), 4), np.nan, dtype=np.float32)
        for index, path in enumerate(photos.paths):
            faces = detector.detect([to_rgb(load_image(path))])[0]
            if faces:
                boxes[index] = max(faces, key=lambda face: face.area).box
        return boxes

    return _cached(f"{photos.name}-boxes-{_key([str(p) for p in photos.paths])}", compute)


def subject_checks(photos: PhotoSet, detector: FaceDetector) -> np.ndarray:
    """[N, 2] per photo: (several comparable faces, subject passes the quality gate) as 0/1, cached."""

    def compute() -> np.ndarray:
        out = np.zeros((len(photos.paths), 2))
        for index, path in enumerate(photos.paths):
            rgb = to_rgb(load_image(path))
            faces = detector.detect([rgb])[0]
            if not faces:
                continue
            subject = max(faces, key=lambda face: face.area)
            (quality,) = assess_image_faces(rgb, [subject])
            out[index] = (several_comparable_faces(subject, faces), quality.enrol_ok)
        return out

    return _cached(
        f"{photos.name}-checks-{_key([str(p) for p in photos.paths], COMPARABLE_AREA_RATIO)}", compute
    )


def v2_probabilities(
    photos: PhotoSet, boxes: np.ndarray, estimator: age_v2.FaceresAgeEstimator, margin: float, mirrored: bool
) -> np.ndarray:
    """[N, 100] faceres-deep output for one view (margin, mirrored or not); NaN rows where no face."""

    def compute() -> np.ndarray:
        out = np.full((len(photos.paths), 100), np.nan)
        for index, path in enumerate(photos.paths):
            if np.isnan(boxes[index]).any():
                continue
            views = age_v2.face_views(to_rgb(load_image(path)), [boxes[index]], (margin,), mirror=True)
            out[index] = estimator.probabilities(views[:, 1:2] if mirrored else views[:, 0:1])[0]
        return out

    spec = NPM_WEIGHTS[age_v2.WEIGHT_NAME]
    name = (
        f"{photos.name}-v2-m{margin:g}-{'flip' if mirrored else 'plain'}-{_key(spec.files, str(boxes.sum()))}"
    )
    return _cached(name, compute)


def v1_estimates(photos: PhotoSet, boxes: np.ndarray, detector: FaceDetector) -> np.ndarray:
    """[N, 3] age-v1 (expected age, under_18, under_21) with its recipe (dlib chips 0.1 + mirror)."""
    aligner = FaceAligner(resolve("dlib_shape5"))
    estimator = AgeEstimator(resolve("age_v1"), SessionOptions(intra_op_threads=1))

    def compute() -> np.ndarray:
        out = np.full((len(photos.paths), 3), np.nan)
        for index, path in enumerate(photos.paths):
            rgb = to_rgb(load_image(path))
            faces = detector.detect([rgb])[0]
            if not faces:
                continue
            shapes = aligner.shapes(rgb, [max(faces, key=lambda face: face.area)])
            views = age_chip_views([aligner.chips(rgb, shapes, 64, 0.1)], mirror=True)
            estimate = estimator.estimate(views)[0]
            out[index] = (estimate.expected_age, estimate.under_18, estimate.under_21)
        return out

    return _cached(
        f"{photos.name}-v1-{_key(WEIGHTS['age_v1'].sha256, [str(p) for p in photos.paths])}", compute
    )


def _raw_estimates(probabilities: Sequence[np.ndarray]) -> np.ndarray:
    return np.mean(probabilities, axis=0) @ age_v2.AGE_CLASS_VALUES


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


def fit_calibration(raw: np.ndarray, ages: np.ndarray) -> dict[str, object]:
    """Monotone correction (isotonic, interpolated linearly between block centres) and bands."""
    keep = ~np.isnan(raw)
    raw, ages = raw[keep], ages[keep]
    knots_x, knots_y = isotonic(raw, ages.astype(np.float64))
    corrected = np.interp(raw, knots_x, knots_y)
    bands: dict[str, float] = {}
    checks: dict[str, float] = {}
    for limit in (18, 21):
        younger, older = corrected[ages < limit], corrected[ages >= limit]
        # 0 only above every calib face younger than the limit, with a margin; 100 only below the estimate
        # that MINOR_BAND_ADULT_SHARE of calib faces at or over the limit fall under (never above the limit).
        worst = float(younger.max())
        bands[f"under_{limit}_minor_below"] = round(
            min(float(np.quantile(older, MINOR_BAND_ADULT_SHARE)), float(limit)), 2
        )
        bands[f"under_{limit}_adult_from"] = round(worst + ADULT_CUT_MARGIN, 2)
        checks[f"oldest_estimate_under_{limit}"] = round(worst, 3)
    bands["under_21_adult_from"] = max(bands["under_21_adult_from"], bands["under_18_adult_from"])
    return {
        "generated_by": "python -m bench.age --calibrate (faces-calib UTKFace age crops)",
        "faces": int(keep.sum()),
        "views": {"margins": list(age_v2.FACE_MARGINS), "mirror": age_v2.FACE_MIRROR},
        "correction": {
            "raw": [round(float(v), 3) for v in knots_x],
            "corrected": [round(float(v), 3) for v in knots_y],
        },
        "bands": bands,
        "checks": checks,
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


def band_table(rows: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> str:
    """rows: (label, true ages, estimates, under_18, under_21) -> MAE / bias / flag shares per group."""
    table = []
    for label, ages, estimates, u18, u21 in rows:
        found = ~np.isnan(estimates)
        for low, high in ((0, 200), *GROUPS):
            sel = found & (ages >= low) & (ages <= high)
            if not sel.any():
                continue
            error = estimates[sel] - ages[sel]
            shares = [
                f"{100 * np.mean(flags[sel] == value):.0f}" if (flags[sel] >= 0).all() else "-"
                for flags in (u18, u21)
                for value in (0, 50, 100)
            ]
            table.append(
                [
                    label,
                    "all" if high == 200 else f"{low}-{high}",
                    str(int(sel.sum())),
                    f"{np.abs(error).mean():.2f}",
                    f"{error.mean():+.2f}",
                    *shares,
                ]
            )
    header = ["model / set", "true age", "faces", "MAE", "bias"]
    header += [f"u18={v} %" for v in (0, 50, 100)] + [f"u21={v} %" for v in (0, 50, 100)]
    return format_table(header, table)


def choose_views(photos: PhotoSet, boxes: np.ndarray, estimator: age_v2.FaceresAgeEstimator) -> str:
    rows = []
    for margin in CANDIDATE_MARGINS:
        plain = v2_probabilities(photos, boxes, estimator, margin, False)
        flip = v2_probabilities(photos, boxes, estimator, margin, True)
        for label, probabilities in (("", [plain]), (" + mirror", [plain, flip])):
            raw = _raw_estimates(probabilities)
            found = ~np.isnan(raw)
            error = raw[found] - photos.ages[found]
            minors = found & (photos.ages < 18)
            adults = found & (photos.ages > 25)
            worst_minor = float(raw[minors].max())
            cleared = float(np.mean(raw[adults] >= worst_minor + ADULT_CUT_MARGIN))
            rows.append(
                [
                    f"{margin:g}{label}",
                    f"{np.abs(error).mean():.2f}",
                    f"{error.mean():+.2f}",
                    f"{worst_minor:.1f}",
                    f"{100 * cleared:.0f}",
                ]
            )
    return format_table(
        ["margin", "MAE (raw)", "bias", "worst minor (raw)", "adults >25 above it + 1 y (%)"], rows
    )


def ms_per_face(estimator: age_v2.FaceresAgeEstimator, v1: AgeEstimator, batch: int = 16) -> list[list[str]]:
    rng = np.random.default_rng(0)
    rows = []
    views2 = rng.integers(0, 256, (batch, age_v2.VIEWS_PER_FACE, 224, 224, 3), dtype=np.uint8)
    views1 = rng.integers(0, 256, (batch, 2, 64, 64, 3), dtype=np.uint8)
    for label, function, views in (
        ("age-v1 (2 views of 64 px)", v1.estimate, views1),
        (f"age-v2 faceres-deep ({age_v2.VIEWS_PER_FACE} view(s) of 224 px)", estimator.estimate, views2),
    ):
        function(views)
        best = min(_timed(function, views) for _ in range(3))
        rows.append([label, f"{1000 * best / batch:.1f}"])
    return rows


def _timed(function: Callable[[np.ndarray], object], views: np.ndarray) -> float:
    started = time.perf_counter()
    function(views)
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.age", description=__doc__.split("\n\n")[0])
    parser.add_argument("--choose-views", action="store_true")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    args = parser.parse_args(argv)

    options = SessionOptions(intra_op_threads=args.threads)
    detector = FaceDetector(resolve("yunet_2023mar_int8bq"), DetectorOptions(), options)
    calibration_stub = age_v2.AgeCalibration((0.0, 100.0), (0.0, 100.0), age_v2.AgeBands(16, 34, 19, 37))
    estimator = age_v2.FaceresAgeEstimator(age_v2.ensure_faceres_model(), options, calibration_stub)
    calib, dev = calib_set(), dev_set()
    calib_boxes, dev_boxes = detections(calib, detector), detections(dev, detector)
    print(
        f"faces found: calib {int((~np.isnan(calib_boxes[:, 0])).sum())}/{len(calib.paths)}, "
        f"dev {int((~np.isnan(dev_boxes[:, 0])).sum())}/{len(dev.paths)}\n"
    )

    if args.choose_views:
        print("# faceres-deep views on faces-calib (raw estimate, before correction)")
        print(choose_views(calib, calib_boxes, estimator) + "\n")
        return 0

    def raw_of(photos: PhotoSet, boxes: np.ndarray) -> np.ndarray:
        probabilities = []
        for margin in age_v2.FACE_MARGINS:
            probabilities.append(v2_probabilities(photos, boxes, estimator, margin, False))
            if age_v2.FACE_MIRROR:
                probabilities.append(v2_probabilities(photos, boxes, estimator, margin, True))
        return _raw_estimates(probabilities)

    calib_raw, dev_raw = raw_of(calib, calib_boxes), raw_of(dev, dev_boxes)
    if args.calibrate:
        fitted = fit_calibration(calib_raw, calib.ages)
        correction = fitted["correction"]
        assert isinstance(correction, dict)
        correction["raw"], correction["corrected"] = _dedupe_knots(correction["raw"], correction["corrected"])
        age_v2.CALIBRATION_FILE.write_text(json.dumps(fitted, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {age_v2.CALIBRATION_FILE}: bands {fitted['bands']}\n")

    calibration = age_v2.AgeCalibration.load()
    bands = calibration.bands
    rows = []
    for photos, boxes, raw in ((calib, calib_boxes, calib_raw), (dev, dev_boxes, dev_raw)):
        v1 = v1_estimates(photos, boxes, detector)
        rows.append((f"age-v1 / {photos.name}", photos.ages, v1[:, 0], v1[:, 1], v1[:, 2]))
        corrected = np.array([np.nan if np.isnan(r) else calibration.correct(r) for r in raw])
        u18 = np.array([-1 if np.isnan(c) else bands.under_18(c) for c in corrected])
        u21 = np.array([-1 if np.isnan(c) else bands.under_21(c) for c in corrected])
        no_flags = np.full(len(raw), -1)
        rows.append((f"age-v2 uncorrected / {photos.name}", photos.ages, raw, no_flags, no_flags))
        rows.append((f"age-v2 bands only / {photos.name}", photos.ages, corrected, u18, u21))
        # The service's safety rules: a 0 becomes 50 with several comparable faces or a failed quality gate.
        checks = subject_checks(photos, detector)
        withheld = (checks[:, 0] == 1) | (checks[:, 1] == 0)
        u18 = np.where(withheld & (u18 == 0), 50, u18)
        u21 = np.where(withheld & (u21 == 0), 50, u21)
        rows.append((f"age-v2 / {photos.name}", photos.ages, corrected, u18, u21))
        minors = photos.ages < 18
        found = ~np.isnan(corrected)
        print(
            f"{photos.name}: subjects failing the quality gate {int(np.sum(found & (checks[:, 1] == 0)))}, "
            f"with comparable faces {int(np.sum(found & (checks[:, 0] == 1)))} of {int(found.sum())}; "
            f"minors given under_18 = 0: {int(np.sum(minors & (u18 == 0)))}; under 21 given under_21 = 0: "
            f"{int(np.sum((photos.ages < 21) & (u21 == 0)))}; adults over 25 given under_18 = 50: "
            f"{100 * np.mean(u18[photos.ages > 25] == 50):.1f} % (bands only: "
            f"{100 * np.mean(rows[-2][3][photos.ages > 25] == 50):.1f} %)"
        )
    print(f"\nbands: {bands}\n")
    print("# Age by true-age group (MAE, bias in years; flag shares in % of the group)")
    print(band_table(rows) + "\n")
    print("# Model time, batch 16, ms/face")
    v1_model = AgeEstimator(resolve("age_v1"), options)
    print(format_table(["model", "ms/face"], ms_per_face(estimator, v1_model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
