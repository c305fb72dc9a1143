"""Age benchmark: faceres-deep's decisions (bands + safety rules, models.age_policy) per age group on
faces-wild (FairFace photos, perceived-age groups), faces-dev and faces-calib; age-v1 against faceres-deep.

    python -m bench.age                  # decision and MAE tables, what each quality check refuses, the
                                         # photos where a flag contradicts the label, model cost
    python -m bench.age --baseline-calibration OLD.json
                                         # adds "before" rows: that correction with the rules before
                                         # issue 23 (enrolment bar, any face of a quarter of the area)
    python -m bench.age --compare-calibration OLD.json
                                         # adds rows with today's rules and that file's correction and
                                         # bands, and the targets of issue 23 for both
    python -m bench.age --choose-views   # faceres-deep crop margins x mirror on faces-calib (MAE, bias)
    python -m bench.age --calibrate      # fit the correction (faces-calib + faces-wild's 0-2 and 70+) and
                                         # the bands (faces-calib), write models/age_calibration.json

Every face of every photo (detection, quality measurements, faceres-deep's output) is cached per photo set
under var/bench-cache/age (keyed by the photo list and model files), so trying rule variants costs no model
time. Bands are chosen on faces-calib; rules and the correction's ends on faces-wild (its rows are in-sample);
faces-dev is reported, never fitted. The other sets are found next to faces-dev (FACES_DEV_DIR).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.age_v1 import AGE_V1_WEIGHTS, AgeEstimator, age_chip_views, age_v1_path
from bench.common import format_table, load_image
from models import age_v2
from models.age_policy import AgeDecision, AgeReason, age_faces, decide_age
from models.align import FaceAligner
from models.arrays import to_rgb
from models.detector import DetectorOptions, FaceDetector
from models.quality import age_quality_failures, assess_image_faces, judge_quality, pose_from_landmarks
from models.sessions import SessionOptions
from models.types import AnalyzedFace, DetectedFace, FaceQuality
from models.weights import NPM_WEIGHTS, converted, resolve
from tests.faces_dev import REPO_ROOT, faces_dev_dir, load_faces_dev

# The other shared photo sets sit next to faces-dev (FACES_DEV_DIR moves all three).
CALIB_DIR = faces_dev_dir().parent / "faces-calib"
WILD_DIR = faces_dev_dir().parent / "faces-wild"
CACHE_DIR = REPO_ROOT / "var" / "bench-cache" / "age"
GROUPS: tuple[tuple[int, int], ...] = ((5, 11), (12, 17), (18, 20), (21, 25), (26, 40), (41, 70))
CANDIDATE_MARGINS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3)
# Distance kept between the oldest-looking calib minor's corrected estimate and the 0 band (years), so a face
# a little older-looking than any calib minor still gets 50.
ADULT_CUT_MARGIN = 1.0
# under_21's 0 band: at most this share of calib faces aged 18-20 may fall in it (issue 23's tolerance for an
# age group that holds people just under the limit); no face under 18 ever does (it starts at or above
# under_18's band).
YOUNG_ADULT_CLEARED_SHARE = 0.01
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


def wild_set(root: Path = WILD_DIR) -> PhotoSet:
    """faces-wild: FairFace photos labelled with a perceived age group; `ages` holds the group's lower
    bound (0, 3, 10, 20, ..., 70)."""
    with (root / "labels.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return PhotoSet(
        "faces-wild", tuple(root / r["file"] for r in rows), np.array([int(r["age_low"]) for r in rows])
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


@dataclass(frozen=True)
class PhotoFaces:
    """Every detected face of every photo of a set with what the age rules need: detection, quality
    measurements and faceres-deep's class probabilities (the service's views), in detection order."""

    photo: np.ndarray  # int [F]: index of the face's photo
    boxes: np.ndarray  # float32 [F, 4]
    landmarks: np.ndarray  # float32 [F, 5, 2]
    scores: np.ndarray  # float [F]
    sharpness: np.ndarray  # float [F]
    probabilities: np.ndarray  # float [F, 100]

    def faces_of(self, index: int) -> np.ndarray:
        return np.flatnonzero(self.photo == index)


def photo_faces(
    photos: PhotoSet, detector: FaceDetector, estimator: age_v2.FaceresAgeEstimator
) -> PhotoFaces:
    """All faces of every photo with the age model run on each of them, cached per photo set in one .npz
    (var/bench-cache/age), so trying rule variants costs no model time."""
    spec = NPM_WEIGHTS[age_v2.WEIGHT_NAME]
    key = _key(
        [str(p) for p in photos.paths], spec.files, age_v2.FACE_MARGINS, age_v2.FACE_MIRROR, DetectorOptions()
    )
    path = CACHE_DIR / f"{photos.name}-faces-{key}.npz"
    if not path.is_file():
        photo, boxes, landmarks, scores, sharpness, probabilities = [], [], [], [], [], []
        for index, image_path in enumerate(photos.paths):
            rgb = to_rgb(load_image(image_path))
            faces = detector.detect([rgb])[0]
            if not faces:
                continue
            qualities = assess_image_faces(rgb, faces)
            views = age_v2.face_views(rgb, [face.box for face in faces])
            probabilities.append(estimator.probabilities(views))
            for face, quality in zip(faces, qualities, strict=True):
                photo.append(index)
                boxes.append(face.box)
                landmarks.append(face.landmarks)
                scores.append(face.score)
                sharpness.append(quality.sharpness)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        np.savez(
            path,
            photo=np.asarray(photo, dtype=np.int64),
            boxes=np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
            landmarks=np.asarray(landmarks, dtype=np.float32).reshape(-1, 5, 2),
            scores=np.asarray(scores, dtype=np.float64),
            sharpness=np.asarray(sharpness, dtype=np.float64),
            probabilities=np.concatenate(probabilities) if probabilities else np.zeros((0, 100)),
        )
    with np.load(path) as data:
        return PhotoFaces(**{name: data[name] for name in data.files})


# faces-wild groups (lower bound -> upper bound, None for 70+) and the age each stands for when the
# correction's ends are fitted (only the groups outside faces-calib's ages 5-70 are used there).
WILD_GROUPS: dict[int, int | None] = {0: 2, 3: 9, 10: 19, 20: 29, 30: 39, 40: 49, 50: 59, 60: 69, 70: None}
WILD_END_AGES: dict[int, float] = {0: 1.0, 70: 75.0}
# The rules before issue 23, for the "before" rows: a 0 withheld when the subject missed the enrolment bar
# or another face had a quarter of its area.
LEGACY_COMPARABLE_AREA_RATIO = 0.25


def analyzed_faces(
    faces: PhotoFaces, count: int, calibration: age_v2.AgeCalibration
) -> list[list[AnalyzedFace]]:
    """Per photo, its faces as the analyzer would return them (every face estimated), from the cache."""
    estimator = _Calibrated(calibration)
    out: list[list[AnalyzedFace]] = [[] for _ in range(count)]
    for row in range(len(faces.photo)):
        box = faces.boxes[row]
        size = float(max(0.0, min(box[2] - box[0], box[3] - box[1])))
        quality = judge_quality(
            size,
            float(faces.scores[row]),
            float(faces.sharpness[row]),
            pose_from_landmarks(faces.landmarks[row]),
        )
        detection = DetectedFace(box=box, landmarks=faces.landmarks[row], score=float(faces.scores[row]))
        age = estimator.from_probabilities(faces.probabilities[row])
        out[int(faces.photo[row])].append(AnalyzedFace(detection, None, age, quality))
    return out


class _Calibrated(age_v2.FaceresAgeEstimator):
    """from_probabilities() of the service's estimator without a model session (the outputs are cached)."""

    def __init__(self, calibration: age_v2.AgeCalibration) -> None:  # no session: nothing to run
        self.calibration = calibration


