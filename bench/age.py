"""Age benchmark: faceres-deep's decisions (the calibrated interval rule, models.age_policy) on faces-calib,
faces-wild (FairFace photos, perceived-age groups), faces-dev and degraded copies of a faces-calib sample;
and the fit of the rule's models/age_interval.json.

    python -m bench.age                        # who is given 0 per set and split, the degraded copies step
                                               # by step, the configured rate against what it costs, and
                                               # the photos where a 0 contradicts the label
    python -m bench.age --calibrate-interval   # fit the width map and the conformal scores on the
                                               # calibration split: models/age_interval.json

Every face of every photo (detection, quality measurements, faceres-deep's output) is cached per photo set
under $FACESEARCH_AGE_CACHE (default /tmp/facesearch-age-cache; keyed by the photo list and model files), so
a rerun costs no model time (the first runs the models on about 22,500 photos, 23 degraded copies of a
900-photo sample of faces-calib being most of them). People are split once into a
calibration half and a held-out half (SPLIT_SEED); faces-dev is reported, never fitted. The other sets are
found next to faces-dev (FACES_DEV_DIR). The estimates' correction (models/age_calibration.json)
are built by `python -m model_build.age_calibration`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import format_table, load_image
from model_build.age_calibration import default_photos_dir, labelled
from models import age_v2
from models.age_policy import (
    DEFAULT_MINOR_CLEARED_RATE,
    INTERVAL_FILE,
    LIMITS,
    QUALITY_TERMS,
    AgeDecision,
    AgeIntervalRule,
    AgeWidthMap,
    age_faces,
    conformal_quantile,
    decide_age,
)
from models.arrays import to_rgb
from models.chips import aligned_chips
from models.detector import DetectorOptions, FaceDetector
from models.quality import (
    ChipMeasures,
    blockiness,
    chip_measures,
    chip_sharpness,
    judge_quality,
    pose_from_landmarks,
)
from models.sessions import SessionOptions
from models.types import AnalyzedFace, DetectedFace, FaceQuality
from models.weights import NPM_WEIGHTS, converted, resolve
from tests.degradations import DEGRADATIONS, Step
from tests.faces_dev import load_faces_dev

# Model outputs are cached outside the repository (FACESEARCH_AGE_CACHE moves them).
CACHE_DIR = Path(os.environ.get("FACESEARCH_AGE_CACHE", "/tmp/facesearch-age-cache"))
GROUPS: tuple[tuple[int, int], ...] = ((5, 11), (12, 17), (18, 20), (21, 25), (26, 40), (41, 70))


@dataclass(frozen=True)
class PhotoSet:
    name: str
    paths: tuple[Path, ...]
    ages: np.ndarray  # int, true ages


def labelled_set(name: str, kind: str, age_column: str) -> PhotoSet:
    """A shared photo set next to faces-dev (FACES_DEV_DIR moves them all). faces-wild's `ages` hold its
    perceived-age group's lower bound (0, 3, 10, 20, ..., 70)."""
    rows = labelled(default_photos_dir() / name / "labels.csv", kind, age_column)
    return PhotoSet(name, tuple(path for path, _ in rows), np.array([age for _, age in rows]))


# Degraded copies are made of a fixed sample of faces-calib: every face under 18, half of the 18-20s and
# 200 of the adults 30 and over (DEGRADED_SEED), so the copies cost minutes, not an hour.
DEGRADED_SEED = 36


