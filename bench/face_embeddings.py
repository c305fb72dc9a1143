"""Per-photo face embeddings of a labelled photo set for every descriptor variant, cached in a temp file.

Used by bench.identification (1:N protocol, verification, calibration, quality gate). The largest face of
each photo is taken, as the service does. Variants: dlib ResNet (150 px dlib chip), SFace fp32 and SFace
with ONNX Runtime dynamic int8 quantisation (112 px ArcFace-aligned chip).
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import load_image
from models.analyzer import ModelConfig
from models.arrays import to_rgb
from models.chips import align_chip
from models.convert import ensure_descriptor_model
from models.embedder import FaceEmbedder, SFaceEmbedder
from models.quality import Pose, assess_quality, judge_quality
from models.sessions import SessionOptions
from models.sface import ensure_sface_model
from models.weights import WEIGHTS
from tests.faces_dev import LabelledImage

CACHE_VERSION = "3"
QUALITY_FIELDS = ("face_size_px", "detector_score", "sharpness", "yaw", "pitch", "roll_deg")


@dataclass(frozen=True)
class PhotoSet:
    names: list[str]
    identities: list[str]
    found: np.ndarray  # bool [N]: a face was detected
    dlib: np.ndarray  # float32 [N, 128], raw dlib descriptors
    sface: np.ndarray  # float32 [N, 128], L2-normalised
    sface_int8: np.ndarray  # float32 [N, 128], L2-normalised
    quality: np.ndarray  # float64 [N, len(QUALITY_FIELDS)]
    enrol_ok: np.ndarray  # bool [N]
    search_ok: np.ndarray  # bool [N]
    reasons: list[str]  # "+"-joined enrolment reasons


def quantized_sface_path(models_dir: Path | None) -> Path:
    """SFace with dynamic int8 weights (ONNX Runtime's quantize_dynamic: no calibration data)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = ensure_sface_model(models_dir)
    target = source.with_name(source.stem + "-dynint8.onnx")
    if not target.is_file():
        quantize_dynamic(
            str(source), str(target), op_types_to_quantize=["Conv", "Gemm"], weight_type=QuantType.QUInt8
        )
    return target


def _cache_path(images: list[LabelledImage]) -> Path:
    digest = hashlib.sha256(CACHE_VERSION.encode())
    # Other weights (or a changed alignment/quality code path, via CACHE_VERSION) mean other embeddings.
    for name in ("yunet_2023mar_int8bq", "dlib_shape5", "dlib_resnet_v1", "sface_2021dec_int8bq"):
        digest.update(WEIGHTS[name].sha256.encode())
    for item in images:
        digest.update(f"{item.path}|{item.identity}\n".encode())
    return Path(tempfile.gettempdir()) / f"facesearch-embeddings-{digest.hexdigest()[:16]}.npz"


def extract(images: list[LabelledImage], threads: int = 2, use_cache: bool = True) -> PhotoSet:
    cache = _cache_path(images)
    if use_cache and cache.is_file():
        data = np.load(cache, allow_pickle=False)
        return with_current_gate(
            PhotoSet(
                names=[str(v) for v in data["names"]],
                identities=[str(v) for v in data["identities"]],
                found=data["found"],
                dlib=data["dlib"],
                sface=data["sface"],
                sface_int8=data["sface_int8"],
                quality=data["quality"],
                enrol_ok=data["enrol_ok"],
                search_ok=data["search_ok"],
                reasons=[str(v) for v in data["reasons"]],
            )
        )
    config = ModelConfig(intra_op_threads=threads)
    detector, cropper = config.load_detector(), config.load_cropper()
    options = SessionOptions(intra_op_threads=threads)
    dlib_embedder = FaceEmbedder(ensure_descriptor_model(None), options)
    sface = SFaceEmbedder(ensure_sface_model(None), options)
    sface_q = SFaceEmbedder(quantized_sface_path(None), options)
    n = len(images)
    found = np.zeros(n, bool)
    dlib_v = np.zeros((n, 128), np.float32)
    sface_v = np.zeros((n, 128), np.float32)
    sface_q_v = np.zeros((n, 128), np.float32)
    quality = np.full((n, len(QUALITY_FIELDS)), np.nan)
    enrol_ok = np.zeros(n, bool)
    search_ok = np.zeros(n, bool)
    reasons = [""] * n
    started = time.perf_counter()
    for index, item in enumerate(images):
        rgb = to_rgb(load_image(item.path))
        faces = detector.detect([rgb])[0]
        if not faces:
            reasons[index] = "no_face"
            continue
        face = max(faces, key=lambda found_face: found_face.area)
        found[index] = True
        crops = cropper(rgb, [face], embed=True, estimate_age=False)
        assert crops.descriptor_chips is not None
        dlib_v[index] = dlib_embedder.embed(crops.descriptor_chips)[0]
        chip = align_chip(rgb, face.landmarks)[None]
        sface_v[index] = sface.embed(chip)[0]
        sface_q_v[index] = sface_q.embed(chip)[0]
        q = assess_quality(face, chip[0])
        quality[index] = [getattr(q, name) for name in QUALITY_FIELDS]
        enrol_ok[index], search_ok[index] = q.enrol_ok, q.search_ok
        reasons[index] = "+".join(q.reasons)
        if index % 200 == 199:
            print(f"  {index + 1}/{n} photos, {time.perf_counter() - started:.0f} s", flush=True)
    result = PhotoSet(
        names=[item.path.name for item in images],
        identities=[item.identity or item.path.name for item in images],
        found=found,
        dlib=dlib_v,
        sface=sface_v,
        sface_int8=sface_q_v,
        quality=quality,
        enrol_ok=enrol_ok,
        search_ok=search_ok,
        reasons=reasons,
    )
    np.savez(
        cache,
        names=np.asarray(result.names),
        identities=np.asarray(result.identities),
        found=found,
        dlib=dlib_v,
        sface=sface_v,
        sface_int8=sface_q_v,
        quality=quality,
        enrol_ok=enrol_ok,
        search_ok=search_ok,
        reasons=np.asarray(reasons),
    )
    return result


def time_embedders(
    chips_dlib: np.ndarray, chips_sface: np.ndarray, threads: int, batch: int
) -> dict[str, float]:
    """ms per face of each descriptor variant on the given chips, in runs of `batch` faces."""
    options = SessionOptions(intra_op_threads=threads)
    dlib_embedder = FaceEmbedder(ensure_descriptor_model(None), options)
    runners = {
        "dlib": (dlib_embedder.embed, chips_dlib),
        "sface_fp32": (SFaceEmbedder(ensure_sface_model(None), options).embed, chips_sface),
        "sface_int8": (SFaceEmbedder(quantized_sface_path(None), options).embed, chips_sface),
    }
    timings = {}
    for name, (embed, chips) in runners.items():
        embed(chips[:batch])
        best = float("inf")
        for _ in range(3):  # best of three passes: the cores are shared, the minimum is the model's cost
            started = time.perf_counter()
            for start in range(0, len(chips), batch):
                embed(chips[start : start + batch])
            best = min(best, time.perf_counter() - started)
        timings[name] = 1000.0 * best / max(len(chips), 1)
    return timings


def with_current_gate(photos: PhotoSet) -> PhotoSet:
    """The quality verdicts re-judged from the cached measurements with today's thresholds."""
    enrol_ok = photos.enrol_ok.copy()
    search_ok = photos.search_ok.copy()
    reasons = list(photos.reasons)
    for index in np.flatnonzero(photos.found):
        size, score, sharpness, yaw, pitch, roll = (float(v) for v in photos.quality[index])
        verdict = judge_quality(size, score, sharpness, Pose(yaw=yaw, pitch=pitch, roll_deg=roll))
        enrol_ok[index], search_ok[index] = verdict.enrol_ok, verdict.search_ok
        reasons[index] = "+".join(verdict.reasons)
    return dataclasses.replace(photos, enrol_ok=enrol_ok, search_ok=search_ok, reasons=reasons)