def decisions(photo_faces_list: list[list[AnalyzedFace]]) -> list[AgeDecision | None]:
    """The service's decision per photo, with only the faces the analyzer would have estimated."""
    out = []
    for faces in photo_faces_list:
        estimated = set(age_faces([face.detection for face in faces]))
        out.append(
            decide_age(
                [
                    face if i in estimated else dataclasses.replace(face, age=None)
                    for i, face in enumerate(faces)
                ]
            )
        )
    return out


def legacy_decisions(photo_faces_list: list[list[AnalyzedFace]]) -> list[AgeDecision | None]:
    """The rules before issue 23 (enrolment bar, any face of a quarter of the area), with the same reasons."""
    out: list[AgeDecision | None] = []
    for faces in photo_faces_list:
        if not faces or faces[0].age is None:
            out.append(None)
            continue
        subject = max(faces, key=lambda face: face.detection.area)
        assert subject.age is not None
        crowded = any(
            face is not subject
            and face.detection.area >= LEGACY_COMPARABLE_AREA_RATIO * subject.detection.area
            for face in faces
        )
        quality_ok = subject.quality is not None and subject.quality.enrol_ok
        estimate = subject.age
        reason: AgeReason | None
        if quality_ok and not crowded:
            reason = "uncertain_age" if 50 in (estimate.under_18, estimate.under_21) else None
            out.append(AgeDecision(estimate, reason))
            continue
        flagged = dataclasses.replace(
            estimate, under_18=estimate.under_18 or 50, under_21=estimate.under_21 or 50
        )
        if (flagged.under_18, flagged.under_21) == (estimate.under_18, estimate.under_21):
            reason = "uncertain_age" if 50 in (estimate.under_18, estimate.under_21) else None
        else:
            reason = "face_quality" if not quality_ok else "another_face"
        out.append(AgeDecision(flagged, reason))
    return out


