"""1:N identification and 1:1 verification of face model v2 and its two descriptors, the score
calibration, and the quality gate, on faces-calib and faces-dev.

    python -m bench.identification [--write-calibration] [--no-cache]

Protocol (1:N, two folds): the people with two or more photos are split in two halves by name order. In
fold 1 the first photo of each person of half A is enrolled, together with every distractor (people with a
single photo: faces-calib ids 01190-01489; on faces-dev the 60 age crops); the other photos of half A are
mated probes and every photo of half B is a non-mated probe (people left out). Fold 2 swaps the halves.
The largest face of each photo is used, as by the service; photos without a face count as misses.

- rank-1: share of mated probes whose best gallery match is their mate;
- FPIR(t): share of non-mated probes whose best match scores >= t; FNIR(t): share of mated probes whose
  mate scores < t (or is not among the best 10); FNIR at FPIR 10 % / 1 % reads FNIR at the t that gives it;
- TAR@FAR, EER: every pair of identity photos (faces-calib: 1,504 genuine, about 1.1M impostor pairs).

Each photo's embeddings and quality measurements are cached in the temp directory (--no-cache recomputes
them). --write-calibration writes models/data/face_v2_calibration.json from faces-calib: the fusion weights
and the table cosine -> per-comparison false-match rate (FMR) the service's scores come from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from bench.common import format_table, load_image
from models.analyzer import ModelConfig
from models.arrays import to_rgb
from models.calibration import CALIBRATION_PATH, FaceScoreCalibration, fit_score_table, threshold_at_rate
from models.chips import align_chip
from models.embedder import FaceEmbedder, SFaceEmbedder, fuse_vectors
from models.quality import Pose, assess_quality, judge_quality
from models.sessions import SessionOptions
from models.weights import WEIGHTS, converted
from tests.faces_dev import LabelledImage, faces_dev_dir, load_faces_dev

CALIB_DIR = faces_dev_dir().parent / "faces-calib"
FARS = (1e-2, 1e-3, 1e-4)
FPIRS = (0.10, 0.01)
CANDIDATES = 10  # the service's default list length


# ---- embeddings -------------------------------------------------------------------------------------------


CACHE_VERSION = "5"
QUALITY_FIELDS = ("face_size_px", "detector_score", "sharpness", "yaw", "pitch", "roll_deg")


@dataclass(frozen=True)
class PhotoSet:
    names: list[str]
    identities: list[str]
    found: np.ndarray  # bool [N]: a face was detected
    dlib: np.ndarray  # float32 [N, 128], raw dlib descriptors
    sface: np.ndarray  # float32 [N, 128], L2-normalised
    quality: np.ndarray  # float64 [N, len(QUALITY_FIELDS)]
    enrol_ok: np.ndarray  # bool [N]
    search_ok: np.ndarray  # bool [N]
    reasons: list[str]  # "+"-joined enrolment reasons


def _cache_path(images: list[LabelledImage]) -> Path:
    digest = hashlib.sha256(CACHE_VERSION.encode())
    # Other weights (or a changed alignment/quality code path, via CACHE_VERSION) mean other embeddings.
    for name in ("yunet_2023mar_int8bq", "dlib_shape5", "dlib_resnet_v1", "sface_2021dec_int8bq"):
        digest.update(WEIGHTS[name].sha256.encode())
    for item in images:
        digest.update(f"{item.path}|{item.identity}\n".encode())
    return Path(tempfile.gettempdir()) / f"facesearch-embeddings-{digest.hexdigest()[:16]}.npz"


def extract(images: list[LabelledImage], threads: int = 2, use_cache: bool = True) -> PhotoSet:
    """The largest face of each photo: its dlib and SFace descriptors and its quality measurements, judged
    by today's quality bars (the measurements are cached, the verdicts are not)."""
    cache = _cache_path(images)
    if use_cache and cache.is_file():
        with np.load(cache, allow_pickle=False) as data:
            found, dlib_v, sface_v, quality = (data[k] for k in ("found", "dlib", "sface", "quality"))
    else:
        config = ModelConfig(intra_op_threads=threads)
        detector, cropper = config.load_detector(), config.load_cropper()
        options = SessionOptions(intra_op_threads=threads)
        dlib_embedder = FaceEmbedder(converted("dlib_resnet_v1"), options)
        sface = SFaceEmbedder(converted("sface_2021dec_int8bq"), options)
        found = np.zeros(len(images), bool)
        dlib_v, sface_v = np.zeros((len(images), 128), np.float32), np.zeros((len(images), 128), np.float32)
        quality = np.full((len(images), len(QUALITY_FIELDS)), np.nan)
        started = time.perf_counter()
        for index, item in enumerate(images):
            rgb = to_rgb(load_image(item.path))
            faces = detector.detect([rgb])[0]
            if not faces:
                continue
            face = max(faces, key=lambda found_face: found_face.area)
            found[index] = True
            crops = cropper(rgb, [face], embed=True, estimate_age=False)
            assert crops.descriptor_chips is not None
            dlib_v[index] = dlib_embedder.embed(crops.descriptor_chips)[0]
            chip = align_chip(rgb, face.landmarks)[None]
            sface_v[index] = sface.embed(chip)[0]
            measured = assess_quality(face, chip[0])
            quality[index] = [getattr(measured, name) for name in QUALITY_FIELDS]
            if index % 200 == 199:
                print(
                    f"  {index + 1}/{len(images)} photos, {time.perf_counter() - started:.0f} s", flush=True
                )
        np.savez(cache, found=found, dlib=dlib_v, sface=sface_v, quality=quality)
    n = len(images)
    enrol_ok, search_ok, reasons = np.zeros(n, bool), np.zeros(n, bool), ["no_face"] * n
    for row in np.flatnonzero(found):
        index = int(row)
        size, score, sharpness, yaw, pitch, roll = (float(v) for v in quality[index])
        verdict = judge_quality(size, score, sharpness, Pose(yaw=yaw, pitch=pitch, roll_deg=roll))
        enrol_ok[index], search_ok[index] = verdict.enrol_ok, verdict.search_ok
        reasons[index] = "+".join(verdict.reasons)
    names = [item.path.name for item in images]
    identities = [item.identity or item.path.name for item in images]
    return PhotoSet(names, identities, found, dlib_v, sface_v, quality, enrol_ok, search_ok, reasons)


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
    return [
        Variant("dlib (v1, Euclidean)", photos.dlib, negative_distance),
        Variant("SFace", photos.sface, cosine),
        Variant("dlib+SFace fused (v2)", fused, cosine),
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
) -> Trial:
    """Both folds' probes searched against their gallery (enrol_ok: the enrolment gate, see folds)."""
    ids = np.asarray(identities)
    mate_scores, rank1, nonmated_best = [], [], []
    for gallery, mated, nonmated in folds(identities, found, enrol_ok):
        enrolled = [g for g in gallery if found[g]]
        gallery_vectors = variant.vectors[enrolled]
        gallery_ids = ids[enrolled]
        for probes, is_mated in ((mated, True), (nonmated, False)):
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


