"""The serving face model from Settings: one reading of FACESEARCH_FACE_MODEL_* for every process, so the
ingress, the worker, its model deployments and the command-line tools agree on the gallery version.

served_face_model and operator_face_model load no model library (the ingress uses them to name the gallery's
collection); model_config and score_calibration are for the processes that run or score the models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from models.calibration import CALIBRATION_PATH, FaceScoreCalibration
from models.errors import ModelFormatError
from models.face_model import OperatorFaceModel, ServedFaceModel, served_face_model
from serve_app.settings import Settings

if TYPE_CHECKING:
    from models.analyzer import ModelConfig


def operator_face_model(settings: Settings) -> OperatorFaceModel | None:
    """The recognition model the operator declared, or None (face model v2)."""
    models = settings.models
    if models.face_model_path is None or models.face_model_sha256 is None:
        return None
    return OperatorFaceModel(
        path=models.face_model_path,
        sha256=models.face_model_sha256,
        dim=models.face_model_dim,
        scores=models.face_model_scores,
    )


def serving_face_model(settings: Settings) -> ServedFaceModel:
    """The serving face model's version and vector size."""
    return served_face_model(operator_face_model(settings))


def model_config(raw: Mapping[str, Any] | None, settings: Settings) -> ModelConfig:
    """A config file's `model_config` with the settings' face model: what every model loader builds."""
    import dataclasses

    from models.analyzer import ModelConfig

    return dataclasses.replace(ModelConfig.from_dict(raw or {}), face_model=operator_face_model(settings))


def score_calibration(settings: Settings) -> FaceScoreCalibration:
    """The score table of the serving face model: the shipped one of face model v2, or the operator's
    (FACESEARCH_FACE_MODEL_SCORES), which must name the model's version."""
    operator = operator_face_model(settings)
    if operator is None:
        return FaceScoreCalibration.load(CALIBRATION_PATH)
    if operator.scores is None:
        raise ModelFormatError(
            f"the face model {operator.path} has no score table: write one with `facesearch calibrate "
            "LABELS.csv --photos DIR --write-scores FILE` (the model declared as it is now) and set "
            "FACESEARCH_FACE_MODEL_SCORES=FILE"
        )
    table = FaceScoreCalibration.load(operator.scores)
    if table.model_version != operator.version:
        raise ModelFormatError(
            f"the score table {operator.scores} is for {table.model_version!r}, the face model is "
            f"{operator.version!r}: write its own with `facesearch calibrate --write-scores`"
        )
    return table