def age_groups(photos: PhotoSet) -> list[tuple[str, np.ndarray]]:
    """(label, mask) per age group: FairFace's groups for faces-wild, GROUPS for the others."""
    if photos.name == "faces-wild":
        return [
            (f"{low}-{high}" if high is not None else f"{low}+", photos.ages == low)
            for low, high in WILD_GROUPS.items()
        ]
    return [(f"{low}-{high}", (photos.ages >= low) & (photos.ages <= high)) for low, high in GROUPS]


def age_errors(photos: PhotoSet, estimates: np.ndarray) -> np.ndarray:
    """Estimate minus true age; for faces-wild, the distance outside the labelled group (0 inside)."""
    if photos.name != "faces-wild":
        return estimates - photos.ages
    low = photos.ages.astype(np.float64)
    tops = [WILD_GROUPS[int(a)] for a in photos.ages]
    high = np.array([np.inf if top is None else top + 1 for top in tops])
    return np.where(estimates < low, estimates - low, np.where(estimates > high, estimates - high, 0.0))


def decision_table(rows: list[tuple[str, PhotoSet, list[AgeDecision | None]]]) -> str:
    """Per set and age group: shares given 0 / 50 / 100 for each flag, and the reason of every 50."""
    table = []
    for label, photos, made in rows:
        for group, mask in [*age_groups(photos), ("all", np.ones(len(photos.ages), dtype=bool))]:
            chosen = [made[i] for i in np.flatnonzero(mask)]
            if not chosen:
                continue
            n = len(chosen)
            cells = [label, group, str(n)]
            for flag in ("under_18", "under_21"):
                values = [getattr(d.estimate, flag) if d is not None else None for d in chosen]
                cells += [f"{100 * sum(v == value for v in values) / n:.0f}" for value in (0, 50, 100)]
            for reason in ("uncertain_age", "face_quality", "another_face"):
                cells.append(f"{100 * sum(d is not None and d.reason == reason for d in chosen) / n:.0f}")
            cells.append(str(sum(d is None for d in chosen)))
            table.append(cells)
            label = ""
    header = ["rules / set", "age", "photos", "u18=0", "u18=50", "u18=100", "u21=0", "u21=50", "u21=100"]
    header += ["50: uncertain", "50: quality", "50: other face", "no face"]
    return format_table(header, table) + "\n(shares in % of the group's photos)"


