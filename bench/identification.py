"""1:N identification and 1:1 verification of every descriptor variant, the score calibration, and the
quality gate, on faces-calib and faces-dev.

    python -m bench.identification [--det-png var/det.png] [--write-calibration] [--no-cache]
                                   [--no-speed] [--blur-sweep]

Protocol (1:N, two folds): the people with two or more photos are split in two halves by name order. In
fold 1 the first photo of each person of half A is enrolled, together with every distractor (people with a
single photo: faces-calib ids 01190-01489; on faces-dev the 60 age crops); the other photos of half A are
mated probes and every photo of half B is a non-mated probe (people left out). Fold 2 swaps the halves.
The largest face of each photo is used, as by the service; photos without a face count as misses.

- rank-1: share of mated probes whose best gallery match is their mate;
- FPIR(t): share of non-mated probes whose best match scores >= t; FNIR(t): share of mated probes whose
  mate scores < t (or is not among the best 10); FNIR at FPIR 10 % / 1 % reads FNIR at the t that gives it;
- TAR@FAR, EER: every pair of identity photos (faces-calib: 1,504 genuine, about 1.1M impostor pairs).

--write-calibration writes models/data/face_v2_calibration.json from faces-calib: the fusion weights and
the table cosine -> per-comparison false-match rate (FMR) the service's scores come from.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import format_table, load_image
from bench.face_embeddings import PhotoSet, extract, time_embedders
from models.calibration import CALIBRATION_PATH, FaceScoreCalibration
from models.embedder import fuse_vectors
from tests.faces_dev import LabelledImage, load_faces_dev

REPO = Path(__file__).resolve().parent.parent
CALIB_DIR = REPO.parent / "shared" / "testdata" / "faces-calib"
FARS = (1e-2, 1e-3, 1e-4)
FPIRS = (0.10, 0.01)
CANDIDATES = 10  # the service's default list length
TAIL_FIT = (1e-5, 1e-3)  # FMR range the exponential tail is fitted on
LAST_MEASURED_FMR = 1e-5  # below this, fewer than ~11 of 1.1M impostor pairs: the fitted tail takes over
FMR_KNOTS = (0.5, 0.3, 0.1, 0.03, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)
FMR_FLOOR_LOG10 = -10.0  # score 1.0


@dataclass(frozen=True)
class Variant:
    name: str
    vectors: np.ndarray  # [N, D]
    similarity: Callable[[np.ndarray, np.ndarray], np.ndarray]  # rows x rows -> scores, higher is closer


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a @ b.T).astype(np.float64)


def negative_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    squared = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return -np.sqrt(np.maximum(squared, 0.0)).astype(np.float64)


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def label_free_sigma(vectors: np.ndarray, found: np.ndarray) -> float:
    """Spread of the cosines of all pairs (no labels: nearly all pairs are of different people)."""
    rows = unit(vectors[found])
    sims = rows @ rows.T
    return float(np.std(sims[np.triu_indices(len(rows), 1)]))


def variants(photos: PhotoSet, weights: tuple[float, float]) -> list[Variant]:
    fused = fuse_vectors(unit(photos.dlib), photos.sface, weights)
    fused_q = fuse_vectors(unit(photos.dlib), photos.sface_int8, weights)
    return [
        Variant("dlib (v1, Euclidean)", photos.dlib, negative_distance),
        Variant("SFace fp32", photos.sface, cosine),
        Variant("SFace dyn-int8", photos.sface_int8, cosine),
        Variant("dlib+SFace fused (v2)", fused, cosine),
        Variant("dlib+SFace-int8 fused", fused_q, cosine),
    ]


# ---- 1:1 ------------------------------------------------------------------------------------------------


def pair_scores(
    scores: np.ndarray, identities: Sequence[str], found: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    index = np.flatnonzero(found)
    ids = np.asarray(identities)[index]
    sub = scores[np.ix_(index, index)]
    upper = np.triu_indices(len(index), 1)
    same = ids[upper[0]] == ids[upper[1]]
    values = sub[upper]
    return values[same], values[~same]


def threshold_at_rate(negatives: np.ndarray, rate: float) -> float:
    """Smallest t with share(negatives >= t) <= rate."""
    ordered = np.sort(negatives)[::-1]
    allowed = math.floor(rate * len(ordered))
    if allowed >= len(ordered):
        return -np.inf
    return float(np.nextafter(ordered[allowed], np.inf))


def eer(genuine: np.ndarray, impostor: np.ndarray) -> float:
    cuts = np.unique(np.concatenate([genuine, impostor]))
    cuts = cuts[:: max(1, len(cuts) // 4000)]
    g, i = np.sort(genuine), np.sort(impostor)
    fnmr = np.searchsorted(g, cuts, side="left") / len(g)
    fmr = 1.0 - np.searchsorted(i, cuts, side="left") / len(i)
    k = int(np.argmin(np.abs(fnmr - fmr)))
    return float((fnmr[k] + fmr[k]) / 2)


# ---- 1:N ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    mated_mate: np.ndarray  # score of the probe's mate (-inf when not among the candidates or not enrolled)
    mated_rank1: np.ndarray  # bool: best match is the mate
    nonmated_best: np.ndarray  # best score of each non-mated probe (-inf for an empty gallery)


def folds(
    identities: Sequence[str], found: np.ndarray, enrol_ok: np.ndarray | None = None
) -> list[tuple[list[int], list[int], list[int]]]:
    """(gallery, mated probes, non-mated probes) index lists for the two folds.

    With enrol_ok (the quality gate's enrolment bar), each person is enrolled with their first photo that
    meets the bar, as a client whose first photo was refused would send another; a person with none is
    not enrolled and their photos are left out of the mated probes."""
    by_person: dict[str, list[int]] = defaultdict(list)
    for index, identity in enumerate(identities):
        by_person[identity].append(index)
    multi = sorted(person for person, photos in by_person.items() if len(photos) >= 2)
    singles = [photos[0] for person, photos in by_person.items() if len(photos) == 1]
    if enrol_ok is not None:
        singles = [index for index in singles if enrol_ok[index]]
    halves = (multi[0::2], multi[1::2])
    result = []
    for enrolled, left_out in (halves, halves[::-1]):
        gallery: list[int] = list(singles)
        mated: list[int] = []
        for person in enrolled:
            photos = by_person[person]
            usable = [i for i in photos if enrol_ok is None or enrol_ok[i]]
            if not usable:
                continue
            gallery.append(usable[0])
            mated.extend(i for i in photos if i != usable[0])
        nonmated = [i for p in left_out for i in by_person[p]]
        result.append((gallery, mated, nonmated))
    return result


def run_trial(
    variant: Variant,
    identities: Sequence[str],
    found: np.ndarray,
    enrol_ok: np.ndarray | None = None,
    probe_ok: np.ndarray | None = None,
) -> Trial:
    """probe_ok: only these probes are searched (to split results by the search bar)."""
    ids = np.asarray(identities)
    mate_scores, rank1, nonmated_best = [], [], []
    for gallery, mated, nonmated in folds(identities, found, enrol_ok):
        enrolled = [g for g in gallery if found[g]]
        gallery_vectors = variant.vectors[enrolled]
        gallery_ids = ids[enrolled]
        for probes, is_mated in ((mated, True), (nonmated, False)):
            if probe_ok is not None:
                probes = [p for p in probes if probe_ok[p]]
            usable = [p for p in probes if found[p]]
            misses = len(probes) - len(usable)
            scores = (
                variant.similarity(variant.vectors[usable], gallery_vectors) if usable else np.zeros((0, 0))
            )
            for row, probe in zip(scores, usable, strict=True):
                order = np.argsort(-row, kind="stable")[:CANDIDATES]
                if is_mated:
                    hits = [k for k in order if gallery_ids[k] == ids[probe]]
                    mate_scores.append(row[hits[0]] if hits else -np.inf)
                    rank1.append(bool(len(order)) and gallery_ids[order[0]] == ids[probe])
                else:
                    nonmated_best.append(row[order[0]] if len(order) else -np.inf)
            if is_mated:
                mate_scores.extend([-np.inf] * misses)
                rank1.extend([False] * misses)
            else:
                nonmated_best.extend([-np.inf] * misses)
    return Trial(np.asarray(mate_scores), np.asarray(rank1), np.asarray(nonmated_best))


def fnir_at_fpir(trial: Trial, fpir: float) -> float:
    t = threshold_at_rate(trial.nonmated_best, fpir)
    return float(np.mean(trial.mated_mate < t))


# ---- DET plot ---------------------------------------------------------------------------------------------


def det_points(negatives: np.ndarray, positives_miss: Callable[[float], float]) -> list[tuple[float, float]]:
    points = []
    for exponent in np.linspace(-5, 0, 41):
        rate = 10.0**exponent
        if rate * len(negatives) < 1:
            continue
        t = threshold_at_rate(negatives, rate)
        points.append((rate, positives_miss(t)))
    return points


def _share_below(values: np.ndarray) -> Callable[[float], float]:
    ordered = np.sort(values)
    return lambda t: float(np.searchsorted(ordered, t, side="left") / max(len(ordered), 1))


def draw_det(
    path: Path, panels: list[tuple[str, str, str, list[tuple[str, list[tuple[float, float]]]]]]
) -> None:
    """Log-log DET panels (x: false positive rate, y: miss rate) drawn with PIL."""
    from PIL import Image, ImageDraw

    width, height, margin = 520, 420, 60
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    image = Image.new("RGB", (width * len(panels), height), "white")
    draw = ImageDraw.Draw(image)
    x_min, y_min = -5.0, -3.0

    for p, (title, x_label, y_label, curves) in enumerate(panels):
        left, top = p * width + margin, 30
        right, bottom = (p + 1) * width - 20, height - margin

        def to_xy(
            x: float, y: float, left: int = left, right: int = right, bottom: int = bottom, top: int = top
        ) -> tuple[float, float]:
            lx = (math.log10(max(x, 10**x_min)) - x_min) / -x_min
            ly = (math.log10(max(y, 10**y_min)) - y_min) / -y_min
            return left + lx * (right - left), bottom - ly * (bottom - top)

        draw.rectangle([left, top, right, bottom], outline="black")
        for e in range(int(x_min), 1):
            x, _ = to_xy(10.0**e, 1)
            draw.line([x, top, x, bottom], fill=(225, 225, 225))
            draw.text((x - 12, bottom + 5), f"1e{e}", fill="black")
        for e in range(int(y_min), 1):
            _, y = to_xy(1, 10.0**e)
            draw.line([left, y, right, y], fill=(225, 225, 225))
            draw.text((left - 38, y - 6), f"1e{e}", fill="black")
        draw.text((left, 8), title, fill="black")
        draw.text(((left + right) // 2 - 40, bottom + 22), x_label, fill="black")
        draw.text((p * width + 4, top - 18), y_label, fill="black")
        for k, (name, points) in enumerate(curves):
            colour = colours[k % len(colours)]
            xy = [to_xy(x, y) for x, y in points]
            if len(xy) >= 2:
                draw.line(xy, fill=colour, width=2)
            draw.text((right - 190, top + 8 + 14 * k), name, fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


# ---- reports ----------------------------------------------------------------------------------------------


def model_table(
    label: str, photos: PhotoSet, weights: tuple[float, float], timings: dict[str, float]
) -> tuple[str, list[tuple[str, str, str, list[tuple[str, list[tuple[float, float]]]]]]]:
    rows = []
    verification_curves, identification_curves = [], []
    timing_of = {
        "dlib (v1, Euclidean)": timings["dlib"],
        "SFace fp32": timings["sface_fp32"],
        "SFace dyn-int8": timings["sface_int8"],
        "dlib+SFace fused (v2)": timings["dlib"] + timings["sface_fp32"],
        "dlib+SFace-int8 fused": timings["dlib"] + timings["sface_int8"],
    }
    for variant in variants(photos, weights):
        scores = variant.similarity(variant.vectors, variant.vectors)
        genuine, impostor = pair_scores(scores, photos.identities, photos.found)
        tars = []
        for far in FARS:
            if far * len(impostor) < 1:
                tars.append("n/a")
                continue
            t = threshold_at_rate(impostor, far)
            tars.append(f"{np.mean(genuine >= t):.3f}")
        trial = run_trial(variant, photos.identities, photos.found)
        rows.append(
            [
                variant.name,
                *tars,
                f"{100 * eer(genuine, impostor):.2f}%",
                f"{100 * np.mean(trial.mated_rank1):.1f}%",
                *[
                    f"{100 * fnir_at_fpir(trial, fpir):.1f}%"
                    if fpir * len(trial.nonmated_best) >= 1
                    else "n/a"
                    for fpir in FPIRS
                ],
                f"{timing_of[variant.name]:.1f}",
            ]
        )
        verification_curves.append((variant.name, det_points(impostor, _share_below(genuine))))
        identification_curves.append(
            (variant.name, det_points(trial.nonmated_best, _share_below(trial.mated_mate)))
        )
    genuine_n, impostor_n = pair_scores(np.zeros((len(photos.names),) * 2), photos.identities, photos.found)
    trial_sizes = run_trial(variants(photos, weights)[1], photos.identities, photos.found)
    header = [
        "model",
        *[f"TAR@FAR {far:g}" for far in FARS],
        "EER",
        "rank-1",
        *[f"FNIR@FPIR {int(f * 100)}%" for f in FPIRS],
        "ms/face",
    ]
    text = (
        f"## {label}: {int(photos.found.sum())}/{len(photos.names)} photos with a face; "
        f"{len(genuine_n)} genuine / {len(impostor_n)} impostor pairs; 1:N (2 folds): "
        f"{len(trial_sizes.mated_mate)} mated / {len(trial_sizes.nonmated_best)} non-mated probes\n"
        + format_table(header, rows)
    )
    panels = [
        (f"{label}: verification DET", "FMR", "FNMR", verification_curves),
        (f"{label}: 1:N DET", "FPIR", "FNIR", identification_curves),
    ]
    return text, panels


def calibration(photos: PhotoSet, weights: tuple[float, float]) -> dict[str, object]:
    """Cosine -> FMR knots of the fused v2 vector, with the fitted exponential tail."""
    fused = fuse_vectors(unit(photos.dlib), photos.sface, weights)
    genuine, impostor = pair_scores(cosine(fused, fused), photos.identities, photos.found)
    ordered = np.sort(impostor)
    knots = []
    for fmr in FMR_KNOTS:
        t = threshold_at_rate(impostor, fmr)
        knots.append((float(t), math.log10(fmr)))
    # Tail: log10 FMR linear in the cosine, fitted on the measured tail; an exponential tail falls more
    # slowly than the roughly Gaussian bulk, so extrapolating it overstates FMR (the conservative side).
    low, high = threshold_at_rate(impostor, TAIL_FIT[1]), threshold_at_rate(impostor, TAIL_FIT[0])
    grid = np.linspace(low, high, 25)
    measured = 1.0 - np.searchsorted(ordered, grid, side="left") / len(ordered)
    keep = measured > 0
    fitted, _ = np.polyfit(grid[keep], np.log10(measured[keep]), 1)
    # The measured bulk steepens with the cosine (roughly Gaussian); continuing with the shallower of the
    # fitted and the end-to-end slope of the fitted range overstates the FMR beyond it: conservative.
    end_to_end = math.log10(TAIL_FIT[0] / TAIL_FIT[1]) / (high - low)
    slope = max(float(fitted), end_to_end)
    anchor_cos, anchor_log = knots[-1]
    tail_end = anchor_cos + (FMR_FLOOR_LOG10 - anchor_log) / slope
    step = (tail_end - anchor_cos) / 10
    for k in range(1, 11):
        c = anchor_cos + k * step
        knots.append((float(c), float(anchor_log + slope * (c - anchor_cos))))
    return {
        "model_version": "face_v2_dlib_sface",
        "source": "python -m bench.identification --write-calibration (faces-calib identity photos)",
        "impostor_pairs": len(impostor),
        "genuine_pairs": len(genuine),
        "fusion_weights": {"dlib": weights[0], "sface": weights[1]},
        "tail": {
            "fitted_on_fmr": list(TAIL_FIT),
            "log10_fmr_per_cosine": slope,
            "fitted_slope": float(fitted),
            "from_cosine": anchor_cos,
        },
        "knots": [{"cosine": round(c, 6), "log10_fmr": round(v, 4)} for c, v in knots],
        "genuine_share_below": {f"{c:.4f}": round(float(np.mean(genuine < c)), 5) for c, _ in knots[::2]},
    }


def calibration_table(calib: FaceScoreCalibration, photos: PhotoSet) -> str:
    fused = fuse_vectors(unit(photos.dlib), photos.sface, calib.fusion_weights)
    genuine, impostor = pair_scores(cosine(fused, fused), photos.identities, photos.found)
    rows = []
    for score in (0.1, 0.2, 0.3, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7, 0.8):
        c = calib.cosine_for_score(score)
        measured = np.mean(impostor >= c)
        rows.append(
            [
                f"{score:.2f}",
                f"{c:.4f}",
                f"{10 ** (-10 * score):.0e}",
                f"{int(np.sum(impostor >= c))}/{len(impostor)} = {measured:.1e}",
                f"{100 * np.mean(genuine < c):.1f}%",
            ]
        )
    return format_table(
        ["score", "fused cosine", "FMR (table)", "FMR measured (calib)", "FNMR (calib)"], rows
    )


def gallery_threshold_table(calib: FaceScoreCalibration) -> str:
    rows = []
    for n in (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000):
        score = calib.min_score_for_gallery(n)
        rows.append([f"{n:,}", f"{score:.3f}", f"{calib.cosine_for_score(score):.4f}"])
    return format_table(["gallery size N", "default min score (FPIR <= 1%)", "fused cosine"], rows)


def quality_table(photos: PhotoSet, weights: tuple[float, float]) -> str:
    fused = Variant("v2", fuse_vectors(unit(photos.dlib), photos.sface, weights), cosine)
    found = photos.found
    n = int(found.sum())
    reasons: dict[str, int] = defaultdict(int)
    for ok, text in zip(photos.enrol_ok, photos.reasons, strict=True):
        for code in text.split("+") if text and not ok else []:
            reasons[code] += 1
    lines = [
        f"photos with a face: {n}; below the enrolment bar: {int((~photos.enrol_ok & found).sum())} "
        f"({100 * np.mean(~photos.enrol_ok[found]):.1f}%), below the search bar: "
        f"{int((~photos.search_ok & found).sum())} ({100 * np.mean(~photos.search_ok[found]):.1f}%)",
        "enrolment-bar reasons: " + (", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "none"),
    ]
    rows = []
    base = run_trial(fused, photos.identities, found)
    gated = run_trial(fused, photos.identities, found, enrol_ok=photos.enrol_ok)
    for name, trial in (("no gate", base), ("enrolment gate (first photo meeting the bar)", gated)):
        rows.append(
            [
                name,
                f"{len(trial.mated_mate)} / {len(trial.nonmated_best)}",
                *[f"{100 * fnir_at_fpir(trial, f):.1f}%" for f in FPIRS],
                f"{100 * np.mean(trial.mated_rank1):.1f}%",
            ]
        )
    table = format_table(
        ["1:N (fused v2)", "mated / non-mated", "FNIR@FPIR 10%", "FNIR@FPIR 1%", "rank-1"], rows
    )
    # The search bar: probes below it against the same thresholds (set on all probes, no gate).
    split_rows = []
    for fpir in FPIRS:
        t = threshold_at_rate(base.nonmated_best, fpir)
        cells = [f"{int(fpir * 100)}% (t={t:.4f})"]
        for probe_ok in (photos.search_ok, ~photos.search_ok):
            part = run_trial(fused, photos.identities, found, probe_ok=probe_ok)
            fnir = f"{100 * np.mean(part.mated_mate < t):.1f}%" if len(part.mated_mate) else "-"
            fpir_part = f"{100 * np.mean(part.nonmated_best >= t):.1f}%" if len(part.nonmated_best) else "-"
            cells.append(f"{fnir} / {fpir_part} (n={len(part.mated_mate)}/{len(part.nonmated_best)})")
        split_rows.append(cells)
    split = format_table(
        ["threshold at FPIR", "meeting the search bar: FNIR / FPIR", "below it: FNIR / FPIR"], split_rows
    )
    return "\n".join(lines) + "\n" + table + "\n" + split


def blur_sweep(images: Sequence[LabelledImage], photos: PhotoSet, weights: tuple[float, float]) -> str:
    """What blur does to sharpness and to matching: 200 photos of people with a mate, blurred with a
    Gaussian of each sigma, searched against their mates' unblurred photos (how the bars were chosen)."""
    import cv2

    from models.analyzer import ModelConfig
    from models.arrays import to_rgb
    from models.chips import align_chip
    from models.quality import chip_sharpness

    calibration = FaceScoreCalibration.load()
    fused = fuse_vectors(unit(photos.dlib), photos.sface, weights)
    ids = np.asarray(photos.identities)
    config = ModelConfig(intra_op_threads=2)
    detector, cropper, embedder = config.load_detector(), config.load_cropper(), config.load_embedder()
    with_mates = [i for i in range(len(ids)) if photos.found[i] and int(np.sum(ids == ids[i])) > 1]
    pick = np.random.default_rng(0).choice(with_mates, min(200, len(with_mates)), replace=False)
    bar = calibration.cosine_for_score(0.5)  # the default bar of a 1,000-face gallery
    rows = []
    for sigma in (0.0, 1.0, 1.5, 2.0, 3.0):
        sharpness, best = [], []
        for index in pick:
            rgb = to_rgb(load_image(images[index].path))
            if sigma:
                rgb = cv2.GaussianBlur(rgb, (0, 0), sigma)
            faces = detector.detect([rgb])[0]
            if not faces:
                best.append(-1.0)
                continue
            face = max(faces, key=lambda found: found.area)
            crops = cropper(rgb, [face], embed=True, estimate_age=False)
            chip = align_chip(rgb, face.landmarks)
            assert crops.descriptor_chips is not None
            vector = embedder.embed(crops.descriptor_chips, chip[None])[0]
            mates = [j for j in np.flatnonzero(ids == ids[index]) if j != index]
            sharpness.append(chip_sharpness(chip))
            best.append(float(np.max(fused[mates] @ vector)))
        values, scores = np.asarray(sharpness), np.asarray(best)
        rows.append(
            [
                f"{sigma:g}",
                f"{np.percentile(values, 10):.1f} / {np.median(values):.1f}",
                f"{np.mean([calibration.score(v) for v in scores]):.3f}",
                f"{100 * np.mean(scores < bar):.1f}%",
            ]
        )
    return format_table(
        ["blur sigma (px)", "sharpness p10 / median", "best-mate score, mean", "mate below score 0.5"], rows
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.identification", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--faces-dev", type=Path, default=None)
    parser.add_argument("--faces-calib", type=Path, default=CALIB_DIR)
    parser.add_argument("--det-png", type=Path, default=REPO / "var" / "det.png")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads for ms/face")
    parser.add_argument("--write-calibration", action="store_true", help=f"write {CALIBRATION_PATH.name}")
    parser.add_argument("--no-cache", action="store_true", help="recompute the per-photo embeddings")
    parser.add_argument("--no-speed", action="store_true", help="skip the ms/face measurement")
    parser.add_argument("--blur-sweep", action="store_true", help="also measure blur against matching")
    args = parser.parse_args(argv)

    calib_set = load_faces_dev(args.faces_calib)
    dev_set = load_faces_dev(args.faces_dev)
    calib_images = calib_set.of_kind("identity")
    dev_images: list[LabelledImage] = dev_set.of_kind("identity") + dev_set.of_kind("age")
    started = time.perf_counter()
    calib = extract(calib_images, use_cache=not args.no_cache)
    dev = extract(dev_images, use_cache=not args.no_cache)
    print(f"embeddings ready in {time.perf_counter() - started:.0f} s")

    weights = (
        1.0 / math.sqrt(label_free_sigma(calib.dlib, calib.found)),
        1.0 / math.sqrt(label_free_sigma(calib.sface, calib.found)),
    )
    print(
        "fusion weights (1/sqrt(sigma) of all-pair cosines on faces-calib): "
        f"dlib {weights[0]:.4f}, SFace {weights[1]:.4f}"
    )
    if args.write_calibration:
        CALIBRATION_PATH.parent.mkdir(parents=True, exist_ok=True)
        CALIBRATION_PATH.write_text(json.dumps(calibration(calib, weights), indent=1) + "\n")
        print(f"wrote {CALIBRATION_PATH}")

    # ms/face on real chips: the first 64 calib photos, in runs of 16 faces, and at batch 1.
    from models.analyzer import ModelConfig
    from models.arrays import to_rgb
    from models.chips import align_chip

    config = ModelConfig()
    detector, cropper = config.load_detector(), config.load_cropper()
    dlib_chips, sface_chips = [], []
    for item in calib_images[: 0 if args.no_speed else 64]:
        rgb = to_rgb(load_image(item.path))
        faces = detector.detect([rgb])[0]
        if faces:
            face = max(faces, key=lambda f: f.area)
            crops = cropper(rgb, [face], embed=True, estimate_age=False)
            assert crops.descriptor_chips is not None
            dlib_chips.append(crops.descriptor_chips[0])
            sface_chips.append(align_chip(rgb, face.landmarks))
    if args.no_speed:
        timings = timings_b1 = dict.fromkeys(("dlib", "sface_fp32", "sface_int8"), float("nan"))
    else:
        timings = time_embedders(np.stack(dlib_chips), np.stack(sface_chips), args.threads, 16)
        timings_b1 = time_embedders(np.stack(dlib_chips), np.stack(sface_chips), args.threads, 1)
    print(
        f"ms/face ({args.threads} threads), batch 16 / batch 1: "
        + ", ".join(f"{k} {timings[k]:.1f} / {timings_b1[k]:.1f}" for k in timings)
    )

    panels = []
    for label, photos in (("faces-calib", calib), ("faces-dev", dev)):
        text, det = model_table(label, photos, weights, timings)
        print(f"\n{text}")
        panels.extend(det)
    draw_det(args.det_png, panels)
    print(f"\nDET curves: {args.det_png}")

    table = FaceScoreCalibration.load()
    print(
        f"\n## Calibration ({CALIBRATION_PATH.name}): score = -log10(FMR) / 10\n"
        + calibration_table(table, calib)
    )
    print(f"\n## Default minimum score by gallery size\n{gallery_threshold_table(table)}")
    for label, photos in (("faces-calib", calib), ("faces-dev", dev)):
        print(f"\n## Quality gate on {label}\n{quality_table(photos, weights)}")
    if args.blur_sweep:
        print(f"\n## Blur against matching (faces-calib)\n{blur_sweep(calib_images, calib, weights)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