def degraded_sample(calib: PhotoSet) -> PhotoSet:
    rng = np.random.default_rng(DEGRADED_SEED)
    ages = calib.ages
    young = np.flatnonzero((ages >= 18) & (ages <= 20))
    adults = np.flatnonzero(ages >= 30)
    chosen = np.sort(
        np.concatenate(
            [
                np.flatnonzero(ages < 18),
                rng.choice(young, len(young) // 2, replace=False),
                rng.choice(adults, min(200, len(adults)), replace=False),
            ]
        )
    )
    return PhotoSet("calib-sample", tuple(calib.paths[i] for i in chosen), ages[chosen])


def dev_set() -> PhotoSet:
    items = [item for item in load_faces_dev().of_kind("age") if item.age is not None]
    return PhotoSet("faces-dev", tuple(i.path for i in items), np.array([int(i.age or 0) for i in items]))


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


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
    # uint8 [F, 112, 112, 3]: the aligned chips the quality measures read, kept so a change of
    # models.quality.chip_measures costs no detection or model time.
    chips: np.ndarray
    blockiness: np.ndarray  # float [F]: models.quality.blockiness on the (degraded) photo

    def measures(self) -> list[ChipMeasures]:
        return [chip_measures(chip) for chip in self.chips]


def photo_faces(
    photos: PhotoSet,
    detector: FaceDetector,
    estimator: age_v2.FaceresAgeEstimator,
    step: Step | None = None,
) -> PhotoFaces:
    """All faces of every photo (made worse by `step`, seeded by the photo's index) with the age model run
    on each of them, cached per photo set in one .npz (CACHE_DIR)."""
    spec = NPM_WEIGHTS[age_v2.WEIGHT_NAME]
    key = _key(
        "with blockiness",
        [str(p) for p in photos.paths],
        spec.files,
        age_v2.FACE_MARGINS,
        age_v2.FACE_MIRROR,
        DetectorOptions(),
        step.name if step else None,
        step.label if step else None,
    )
    suffix = f"~{step.name}" if step else ""
    path = CACHE_DIR / f"{photos.name}{suffix}-faces-{key}.npz"
    if not path.is_file():
        photo, boxes, landmarks, scores, sharpness, probabilities, chips, blocky = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        for index, image_path in enumerate(photos.paths):
            rgb = to_rgb(load_image(image_path))
            if step is not None:
                rgb = step.apply(rgb, index)
            faces = detector.detect([rgb])[0]
            if not faces:
                continue
            face_chips = aligned_chips(rgb, [face.landmarks for face in faces])
            views = age_v2.face_views(rgb, [face.box for face in faces])
            probabilities.append(estimator.probabilities(views))
            for face, chip in zip(faces, face_chips, strict=True):
                photo.append(index)
                boxes.append(face.box)
                landmarks.append(face.landmarks)
                scores.append(face.score)
                sharpness.append(chip_sharpness(chip))
                chips.append(chip)
                blocky.append(blockiness(rgb, face.box))
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        np.savez(
            path,
            photo=np.asarray(photo, dtype=np.int64),
            boxes=np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
            landmarks=np.asarray(landmarks, dtype=np.float32).reshape(-1, 5, 2),
            scores=np.asarray(scores, dtype=np.float64),
            sharpness=np.asarray(sharpness, dtype=np.float64),
            probabilities=np.concatenate(probabilities) if probabilities else np.zeros((0, 100)),
            chips=np.asarray(chips, dtype=np.uint8).reshape(-1, 112, 112, 3),
            blockiness=np.asarray(blocky, dtype=np.float64),
        )
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    return PhotoFaces(**arrays)


# faces-wild's perceived-age groups: lower bound -> upper bound (None for 70+).
WILD_GROUPS: dict[int, int | None] = {0: 2, 3: 9, 10: 19, 20: 29, 30: 39, 40: 49, 50: 59, 60: 69, 70: None}


def analyzed_faces(
    faces: PhotoFaces, count: int, calibration: age_v2.AgeCalibration
) -> list[list[AnalyzedFace]]:
    """Per photo, its faces as the analyzer would return them (every face estimated), from the cache."""
    estimator = _Calibrated(calibration)
    out: list[list[AnalyzedFace]] = [[] for _ in range(count)]
    for row, measures in enumerate(faces.measures()):
        box = faces.boxes[row]
        size = float(max(0.0, min(box[2] - box[0], box[3] - box[1])))
        quality = judge_quality(
            size,
            float(faces.scores[row]),
            float(faces.sharpness[row]),
            pose_from_landmarks(faces.landmarks[row]),
            measures=measures,
        )
        quality = dataclasses.replace(quality, blockiness=float(faces.blockiness[row]))
        detection = DetectedFace(box=box, landmarks=faces.landmarks[row], score=float(faces.scores[row]))
        age = estimator.from_probabilities(faces.probabilities[row])
        out[int(faces.photo[row])].append(AnalyzedFace(detection, None, age, quality))
    return out


class _Calibrated(age_v2.FaceresAgeEstimator):
    """from_probabilities() of the service's estimator without a model session (the outputs are cached)."""

    def __init__(self, calibration: age_v2.AgeCalibration) -> None:  # no session: nothing to run
        self.calibration = calibration


def decisions(photo_faces_list: list[list[AnalyzedFace]], rule: AgeIntervalRule) -> list[AgeDecision | None]:
    """The rule's decision per photo with only the faces the analyzer would have estimated."""
    out = []
    for faces in photo_faces_list:
        estimated = set(age_faces([face.detection for face in faces]))
        kept = [
            face if i in estimated else dataclasses.replace(face, age=None) for i, face in enumerate(faces)
        ]
        out.append(decide_age(kept, rule))
    return out


# ---------------------------------------------------------------- the calibrated interval (issue 36)

# People are split once, half of every age group to calibration and half held out, with this seed; the
# degraded copies follow their person. faces-dev is never used for calibration.
SPLIT_SEED = 20261128
# Largest calibration scores kept per class in models/age_interval.json: enough for error rates down to
# about KEPT_SCORES / (people in the class).
KEPT_SCORES = 40
# Rates the curve table walks through for the 0 side.
CURVE_RATES: tuple[float, ...] = (0.003, 0.005, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.03, 0.05, 0.08)


def calibration_split(photos: PhotoSet) -> np.ndarray:
    """True for the photos of the calibration split: half of each age group (rounded up), drawn with
    SPLIT_SEED; faces-dev is all held out."""
    mask = np.zeros(len(photos.paths), dtype=bool)
    if photos.name == "faces-dev":
        return mask
    rng = np.random.default_rng(SPLIT_SEED)
    for group in age_groups(photos):
        members = rng.permutation(np.flatnonzero(group))
        mask[members[: (len(members) + 1) // 2]] = True
    return mask


def sample_split(sample: PhotoSet, calib: PhotoSet) -> np.ndarray:
    """The calibration split of faces-calib, carried to the degraded sample's photos."""
    split = calibration_split(calib)
    index = {path: i for i, path in enumerate(calib.paths)}
    return np.array([split[index[path]] for path in sample.paths], dtype=bool)


def age_bounds(photos: PhotoSet) -> tuple[np.ndarray, np.ndarray]:
    """[low, high] true age per photo: the age itself, or faces-wild's labelled group (70+: up to 100)."""
    if photos.name != "faces-wild":
        return photos.ages.astype(np.float64), photos.ages.astype(np.float64)
    tops = [WILD_GROUPS[int(a)] for a in photos.ages]
    return photos.ages.astype(np.float64), np.array([100.0 if t is None else float(t) for t in tops])


def under_limit(photos: PhotoSet, limit: int) -> np.ndarray:
    """The people counted as under the limit: calib/dev by age; faces-wild's groups up to 10-19 (a 10-19
    face may be 18 or 19: counted as under 18 too, the cautious side); 20-29 is in neither class for 21."""
    _, high = age_bounds(photos)
    if photos.name == "faces-wild":
        return high < 20
    return high < limit


def over_limit(photos: PhotoSet, limit: int) -> np.ndarray:
    """The people counted as at or over the limit (faces-wild: groups from 20-29; for 21 too, the
    cautious side for a 100)."""
    low, _ = age_bounds(photos)
    if photos.name == "faces-wild":
        return low >= 20
    return low >= limit


@dataclass(frozen=True)
class Subjects:
    """The subject (largest face) of every photo of a set: corrected estimate and measured quality."""

    photos: PhotoSet
    estimate: np.ndarray  # [N] NaN where no face
    quality: list[FaceQuality | None]

    @classmethod
    def of(cls, photos: PhotoSet, analyzed: list[list[AnalyzedFace]]) -> Subjects:
        estimate = np.full(len(photos.paths), np.nan)
        quality: list[FaceQuality | None] = [None] * len(photos.paths)
        for index, faces in enumerate(analyzed):
            if faces:
                subject = max(faces, key=lambda face: face.detection.area)
                if subject.age is not None:
                    estimate[index] = subject.age.expected_age
                quality[index] = subject.quality
        return cls(photos, estimate, quality)


# The weights the width map's fit tries for each term (bench.age --calibrate-interval).
WEIGHT_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
SEARCH_PASSES = 3
RISE_TOLERANCE = 3.0
RISE_SHARE = 0.01
# The share of clean calibration photos worse than a term's reference (fit_width_map).
REFERENCE_SHARE = 0.05


@dataclass(frozen=True)
class FitRows:
    """Subjects of the calibration split as arrays: badness terms, corrected estimate, and who counts as
    under / over each limit or as an adult of 30+."""

    terms: np.ndarray  # [N, len(QUALITY_TERMS)]
    estimate: np.ndarray  # [N]
    under: dict[int, np.ndarray]  # limit -> bool [N]
    over: dict[int, np.ndarray]
    adult: np.ndarray  # bool [N]: 30 and over
    wild: np.ndarray  # bool [N]: from faces-wild (its adults' share is weighed like calib's)


def fit_rows(width_map: AgeWidthMap, sets: Sequence[tuple[Subjects, np.ndarray]]) -> FitRows:
    """The given rows of each set whose subject has an estimate and every measure."""
    terms, estimate, adult, wild = [], [], [], []
    under: dict[int, list[bool]] = {limit: [] for limit in LIMITS}
    over: dict[int, list[bool]] = {limit: [] for limit in LIMITS}
    for subjects, rows in sets:
        photos = subjects.photos
        masks = {limit: (under_limit(photos, limit), over_limit(photos, limit)) for limit in LIMITS}
        for i in rows:
            quality = subjects.quality[i]
            badness = width_map.badness(quality) if quality is not None else None
            if badness is None or np.isnan(subjects.estimate[i]):
                continue
            terms.append([badness[name] for name in QUALITY_TERMS])
            estimate.append(subjects.estimate[i])
            adult.append(bool(photos.ages[i] >= 30))
            wild.append(photos.name == "faces-wild")
            for limit in LIMITS:
                under[limit].append(bool(masks[limit][0][i]))
                over[limit].append(bool(masks[limit][1][i]))
    return FitRows(
        np.asarray(terms, dtype=np.float64).reshape(-1, len(QUALITY_TERMS)),
        np.asarray(estimate, dtype=np.float64),
        {limit: np.asarray(v, dtype=bool) for limit, v in under.items()},
        {limit: np.asarray(v, dtype=bool) for limit, v in over.items()},
        np.asarray(adult, dtype=bool),
        np.asarray(wild, dtype=bool),
    )


def _widths(rows: FitRows, weights: np.ndarray, limits: np.ndarray) -> np.ndarray:
    widths = np.exp(rows.terms @ weights)
    widths[(rows.terms > limits).any(axis=1)] = np.inf
    return widths


def _clear_quantiles(clean: FitRows, widths: np.ndarray, rate: float) -> dict[int, float]:
    out: dict[int, float] = {}
    for limit in LIMITS:
        ok = clean.under[limit] & np.isfinite(widths)
        scores = np.sort((clean.estimate[ok] - limit) / widths[ok])[::-1]
        out[limit] = conformal_quantile(tuple(scores[:KEPT_SCORES]), len(scores), rate)
    return out


def _cleared_rows(rows: FitRows, widths: np.ndarray, quantiles: dict[int, float]) -> dict[int, np.ndarray]:
    """Who each flag clears (under_21 = 0 needs under_18 = 0, as in models.age_policy)."""
    u18 = rows.estimate - quantiles[18] * widths > 18
    u21 = u18 & (rows.estimate - quantiles[21] * widths > 21)
    return {18: u18, 21: u21}


def weigh_terms(
    clean: FitRows, degraded: FitRows, originals: FitRows, limits: np.ndarray, rate: float
) -> tuple[np.ndarray, list[list[str]]]:
    """The width map's weights: a greedy search over WEIGHT_GRID, term by term, SEARCH_PASSES times, for the
    most clean adults of 30+ given under_18 = 0 (calib's and wild's shares averaged) on the calibration
    split, among the weights that clear nobody under 18 (either flag) and at most `rate` of the people
    under 21 (under_21) in the split's degraded copies, and under which degrading a photo (`originals`:
    the clean photo of each degraded row) raises under_18's lower end by more than RISE_TOLERANCE years
    for at most RISE_SHARE of the copies, whatever the person's age. The clearing quantiles are recomputed
    from the clean photos for every candidate, as the service would. Returns the weights and the search's
    trace."""

    def judge(weights: np.ndarray) -> tuple[int, float]:
        clean_widths = _widths(clean, weights, limits)
        quantiles = _clear_quantiles(clean, clean_widths, rate)
        degraded_widths = _widths(degraded, weights, limits)
        degraded_cleared = _cleared_rows(degraded, degraded_widths, quantiles)
        minors = int((degraded_cleared[18] & degraded.under[18]).sum())
        allowed = int(rate * degraded.under[21].sum())
        excess = int((degraded_cleared[21] & degraded.under[21]).sum()) - allowed
        # A worse photo of the same person must not raise the interval's lower end by more than
        # RISE_TOLERANCE years, but for at most RISE_SHARE of the copies.
        before = originals.estimate - quantiles[18] * _widths(originals, weights, limits)
        after = degraded.estimate - quantiles[18] * degraded_widths
        rises = int(np.sum(after > before + RISE_TOLERANCE)) - int(RISE_SHARE * len(after))
        cleared = _cleared_rows(clean, clean_widths, quantiles)[18]
        shares = [cleared[clean.adult & (clean.wild == w)].mean() for w in (False, True)]
        return minors + max(0, excess) + max(0, rises), float(np.mean(shares))

    weights = np.zeros(len(QUALITY_TERMS))
    best = judge(weights)
    trace = [["start", "-", str(best[0]), f"{100 * best[1]:.1f}"]]
    for _ in range(SEARCH_PASSES):
        for j, name in enumerate(QUALITY_TERMS):
            for value in WEIGHT_GRID:
                trial = weights.copy()
                trial[j] = value
                result = judge(trial)
                # Fewer violations first, then more adults cleared.
                if (result[0], -result[1]) < (best[0], -best[1]):
                    weights, best = trial, result
                    trace.append([name, f"{value:g}", str(result[0]), f"{100 * result[1]:.1f}"])
    return weights, trace


def fit_width_map(
    clean: Sequence[tuple[Subjects, np.ndarray]],
    degraded: Sequence[tuple[Subjects, np.ndarray]],
    originals: Subjects,
    rate: float,
) -> tuple[AgeWidthMap, list[list[str]]]:
    """The quality -> width map from the calibration split: references from its clean photos (medians, and
    the quartiles for texture and blockiness), weights by weigh_terms, limits at the worst badness seen in
    the split (clean and degraded)."""
    photos = [q for subjects, rows in clean for q in _qualities(subjects, rows)]
    # A term starts to count where a photo is worse than all but REFERENCE_SHARE of the clean ones, so a
    # typical photo of either set has width 1 (faces-wild's photos are darker and less sharp than calib's).
    low, high = 100 * REFERENCE_SHARE, 100 * (1 - REFERENCE_SHARE)
    references = {
        "brightness": float(np.percentile([q.brightness for q in photos], low)),
        "contrast": float(np.percentile([q.contrast for q in photos], low)),
        "texture_low": float(np.percentile([q.texture for q in photos], low)),
        "texture_high": float(np.percentile([q.texture for q in photos], high)),
        "blockiness": float(np.nanpercentile([q.blockiness for q in photos], high)),
        "face_size_px": float(np.percentile([q.face_size_px for q in photos], low)),
        "detector_score": float(np.percentile([q.detector_score for q in photos], low)),
        "yaw": float(np.percentile([abs(q.yaw) for q in photos], high)),
    }
    unbounded = AgeWidthMap(
        references={k: round(v, 4) for k, v in references.items()},
        weights=dict.fromkeys(QUALITY_TERMS, 0.0),
        limits=dict.fromkeys(QUALITY_TERMS, math.inf),
    )
    # Degraded rows whose clean photo was measured too, and those clean photos, row for row.
    pairs = [
        (
            subjects,
            np.array(
                [i for i in rows if _usable(unbounded, subjects, i) and _usable(unbounded, originals, i)]
            ),
        )
        for subjects, rows in degraded
    ]
    clean_rows = fit_rows(unbounded, clean)
    degraded_rows = fit_rows(unbounded, pairs)
    original_rows = fit_rows(unbounded, [(originals, rows) for _, rows in pairs])
    limits = np.vstack([clean_rows.terms, degraded_rows.terms]).max(axis=0)
    weights, trace = weigh_terms(clean_rows, degraded_rows, original_rows, limits, rate)
    width_map = AgeWidthMap(
        references=unbounded.references,
        weights={name: float(w) for name, w in zip(QUALITY_TERMS, weights, strict=True)},
        limits={name: round(float(v), 4) for name, v in zip(QUALITY_TERMS, limits, strict=True)},
    )
    return width_map, trace


def _usable(width_map: AgeWidthMap, subjects: Subjects, i: int) -> bool:
    quality = subjects.quality[i]
    return (
        quality is not None and not np.isnan(subjects.estimate[i]) and width_map.badness(quality) is not None
    )


def _qualities(subjects: Subjects, rows: np.ndarray) -> list[FaceQuality]:
    return [q for i in rows if (q := subjects.quality[i]) is not None and not np.isnan(subjects.estimate[i])]


def limit_scores(
    width_map: AgeWidthMap, sets: Sequence[tuple[Subjects, np.ndarray]], limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """Calibration scores for one limit: (E - L) / w of the people under it and (L - E) / w of those at or
    over it, over the given rows (photos with a face the width map can vouch for)."""
    under, over = [], []
    for subjects, rows in sets:
        minors, adults = under_limit(subjects.photos, limit), over_limit(subjects.photos, limit)
        for i in rows:
            width = width_map.width(subjects.quality[i])
            e = subjects.estimate[i]
            if np.isnan(e) or not math.isfinite(width):
                continue
            if minors[i]:
                under.append((e - limit) / width)
            elif adults[i]:
                over.append((limit - e) / width)
    return np.asarray(under), np.asarray(over)


def fit_interval(
    clean: Sequence[tuple[Subjects, np.ndarray]],
    degraded: Sequence[tuple[Subjects, np.ndarray]],
    originals: Subjects,
    rate: float = DEFAULT_MINOR_CLEARED_RATE,
) -> tuple[dict[str, object], list[list[str]]]:
    """models/age_interval.json: the width map (fit_width_map, at `rate`) and each limit's conformal scores
    on the clean photos of the calibration split; and the weight search's trace."""
    width_map, trace = fit_width_map(clean, degraded, originals, rate)
    limits: dict[str, object] = {}
    for limit in LIMITS:
        under, over = limit_scores(width_map, clean, limit)
        limits[str(limit)] = {
            "under_count": len(under),
            "under_top": [round(float(v), 4) for v in np.sort(under)[::-1][:KEPT_SCORES]],
            "over_count": len(over),
            "over_top": [round(float(v), 4) for v in np.sort(over)[::-1][:KEPT_SCORES]],
        }
    fitted: dict[str, object] = {
        "generated_by": "python -m bench.age --calibrate-interval (calibration split of faces-calib and "
        f"faces-wild, SPLIT_SEED {SPLIT_SEED}; the width map's weights also on the split's degraded "
        f"faces-calib copies, at the rate {rate:g})",
        "width_map": {
            "references": dict(width_map.references),
            "weights": dict(width_map.weights),
            "limits": dict(width_map.limits),
        },
        "limits": limits,
    }
    return fitted, trace


@dataclass(frozen=True)
class Evaluated:
    """One photo set (or the degraded copies of the sample) with the interval rule's decisions."""

    photos: PhotoSet
    split: np.ndarray  # True: calibration split
    subjects: Subjects
    faces: list[list[AnalyzedFace]]
    made: list[AgeDecision | None]

    @classmethod
    def of(
        cls, photos: PhotoSet, split: np.ndarray, faces: list[list[AnalyzedFace]], rule: AgeIntervalRule
    ) -> Evaluated:
        return cls(photos, split, Subjects.of(photos, faces), faces, decisions(faces, rule))


def pool(name: str, evaluated: Sequence[Evaluated]) -> Evaluated:
    """Several evaluated sets as one (the degraded steps together)."""
    photos = PhotoSet(
        name,
        tuple(p for ev in evaluated for p in ev.photos.paths),
        np.concatenate([ev.photos.ages for ev in evaluated]),
    )
    estimates = np.concatenate([ev.subjects.estimate for ev in evaluated])
    return Evaluated(
        photos,
        np.concatenate([ev.split for ev in evaluated]),
        Subjects(photos, estimates, [q for ev in evaluated for q in ev.subjects.quality]),
        [f for ev in evaluated for f in ev.faces],
        [d for ev in evaluated for d in ev.made],
    )


def _cleared(made: Sequence[AgeDecision | None], flag: str) -> np.ndarray:
    return np.array([d is not None and getattr(d.estimate, flag) == 0 for d in made])


def _count(cleared: np.ndarray, mask: np.ndarray) -> str:
    n, k = int(mask.sum()), int(cleared[mask].sum())
    return f"{k} of {n} ({100 * k / max(1, n):.1f}%)" if n else "-"


def _share(cleared: np.ndarray, mask: np.ndarray) -> str:
    return f"{100 * cleared[mask].mean():.1f}" if mask.any() else "-"


def guarantee_table(rows: Sequence[tuple[str, Evaluated, np.ndarray]], rule: AgeIntervalRule) -> str:
    """Per set (and split): people under each limit given 0, labelled 0-19 given either 0, adults 30+ given
    0. rows: (label, set, mask)."""
    table = []
    for label, ev, mask in rows:
        photos = ev.photos
        u18, u21 = _cleared(ev.made, "under_18"), _cleared(ev.made, "under_21")
        adults = mask & (photos.ages >= 30)
        table.append(
            [
                label,
                _count(u18, mask & under_limit(photos, 18)),
                _count(u21, mask & under_limit(photos, 21)),
                _count(u18 | u21, mask & (age_bounds(photos)[1] < 20)),
                _share(u18, adults),
                _share(u21, adults),
            ]
        )
    header = ["set (people)", "under 18 given u18=0", "under 21 given u21=0", "0-19 given either 0"]
    header += ["30+ given u18=0 %", "30+ given u21=0 %"]
    return format_table(header, table) + (
        f"\n(configured: at most {rule.minor_cleared_rate:g} of the people under a limit cleared; "
        "faces-wild: 'under 18/21' = groups 0-2, 3-9 and 10-19)"
    )


def degradation_table(steps: Sequence[tuple[str, Evaluated]], clean: Evaluated) -> str:
    """Per degradation step of the faces-calib sample (both splits): faces found, the median width, the
    people under 18 given under_18 = 0, under 21 given under_21 = 0, adults 30+ given under_18 = 0."""
    table = []
    for label, ev in [("clean", clean), *steps]:
        ages = ev.photos.ages
        found = ~np.isnan(ev.subjects.estimate)
        widths = [d.width for d in ev.made if d is not None]
        finite = [w for w in widths if math.isfinite(w)]
        u18, u21 = _cleared(ev.made, "under_18"), _cleared(ev.made, "under_21")
        table.append(
            [
                label,
                f"{100 * found.mean():.0f}",
                f"{np.median(finite):.2f}" if finite else "-",
                f"{100 * (len(widths) - len(finite)) / max(1, len(widths)):.0f}",
                str(int(u18[ages < 18].sum())),
                str(int(u21[ages < 21].sum())),
                _share(u18, found & (ages >= 30)),
            ]
        )
    header = ["step", "face found %", "median width", "unbounded %", "<18 u18=0", "<21 u21=0", "30+ u18=0 %"]
    ages = clean.photos.ages
    return format_table(header, table) + (
        f"\n(sample: {int((ages < 18).sum())} people under 18, {int((ages < 21).sum())} under 21, "
        f"{int((ages >= 30).sum())} aged 30+; 30+ share among the photos where a face was found)"
    )


def curve_table(
    rule: AgeIntervalRule,
    calibration: Sequence[tuple[Evaluated, np.ndarray]],
    held_out: Sequence[tuple[Evaluated, np.ndarray]],
    wild: Evaluated,
) -> str:
    """The trade-off: per configured rate, the clearing quantile, the empirical share of people under each
    limit cleared (calibration split, held-out people), and faces-wild's adults 30+ given under_18 = 0."""
    table = []
    for rate in sorted({*CURVE_RATES, rule.minor_cleared_rate}):
        try:
            at_rate = dataclasses.replace(rule, minor_cleared_rate=rate)
        except ValueError:
            continue
        cells = [f"{rate:g}", f"{at_rate.clear_quantile(18):.2f}", f"{at_rate.clear_quantile(21):.2f}"]
        for sets in (calibration, held_out):
            for limit, flag in ((18, "under_18"), (21, "under_21")):
                k = n = 0
                for ev, keep in sets:
                    made = decisions(ev.faces, at_rate)
                    mask = keep & under_limit(ev.photos, limit)
                    k += int(_cleared(made, flag)[mask].sum())
                    n += int(mask.sum())
                cells.append(f"{k}/{n} ({100 * k / max(1, n):.2f}%)")
        made = decisions(wild.faces, at_rate)
        cells.append(_share(_cleared(made, "under_18"), (wild.photos.ages >= 30)))
        cells.append(_share(_cleared(made, "under_18"), (wild.photos.ages >= 30) & ~wild.split))
        table.append(cells)
    header = ["rate", "q(18)", "q(21)", "calib split <18", "calib split <21", "held-out <18", "held-out <21"]
    header += ["wild 30+ u18=0 %", "wild held-out 30+ %"]
    return format_table(header, table)


def age_groups(photos: PhotoSet) -> list[np.ndarray]:
    """A mask per age group: FairFace's groups for faces-wild, GROUPS for the others."""
    if photos.name == "faces-wild":
        return [photos.ages == low for low in WILD_GROUPS]
    return [(photos.ages >= low) & (photos.ages <= high) for low, high in GROUPS]


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
            (age < young_18 and decision.under_18 == 0)
            or (age >= adult and decision.under_18 == 100)
            or (age < young_21 and decision.under_21 == 0)
        ):
            out.append(
                f"{path.name}: labelled {age}, estimate {decision.estimate.expected_age:.1f}, "
                f"under_18 {decision.under_18}, under_21 {decision.under_21}"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.age", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibrate-interval", action="store_true", help=f"refit {INTERVAL_FILE.name}")
    parser.add_argument(
        "--minor-cleared-rate",
        type=float,
        default=DEFAULT_MINOR_CLEARED_RATE,
        help="the configured rate the tables use (FACESEARCH_AGE_MINOR_CLEARED_RATE)",
    )
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    args = parser.parse_args(argv)

    options = SessionOptions(intra_op_threads=args.threads)
    detector = FaceDetector(resolve("yunet_2023mar_int8bq"), DetectorOptions(), options)
    calibration_stub = age_v2.AgeCalibration((0.0, 100.0), (0.0, 100.0))
    estimator = age_v2.FaceresAgeEstimator(converted("faceres_deep"), options, calibration_stub)
    calib, wild = labelled_set("faces-calib", "age", "age"), labelled_set("faces-wild", "", "age_low")
    dev = dev_set()
    all_faces = {photos.name: photo_faces(photos, detector, estimator) for photos in (wild, dev, calib)}
    calibration = age_v2.AgeCalibration.load()
    sample = degraded_sample(calib)
    analyzed = {
        photos.name: analyzed_faces(all_faces[photos.name], len(photos.paths), calibration)
        for photos in (wild, dev, calib)
    }
    steps = [(step, dataclasses.replace(sample, name=f"{sample.name}~{step.name}")) for step in DEGRADATIONS]
    degraded = {
        copy.name: analyzed_faces(
            photo_faces(sample, detector, estimator, step), len(sample.paths), calibration
        )
        for step, copy in steps
    }
    calib_index = {path: i for i, path in enumerate(calib.paths)}
    clean_sample = [analyzed[calib.name][calib_index[path]] for path in sample.paths]
    splits = {photos.name: calibration_split(photos) for photos in (wild, dev, calib)}
    split_of_sample = sample_split(sample, calib)

    if args.calibrate_interval:
        clean_fit = [
            (Subjects.of(photos, analyzed[photos.name]), np.flatnonzero(splits[photos.name]))
            for photos in (calib, wild)
        ]
        split_rows = np.flatnonzero(split_of_sample)
        degraded_fit = [(Subjects.of(copy, degraded[copy.name]), split_rows) for _, copy in steps]
        fitted_interval, trace = fit_interval(clean_fit, degraded_fit, Subjects.of(sample, clean_sample))
        INTERVAL_FILE.write_text(json.dumps(fitted_interval, indent=1) + "\n", encoding="utf-8")
        print("# The width map's weight search (calibration split; violations: degraded minors cleared)")
        print(format_table(["term", "weight", "violations", "clean 30+ given u18=0 %"], trace))
        print(f"wrote {INTERVAL_FILE}\n")

    rule = AgeIntervalRule.load(minor_cleared_rate=args.minor_cleared_rate)
    print(f"interval rule: width map {rule.width_map}")
    for limit in LIMITS:
        c = rule.calibrations[limit]
        print(
            f"limit {limit}: q_clear {rule.clear_quantile(limit):.3f} from {c.under_count} people under it, "
            f"q_minor {rule.minor_quantile(limit):.3f} from {c.over_count} at or over it"
        )
    evaluated = {
        photos.name: Evaluated.of(photos, splits[photos.name], analyzed[photos.name], rule)
        for photos in (wild, dev, calib)
    }
    clean_ev = Evaluated.of(sample, split_of_sample, clean_sample, rule)
    step_ev = [
        (f"{step.name} ({step.label})", Evaluated.of(copy, split_of_sample, degraded[copy.name], rule))
        for step, copy in steps
    ]
    pooled = pool("faces-calib degraded", [ev for _, ev in step_ev])
    everyone = {name: np.ones(len(ev.photos.paths), dtype=bool) for name, ev in evaluated.items()}
    rows = [
        ("faces-calib, held out", evaluated[calib.name], ~splits[calib.name]),
        ("faces-calib, calibration split", evaluated[calib.name], splits[calib.name]),
        ("faces-wild, held out", evaluated[wild.name], ~splits[wild.name]),
        ("faces-wild, calibration split", evaluated[wild.name], splits[wild.name]),
        ("faces-wild, all", evaluated[wild.name], everyone[wild.name]),
        ("faces-dev (never fitted)", evaluated[dev.name], everyone[dev.name]),
        ("degraded copies, held out", pooled, ~pooled.split),
        ("degraded copies, calibration split", pooled, pooled.split),
    ]
    print("\n# People given 0 (shares of the people in the row)")
    print(guarantee_table(rows, rule) + "\n")
    print("# Degraded copies of the faces-calib sample, step by step (both splits)")
    print(degradation_table(step_ev, clean_ev) + "\n")
    held_out = [(evaluated[name], ~splits[name]) for name in (calib.name, wild.name)]
    in_split = [(evaluated[name], splits[name]) for name in (calib.name, wild.name)]
    print("# The configured rate against what it costs (clean photos; faces-calib + faces-wild)")
    print(curve_table(rule, in_split, held_out, evaluated[wild.name]) + "\n")
    for name, ev in evaluated.items():
        print(f"# {name}: photos where a 0 contradicts the label")
        print("\n".join(disagreements(ev.photos, ev.made)) or "none")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