def target_table(rows: list[tuple[str, PhotoSet, list[AgeDecision | None]]]) -> str:
    """Per rules / set and flag: faces-wild's adults 30+ given 0 (target >= 70%), children 0-9 given 0 (none),
    the group just over the limit given 0 (10-19 for under_18, 20-29 for under_21: at most 1%); for
    faces-calib and faces-dev, faces under 18 given 0 (none) and the 18-20s given under_21 = 0."""
    table = []
    for label, photos, made in rows:
        for flag in ("under_18", "under_21"):
            zero = np.array([d is not None and getattr(d.estimate, flag) == 0 for d in made])
            ages = photos.ages
            if photos.name == "faces-wild":
                near = 10 if flag == "under_18" else 20
                cells = [
                    f"{100 * zero[ages >= 30].mean():.1f}",
                    f"{int(zero[ages < 10].sum())} of {int((ages < 10).sum())}",
                    f"{100 * zero[ages == near].mean():.1f} ({int(zero[ages == near].sum())})",
                    "",
                    "",
                ]
            else:
                young = (ages >= 18) & (ages <= 20)
                cells = [
                    f"{100 * zero[ages > 25].mean():.1f} (26+)",
                    "",
                    "",
                    f"{int(zero[ages < 18].sum())} of {int((ages < 18).sum())}",
                    f"{int(zero[young].sum())} of {int(young.sum())}" if flag == "under_21" else "",
                ]
            table.append([label, flag, *cells])
    header = ["rules / set", "flag", "adults 30+ given 0 %", "0-9 given 0", "10-19 / 20-29 given 0 % (n)"]
    header += ["under 18 given 0", "18-20 given 0"]
    return format_table(header, table)


def mae_table(rows: list[tuple[str, PhotoSet, np.ndarray]]) -> str:
    """MAE and bias per age group of corrected estimates (subject = largest face)."""
    table = []
    for label, photos, estimates in rows:
        errors = age_errors(photos, estimates)
        for group, mask in [*age_groups(photos), ("all", np.ones(len(photos.ages), dtype=bool))]:
            sel = mask & ~np.isnan(errors)
            if sel.any():
                table.append(
                    [
                        label,
                        group,
                        str(int(sel.sum())),
                        f"{np.abs(errors[sel]).mean():.2f}",
                        f"{errors[sel].mean():+.2f}",
                    ]
                )
                label = ""
    return format_table(["correction / set", "age", "faces", "MAE", "bias"], table)


def subject_estimates(photo_faces_list: list[list[AnalyzedFace]]) -> np.ndarray:
    out = np.full(len(photo_faces_list), np.nan)
    for index, faces in enumerate(photo_faces_list):
        if faces:
            age = max(faces, key=lambda face: face.detection.area).age
            out[index] = age.expected_age if age is not None else np.nan
    return out


def disagreements(photos: PhotoSet, made: list[AgeDecision | None]) -> list[str]:
    """Photos where a flag contradicts the label: under 20 (faces-wild) / 18 given under_18 = 0, under 30 / 21
    given under_21 = 0, 30 and over / 21 and over given under_18 = 100."""
    young_18, young_21 = (20, 30) if photos.name == "faces-wild" else (18, 21)
    adult = 30 if photos.name == "faces-wild" else 21
    out = []
    for path, age, decision in zip(photos.paths, photos.ages, made, strict=True):
        if decision is None:
            continue
        if (
            (age < young_18 and decision.estimate.under_18 == 0)
            or (age >= adult and decision.estimate.under_18 == 100)
            or (age < young_21 and decision.estimate.under_21 == 0)
        ):
            out.append(
                f"{path.name}: labelled {age}, estimate {decision.estimate.expected_age:.1f}, "
                f"under_18 {decision.estimate.under_18}, under_21 {decision.estimate.under_21}"
            )
    return out


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
    estimator = AgeEstimator(age_v1_path(), SessionOptions(intra_op_threads=1))

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

    return _cached(f"{photos.name}-v1-{_key(AGE_V1_WEIGHTS.sha256, [str(p) for p in photos.paths])}", compute)


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
        "generated_by": "python -m bench.age --calibrate (faces-calib UTKFace age crops; the correction's "
        "ends also from faces-wild's 0-2 and 70+ photos as ages 1 and 75)",
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


