"""Accuracy of the model layer on the labelled dev photos.

    python -m bench.accuracy [--faces-dev DIR] [--threads N]

Prints: detection recall / false positives / group counts; verification score ranges, accuracy and
false-match rate at the default threshold; age MAE by band and the share of each under_18 / under_21 value
per true-age group, as the service decides them (models.age_policy at the default rate; the age model's
correction and the rule's intervals are fitted on faces-calib, never here). 1:N identification:
bench.identification.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import format_table, load_image
from models.age_policy import AgeDecision, AgeIntervalRule, decide_age
from models.analyzer import FaceAnalyzer, ModelConfig, largest_face, load_face_analyzer
from models.calibration import FaceScoreCalibration
from models.types import AnalyzedFace
from tests.faces_dev import LabelledImage, load_faces_dev

AGE_BANDS: tuple[tuple[int, int], ...] = ((5, 11), (12, 17), (18, 25), (26, 40), (41, 70))
SCORE_SWEEP = (0.2, 0.3, 0.4, 0.5, 0.6)
# The default bar of a 100-face gallery (FPIR <= 1 %): a fixed point to compare runs by.
MIN_SCORE = FaceScoreCalibration.min_score_for_gallery(100)
AGE_GROUPS: tuple[tuple[str, int, int], ...] = (("<18", 0, 17), ("18-20", 18, 20), ("21+", 21, 200))


@dataclass(frozen=True)
class Descriptor:
    source: str  # file name, with the face index for group photos
    identity: str  # group faces get a unique identity each: they are all different people
    vector: np.ndarray


def analyze_all(
    analyzer: FaceAnalyzer, images: Sequence[LabelledImage], batch: int
) -> dict[str, list[AnalyzedFace]]:
    faces: dict[str, list[AnalyzedFace]] = {}
    for start in range(0, len(images), batch):
        chunk = images[start : start + batch]
        results = analyzer.analyze([load_image(item.path) for item in chunk])
        for item, found in zip(chunk, results, strict=True):
            faces[item.path.name] = found
    return faces


def percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def detection_table(images: Sequence[LabelledImage], faces: dict[str, list[AnalyzedFace]]) -> str:
    rows = []
    for kind in ("identity", "age"):
        subset = [item for item in images if item.kind == kind]
        found = sum(1 for item in subset if faces[item.path.name])
        extra = sum(max(0, len(faces[item.path.name]) - 1) for item in subset)
        rows.append([kind, str(len(subset)), f"{found} ({percent(found, len(subset))})", str(extra)])
    negatives = [item for item in images if item.kind == "negative"]
    false_faces = sum(len(faces[item.path.name]) for item in negatives)
    rows.append(["negative", str(len(negatives)), f"{false_faces} faces (false positives)", "-"])
    for item in images:
        if item.kind == "group":
            rows.append([item.path.name, "1", f"{len(faces[item.path.name])} of {item.n_faces} faces", "-"])
    return format_table(["set", "images", "images with a face / faces found", "extra faces"], rows)


def collect_descriptors(
    images: Sequence[LabelledImage], faces: dict[str, list[AnalyzedFace]]
) -> list[Descriptor]:
    descriptors = []
    for item in images:
        found = faces[item.path.name]
        if item.kind == "identity":
            probe = largest_face(found)
            if probe is not None and probe.embedding is not None and item.identity is not None:
                descriptors.append(Descriptor(item.path.name, item.identity, probe.embedding))
        elif item.kind == "group":
            for index, face in enumerate(found):
                if face.embedding is not None:
                    name = f"{item.path.name}#{index}"
                    descriptors.append(Descriptor(name, name, face.embedding))
    return descriptors


def _score(calibration: FaceScoreCalibration, a: Descriptor, b: Descriptor) -> float:
    return calibration.score(float(a.vector @ b.vector))


def verification_tables(descriptors: list[Descriptor], min_score: float) -> str:
    calibration = FaceScoreCalibration.load()
    same: list[float] = []
    different: list[float] = []
    closest: tuple[float, str, str] = (-1.0, "", "")
    for a, b in itertools.combinations(descriptors, 2):
        score = _score(calibration, a, b)
        if a.identity == b.identity:
            same.append(score)
        else:
            different.append(score)
            closest = max(closest, (score, a.source, b.source))
    same_s, diff_s = np.asarray(same), np.asarray(different)
    rows = []
    for name, values, wrong in (
        ("same person", same_s, int(np.sum(same_s < min_score))),
        ("different people", diff_s, int(np.sum(diff_s >= min_score))),
    ):
        if values.size == 0:
            rows.append([name, "0", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                name,
                str(values.size),
                f"{values.min():.3f}",
                f"{values.max():.3f}",
                f"{values.mean():.3f}",
                f"{wrong} ({percent(wrong, values.size)})",
            ]
        )
    table = format_table(
        ["pairs", "n", "min score", "max score", "mean score", f"wrong at score {min_score:.2f}"], rows
    )
    false_matches = int(np.sum(diff_s >= min_score))
    false_non_matches = int(np.sum(same_s < min_score))
    total = same_s.size + diff_s.size
    summary = (
        f"faces: {len(descriptors)} ({len({d.identity for d in descriptors})} identities); "
        f"accuracy at score {min_score:.2f}: {percent(total - false_matches - false_non_matches, total)}; "
        f"false-match rate {false_matches}/{diff_s.size} = {percent(false_matches, diff_s.size)}; "
        f"false non-match rate {false_non_matches}/{same_s.size} = "
        f"{percent(false_non_matches, same_s.size)}\n"
        f"closest different pair: {closest[1]} / {closest[2]} at score {closest[0]:.3f}"
    )
    sweep = format_table(
        ["min score", "calibrated FMR there", "false matches", "false non-matches"],
        [
            [
                f"{cut:.2f}",
                f"{FaceScoreCalibration.fmr_for_score(cut):.0e}",
                f"{int(np.sum(diff_s >= cut))}/{diff_s.size}",
                f"{int(np.sum(same_s < cut))}/{same_s.size}",
            ]
            for cut in SCORE_SWEEP
        ],
    )
    return f"{table}\n{summary}\n\n{sweep}"


def age_tables(ages: list[tuple[int, AgeDecision]], missing: int) -> str:
    truth = np.asarray([true_age for true_age, _ in ages], dtype=np.float64)
    expected = np.asarray([decision.estimate.expected_age for _, decision in ages])
    rounded = np.asarray([decision.estimate.age for _, decision in ages], dtype=np.float64)
    rows = []
    for low, high in AGE_BANDS:
        mask = (truth >= low) & (truth <= high)
        if mask.any():
            error = rounded[mask] - truth[mask]
            rows.append(
                [f"{low}-{high}", str(int(mask.sum())), f"{np.abs(error).mean():.2f}", f"{error.mean():+.2f}"]
            )
    error = rounded - truth
    rows.append(["all", str(truth.size), f"{np.abs(error).mean():.2f}", f"{error.mean():+.2f}"])
    mae = format_table(["true age", "faces", "MAE (integer age)", "bias"], rows)
    expected_mae = np.abs(expected - truth).mean()
    mae += f"\nMAE of the unrounded expectation: {expected_mae:.2f}; age photos without a face: {missing}"

    tables = [mae]
    for field in ("under_18", "under_21"):
        share_rows = []
        for name, low, high in AGE_GROUPS:
            values = [getattr(decision, field) for true_age, decision in ages if low <= true_age <= high]
            counts = [sum(v == level for v in values) for level in (0, 50, 100)]
            share_rows.append([name, str(len(values))] + [f"{n} ({percent(n, len(values))})" for n in counts])
        header = ["true age", "faces", f"{field}=0", f"{field}=50", f"{field}=100"]
        tables.append(format_table(header, share_rows))
    return "\n\n".join(tables)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faces-dev", type=Path, default=None, help="labelled dev photos (default: shared)")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--batch", type=int, default=8, help="images per analyze() call")
    args = parser.parse_args(argv)

    dev = load_faces_dev(args.faces_dev)
    analyzer = load_face_analyzer(ModelConfig(intra_op_threads=args.threads))
    images = list(dev.images)
    faces = analyze_all(analyzer, images, args.batch)
    threshold = MIN_SCORE

    print(f"# Detection ({dev.root})\n{detection_table(images, faces)}\n")
    descriptors = collect_descriptors(images, faces)
    print(
        f"# Verification (identity photos' largest face + every group face)\n"
        f"{verification_tables(descriptors, threshold)}\n"
    )

    ages: list[tuple[int, AgeDecision]] = []
    missing = 0
    rule = AgeIntervalRule.load()
    for item in dev.of_kind("age"):
        decision = decide_age(faces[item.path.name], rule)
        if decision is None or item.age is None:
            missing += 1
            continue
        ages.append((item.age, decision))
    print(f"# Age (largest face of each age photo)\n{age_tables(ages, missing)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