# ---- reports ----------------------------------------------------------------------------------------------


def model_table(label: str, photos: PhotoSet, weights: tuple[float, float]) -> str:
    rows = []
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
            ]
        )
    genuine_n, impostor_n = pair_scores(np.zeros((len(photos.names),) * 2), photos.identities, photos.found)
    trial_sizes = run_trial(variants(photos, weights)[1], photos.identities, photos.found)
    header = ["model", *(f"TAR@FAR {far:g}" for far in FARS), "EER", "rank-1"]
    header += [f"FNIR@FPIR {int(f * 100)}%" for f in FPIRS]
    return (
        f"## {label}: {int(photos.found.sum())}/{len(photos.names)} photos with a face; "
        f"{len(genuine_n)} genuine / {len(impostor_n)} impostor pairs; 1:N (2 folds): "
        f"{len(trial_sizes.mated_mate)} mated / {len(trial_sizes.nonmated_best)} non-mated probes\n"
        + format_table(header, rows)
    )


def calibration(photos: PhotoSet, weights: tuple[float, float]) -> dict[str, object]:
    """Cosine -> FMR knots of the fused v2 vector, with the fitted exponential tail (the service's rule for
    every face model's table: models.calibration.fit_score_table)."""
    fused = fuse_vectors(unit(photos.dlib), photos.sface, weights)
    genuine, impostor = pair_scores(cosine(fused, fused), photos.identities, photos.found)
    table = fit_score_table(impostor, "face_v2_dlib_sface")
    knots = cast(list[dict[str, float]], table["knots"])
    return {
        "model_version": table["model_version"],
        "source": "python -m bench.identification --write-calibration (faces-calib identity photos)",
        "impostor_pairs": table["impostor_pairs"],
        "genuine_pairs": len(genuine),
        "fusion_weights": {"dlib": weights[0], "sface": weights[1]},
        "tail": table["tail"],
        "knots": knots,
        "genuine_share_below": {
            f"{k['cosine']:.4f}": round(float(np.mean(genuine < k["cosine"])), 5) for k in knots[::2]
        },
    }


def calibration_table(calib: FaceScoreCalibration, photos: PhotoSet) -> str:
    assert calib.fusion_weights is not None  # face model v2's table
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
    return "\n".join(lines) + "\n" + table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.identification", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--faces-dev", type=Path, default=None)
    parser.add_argument("--faces-calib", type=Path, default=CALIB_DIR)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--write-calibration", action="store_true", help=f"write {CALIBRATION_PATH.name}")
    parser.add_argument("--no-cache", action="store_true", help="recompute the per-photo embeddings")
    args = parser.parse_args(argv)

    calib_set = load_faces_dev(args.faces_calib)
    dev_set = load_faces_dev(args.faces_dev)
    calib_images = calib_set.of_kind("identity")
    dev_images: list[LabelledImage] = dev_set.of_kind("identity") + dev_set.of_kind("age")
    started = time.perf_counter()
    calib = extract(calib_images, args.threads, use_cache=not args.no_cache)
    dev = extract(dev_images, args.threads, use_cache=not args.no_cache)
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

    for label, photos in (("faces-calib", calib), ("faces-dev", dev)):
        print(f"\n{model_table(label, photos, weights)}")

    table = FaceScoreCalibration.load()
    print(
        f"\n## Calibration ({CALIBRATION_PATH.name}): score = -log10(FMR) / 10\n"
        + calibration_table(table, calib)
    )
    print(f"\n## Default minimum score by gallery size\n{gallery_threshold_table(table)}")
    for label, photos in (("faces-calib", calib), ("faces-dev", dev)):
        print(f"\n## Quality gate on {label}\n{quality_table(photos, weights)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