def quality_table(sets: list[tuple[PhotoSet, list[list[AnalyzedFace]]]]) -> str:
    """What each check of the age bar (and the enrolment bar) does to the subjects it refuses: their MAE,
    how many the bands alone would have given a 0 against the label, and the adults it withholds."""
    checks: list[tuple[str, Callable[[FaceQuality], bool]]] = [
        ("all subjects", lambda q: True),
        ("detector score < 0.85", lambda q: q.detector_score < 0.85),
        ("detector score 0.85-0.88", lambda q: 0.85 <= q.detector_score < 0.88),
        ("sharpness < 20", lambda q: q.sharpness < 20),
        ("|yaw| 0.8-2.0", lambda q: 0.8 < abs(q.yaw) <= 2.0),
        ("|yaw| > 2.0", lambda q: not abs(q.yaw) <= 2.0),
        ("|roll| > 40", lambda q: abs(q.roll_deg) > 40),
        ("pitch outside 0.15-0.9", lambda q: not 0.15 <= q.pitch <= 0.9),
        ("size < 60 px", lambda q: q.face_size_px < 60),
        ("misses the enrolment bar", lambda q: not q.enrol_ok),
        ("misses the age bar", lambda q: bool(age_quality_failures(q))),
    ]
    table = []
    for photos, per_photo in sets:
        young_18, young_21 = (20, 30) if photos.name == "faces-wild" else (18, 21)
        adult = 30 if photos.name == "faces-wild" else 26
        subjects = [max(faces, key=lambda f: f.detection.area) if faces else None for faces in per_photo]
        estimates = np.array([s.age.expected_age if s and s.age else np.nan for s in subjects])
        errors = np.abs(age_errors(photos, estimates))
        for label, check in checks:
            rows = [
                i
                for i, s in enumerate(subjects)
                if s is not None and s.quality is not None and check(s.quality)
            ]
            if not rows:
                continue
            wrong_0 = sum(
                1
                for i in rows
                if (s := subjects[i]) is not None
                and s.age is not None
                and (
                    (photos.ages[i] < young_18 and s.age.under_18 == 0)
                    or (photos.ages[i] < young_21 and s.age.under_21 == 0)
                )
            )
            adults_0 = sum(
                1
                for i in rows
                if (s := subjects[i]) is not None
                and s.age is not None
                and photos.ages[i] >= adult
                and s.age.under_18 == 0
            )
            table.append(
                [
                    photos.name,
                    label,
                    str(len(rows)),
                    f"{np.nanmean(errors[rows]):.1f}",
                    f"{100 * np.nanmean(errors[rows] > 8):.0f}",
                    str(wrong_0),
                    str(adults_0),
                ]
            )
    header = [
        "set",
        "subjects",
        "n",
        "MAE",
        "miss > 8 y %",
        "young given 0 by bands",
        "adults given 0 by bands",
    ]
    return format_table(header, table) + (
        "\n(faces-wild: MAE is the distance outside the labelled group; young = under 20 for under_18, "
        "under 30 for under_21; adults = 30+. faces-calib: under 18 / under 21; adults 26+)"
    )


def subject_raw(faces: PhotoFaces, count: int) -> np.ndarray:
    """[N] raw faceres-deep estimate of each photo's largest face (NaN where none)."""
    out = np.full(count, np.nan)
    for index in range(count):
        rows = faces.faces_of(index)
        if len(rows):
            areas = (faces.boxes[rows, 2] - faces.boxes[rows, 0]) * (
                faces.boxes[rows, 3] - faces.boxes[rows, 1]
            )
            out[index] = faces.probabilities[rows[int(np.argmax(areas))]] @ age_v2.AGE_CLASS_VALUES
    return out


def model_cost(photo_faces_list: list[list[AnalyzedFace]]) -> tuple[int, int, int]:
    """(photos with a face, faces the age model runs on with the rules' other faces, subjects only)."""
    with_face = [faces for faces in photo_faces_list if faces]
    estimated = sum(len(age_faces([face.detection for face in faces])) for faces in with_face)
    return len(with_face), estimated, len(with_face)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.age", description=__doc__.split("\n\n")[0])
    parser.add_argument("--choose-views", action="store_true")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument(
        "--baseline-calibration",
        type=Path,
        help="an earlier models/age_calibration.json: adds 'before' rows (that correction, the rules before "
        "issue 23: enrolment bar, any face of a quarter of the area)",
    )
    parser.add_argument(
        "--compare-calibration",
        type=Path,
        help="an earlier models/age_calibration.json: adds rows with today's rules and that file's "
        "correction and bands",
    )
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    args = parser.parse_args(argv)

    options = SessionOptions(intra_op_threads=args.threads)
    detector = FaceDetector(resolve("yunet_2023mar_int8bq"), DetectorOptions(), options)
    calibration_stub = age_v2.AgeCalibration((0.0, 100.0), (0.0, 100.0), age_v2.AgeBands(16, 34, 19, 37))
    estimator = age_v2.FaceresAgeEstimator(converted("faceres_deep"), options, calibration_stub)
    calib, dev, wild = calib_set(), dev_set(), wild_set()
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

    all_faces = {photos.name: photo_faces(photos, detector, estimator) for photos in (wild, dev, calib)}
    calib_raw, dev_raw = raw_of(calib, calib_boxes), raw_of(dev, dev_boxes)
    if args.calibrate:
        wild_raw = subject_raw(all_faces[wild.name], len(wild.paths))
        ends = np.isin(wild.ages, list(WILD_END_AGES))
        end_ages = np.array([WILD_END_AGES.get(int(a), np.nan) for a in wild.ages])
        fitted = fit_calibration(calib_raw, calib.ages, wild_raw[ends], end_ages[ends])
        correction = fitted["correction"]
        assert isinstance(correction, dict)
        correction["raw"], correction["corrected"] = _dedupe_knots(correction["raw"], correction["corrected"])
        age_v2.CALIBRATION_FILE.write_text(json.dumps(fitted, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {age_v2.CALIBRATION_FILE}: bands {fitted['bands']}\n")

    calibration = age_v2.AgeCalibration.load()
    baseline = age_v2.AgeCalibration.load(args.baseline_calibration) if args.baseline_calibration else None
    compare = age_v2.AgeCalibration.load(args.compare_calibration) if args.compare_calibration else None
    bands = calibration.bands
    print(f"bands: {bands}\n")

    decision_rows: list[tuple[str, PhotoSet, list[AgeDecision | None]]] = []
    estimate_rows: list[tuple[str, PhotoSet, np.ndarray]] = []
    cost_rows = []
    quality_sets: list[tuple[PhotoSet, list[list[AnalyzedFace]]]] = []
    for photos in (wild, dev, calib):
        faces = all_faces[photos.name]
        if baseline is not None:
            before = analyzed_faces(faces, len(photos.paths), baseline)
            decision_rows.append((f"before / {photos.name}", photos, legacy_decisions(before)))
            estimate_rows.append((f"before / {photos.name}", photos, subject_estimates(before)))
        if compare is not None:
            compared = decisions(analyzed_faces(faces, len(photos.paths), compare))
            decision_rows.append((f"{args.compare_calibration.name} / {photos.name}", photos, compared))
        after = analyzed_faces(faces, len(photos.paths), calibration)
        if photos is not dev:
            quality_sets.append((photos, after))
        made = decisions(after)
        decision_rows.append((f"after / {photos.name}", photos, made))
        estimate_rows.append((f"after / {photos.name}", photos, subject_estimates(after)))
        found, estimated, subjects = model_cost(after)
        cost_rows.append(
            [photos.name, str(found), str(subjects), str(estimated), f"{estimated / max(1, found):.3f}"]
        )
        print(f"# {photos.name}: photos where a 0 contradicts the label (rules after)")
        print("\n".join(disagreements(photos, made)) or "none")
        print()
    print("# Age decisions by age group (faces-wild: FairFace's perceived groups; wild and calib in-sample)")
    print(decision_table(decision_rows) + "\n")
    print(
        "# Issue 23's targets (faces-wild: perceived groups, in-sample) and the minors of faces-calib / -dev"
    )
    print(target_table(decision_rows) + "\n")
    print(
        "# Subjects refused by each quality check (bands without rules; the age bar is models.quality_bars)"
    )
    print(quality_table(quality_sets) + "\n")
    print("# MAE and bias of the corrected estimate by age group (faces-wild: distance outside the group)")
    print(mae_table(estimate_rows) + "\n")

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
    print("# Age by true-age group, largest face, bands without the rules (MAE, bias in years; % of group)")
    print(band_table(rows) + "\n")
    print("# Age-model inputs: subject only against subject + the other faces the rules estimate")
    print(
        format_table(
            ["set", "photos with a face", "subject only", "with other faces", "per photo"], cost_rows
        )
    )
    print("\n# Model time, batch 16, ms/face")
    v1_model = AgeEstimator(age_v1_path(), options)
    print(format_table(["model", "ms/face"], ms_per_face(estimator, v1_model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
