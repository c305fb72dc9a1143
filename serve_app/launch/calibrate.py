"""`facesearch calibrate LABELS.csv --photos DIR --target-fpir 0.01 [--gallery-size N]
[--apply default|CLIENT_ID]`: the serving face model's threshold for a target false-positive
identification rate, measured on the operator's own labelled photos (serve_app.pipelines.calibration),
printed, and optionally set on the running service: as the service-wide default minimum score or as one
client's (the clients store in Redis, which the workers re-read every few seconds, so no restart is
needed). Reaches the running service as the other admin commands do
(serve_app.launch.cli.running_service_settings).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_app.settings import Settings

APPLY_DEFAULT = "default"


def add_parser(commands: Any) -> None:
    """Register the subcommand on `facesearch`'s subparsers."""
    parser = commands.add_parser(
        "calibrate",
        help="the match threshold for a target false-positive identification rate, from your own labelled "
        "photos; optionally set it on the running service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "labels", type=Path, help="CSV with a header row naming at least `file` and `identity`"
    )
    parser.add_argument(
        "--photos", type=Path, required=True, help="the folder the `file` column is relative to"
    )
    parser.add_argument(
        "--target-fpir",
        type=float,
        default=0.01,
        help="share of searches for someone not enrolled that may return a match (default 0.01)",
    )
    parser.add_argument(
        "--gallery-size",
        type=int,
        default=None,
        help="faces in the gallery the threshold is for (default: the people enrolled from these photos)",
    )
    parser.add_argument(
        "--apply",
        metavar="default|CLIENT_ID",
        help="set the threshold on the running service: as the service-wide default minimum score, or as "
        "this client's",
    )
    parser.add_argument(
        "--write-scores",
        type=Path,
        metavar="FILE",
        help="write the score table of an operator's face model (FACESEARCH_FACE_MODEL_PATH) fitted on "
        "these photos; serve it with FACESEARCH_FACE_MODEL_SCORES=FILE",
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="of the intervals reported (default 0.95)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--threads", type=int, default=2, help="ONNX Runtime threads per analysis (default 2)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(options: argparse.Namespace, attach: Callable[[], Settings]) -> int:
    """attach: the running service's settings (serve_app.launch.cli.running_service_settings), for --apply;
    it raises RuntimeError saying where it looked when there is none."""
    try:
        return asyncio.run(_run(options, attach))
    except CalibrationFailed as error:
        message = str(error)
        print(
            message if message.startswith("facesearch") else f"facesearch calibrate: {message}",
            file=sys.stderr,
        )
        return 2


class CalibrationFailed(Exception):
    """A reason the command stops; printed as is."""


async def _run(options: argparse.Namespace, attach: Callable[[], Settings]) -> int:
    from models.errors import ModelError
    from serve_app.pipelines.calibration import LabelsError, calibrate, compare, read_labels

    if not 0.0 < options.target_fpir < 1.0:
        raise CalibrationFailed(f"--target-fpir must lie in (0, 1), got {options.target_fpir}")
    if options.gallery_size is not None and options.gallery_size < 1:
        raise CalibrationFailed(f"--gallery-size must be at least 1, got {options.gallery_size}")
    if not 0.5 <= options.confidence < 1.0:
        raise CalibrationFailed(f"--confidence must lie in [0.5, 1), got {options.confidence}")
    # Reach the running service first: a wrong environment should not cost the whole analysis.
    service = _running_service(attach) if options.apply else None
    settings = service or Settings()
    try:
        photos = read_labels(options.labels)
        analysis, version, scores = await _models(settings, options)
        measured = await _measure(photos, options, settings, analysis)
        comparisons = compare(measured)
        if options.write_scores is not None:
            scores = _write_scores(comparisons.nonmated, version, options.write_scores)
        report = calibrate(
            comparisons, options.target_fpir, options.gallery_size, version, scores, options.confidence
        )
    except (LabelsError, ModelError, ValueError) as error:
        raise CalibrationFailed(str(error)) from error
    print(json.dumps(report_json(report), indent=1) if options.json else report_text(report), flush=True)
    if service is not None:
        return await _apply(service, options.apply, report)
    return 0


def _running_service(attach: Callable[[], Settings]) -> Settings:
    try:
        return attach()
    except RuntimeError as error:  # NoRunningService: its message says where it looked and what to set
        raise CalibrationFailed(str(error)) from error


async def _models(settings: Settings, options: argparse.Namespace) -> tuple[Any, str, Any]:
    """The serving face model in this process (the service's analysis), its version and score table (None
    for an operator's model without one)."""
    import dataclasses as dc

    from models.analyzer import load_face_analyzer
    from models.calibration import FaceScoreCalibration
    from serve_app.pipelines.analysis import LocalAnalysis
    from serve_app.wiring.models import model_config, operator_face_model, score_calibration

    operator = operator_face_model(settings)
    if options.write_scores is not None and operator is None:
        raise CalibrationFailed(
            "--write-scores is for a face model you bring (FACESEARCH_FACE_MODEL_PATH); face model v2's "
            "table ships with it"
        )
    config = dc.replace(model_config(None, settings), intra_op_threads=max(1, options.threads))
    analyzer = await asyncio.to_thread(load_face_analyzer, config)
    scores: FaceScoreCalibration | None = None
    if operator is None or (operator.scores is not None and operator.scores.is_file()):
        scores = score_calibration(settings)
    version = operator.version if operator is not None else analyzer.embedder.version
    return LocalAnalysis(analyzer), version, scores


async def _measure(photos: Any, options: argparse.Namespace, settings: Settings, analysis: Any) -> Any:
    from tqdm import tqdm

    from serve_app.pipelines.calibration import measure_photos
    from serve_app.pipelines.reindex import ImageLimits

    limits = ImageLimits(settings.limits.max_image_pixels, settings.models.analysis_max_side)
    progress = tqdm(total=len(photos), desc="calibrate", unit="photo", disable=options.no_progress)
    try:
        return await measure_photos(photos, options.photos, analysis, limits, on_photo=progress.update)
    finally:
        progress.close()


def _write_scores(nonmated: Any, version: str, path: Path) -> Any:
    from models.calibration import FaceScoreCalibration, fit_score_table

    table = {**fit_score_table(nonmated, version), "source": "facesearch calibrate --write-scores"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote the score table of {version} to {path}", file=sys.stderr)
    return FaceScoreCalibration.load(path)


async def _apply(settings: Settings, target: str, report: Any) -> int:
    from serve_app.wiring.stores import redis_stores

    point = report.target
    if point.score is None:
        print(
            "not applied: the face model has no score table yet; run again with --write-scores FILE and "
            "serve it with FACESEARCH_FACE_MODEL_SCORES=FILE",
            file=sys.stderr,
        )
        return 1
    if not point.measurable:
        print("not applied: the photos are too few for the target (see the warning above)", file=sys.stderr)
        return 1
    clients = redis_stores(settings).clients
    if target == APPLY_DEFAULT:
        before = await clients.default_min_score()
        await clients.set_default_min_score(point.score)
        print(f"service-wide default min_score: {_shown(before)} -> {point.score}", file=sys.stderr)
        return 0
    info = await clients.get(target)
    if info is None:
        print(f"not applied: no client {target}", file=sys.stderr)
        return 1
    await clients.update_search_settings(target, point.score, info.max_matches)
    print(f"{target}: min_score {_shown(info.min_score)} -> {point.score}", file=sys.stderr)
    return 0


def _shown(value: float | None) -> str:
    return "unset" if value is None else f"{value}"


def inspect_models(path: Path | None) -> int:
    """`facesearch models inspect PATH`: each ONNX file judged against the ArcFace format, with what the
    FACESEARCH_FACE_MODEL_* settings take for the one the service can serve."""
    from models.arcface import inspect
    from models.errors import ModelError

    if path is None:
        print("inspect needs a PATH: an ONNX file, or a folder of them", file=sys.stderr)
        return 2
    try:
        found = inspect(path)
    except ModelError as error:
        print(f"facesearch models inspect: {error}", file=sys.stderr)
        return 2
    for model in found:
        print(
            json.dumps(
                {
                    "file": str(model.path.resolve()),
                    "sha256": model.sha256,
                    "arcface_recognition_model": model.recognition,
                    "embedding_size": model.dim,
                    "note": model.note,
                }
            )
        )
    recognition = [model for model in found if model.recognition]
    for model in recognition:
        print(
            f"# to serve {model.path.name}: FACESEARCH_FACE_MODEL_PATH={model.path.resolve()} "
            f"FACESEARCH_FACE_MODEL_SHA256={model.sha256} FACESEARCH_FACE_MODEL_DIM={model.dim}",
            file=sys.stderr,
        )
    return 0 if recognition else 1


# ---- output ------------------------------------------------------------------------------------------------


def report_json(report: Any) -> dict[str, Any]:
    comparisons = report.comparisons
    return {
        "model_version": report.model_version,
        "gallery_size": report.gallery_size,
        "gallery_size_stated": report.gallery_size_stated,
        "photos": comparisons.photos,
        "identities": comparisons.identities,
        "gallery_entries": comparisons.gallery_entries,
        "skipped": comparisons.skipped,
        "nonmated_comparisons": len(comparisons.nonmated),
        "mated_probes": len(comparisons.mated),
        "target": _finite(dataclasses.asdict(report.target)),
        "confidence": report.confidence,
        "compared_people": comparisons.compared_people,
        "cosine_interval": list(report.cosine_interval),
        "score_interval": list(report.score_interval) if report.score_interval else None,
        "people_interval": dataclasses.asdict(report.people) if report.people else None,
        "people_score_interval": list(report.people_score_interval) if report.people_score_interval else None,
        "table": [_finite(dataclasses.asdict(point)) for point in report.table],
        "warnings": list(report.warnings),
    }


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: an undefined FNIR (no mated probe) is null."""
    return {
        key: None if isinstance(value, float) and math.isnan(value) else value for key, value in row.items()
    }


def _range(bounds: tuple[float, float]) -> str:
    return f"{_percent(bounds[0])} to {_percent(bounds[1])}"


def _interval(scores: tuple[float, float] | None, cosines: tuple[float, float]) -> str:
    similarity = f"similarity {cosines[0]:.4f} to {cosines[1]:.4f}"
    return similarity if scores is None else f"min_score {scores[0]:.4f} to {scores[1]:.4f}, {similarity}"


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.2f}%"


def report_text(report: Any) -> str:
    comparisons = report.comparisons
    n = len(comparisons.nonmated)
    skipped = ", ".join(f"{count} {why}" for why, count in comparisons.skipped.items() if count) or "none"
    size = f"{report.gallery_size:,}"
    size_note = (
        "stated" if report.gallery_size_stated else "the people enrolled from these photos; state yours"
    )
    lines = [
        f"face model: {report.model_version}",
        f"photos: {comparisons.photos:,} of {comparisons.identities:,} people; left out: {skipped}",
        f"gallery entries: {comparisons.gallery_entries:,} people (their first photo meeting the enrolment "
        f"bar); mated probes: {len(comparisons.mated):,}; non-mated comparisons: {n:,}",
        f"gallery size N: {size} ({size_note}{'' if report.gallery_size_stated else ' with --gallery-size'})",
        "",
        f"1:N at N = {size}: FPIR = 1 - (1 - FMR)^N; FNIR: mated probes scoring below the threshold",
    ]
    header = [
        "target FPIR",
        "FMR/comparison",
        "min_score",
        "similarity",
        "non-mated >=",
        "FPIR measured",
        "FNIR",
    ]
    rows = []
    for point in report.table:
        measured = point.measurable
        rows.append(
            [
                f"{point.target_fpir:g}",
                f"{point.target_fmr:.3g}",
                "-" if point.score is None else f"{point.score:.4f}",
                f"{point.cosine:.4f}",
                f"{point.false_matches:,}" if measured else "too few",
                f"{_percent(point.fpir)}" if measured else "-",
                _percent(point.fnir),
            ]
        )
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    target = report.target
    level = f"{100 * report.confidence:g} %"
    lines += [
        "",
        f"threshold for FPIR {target.target_fpir:g} at N = {size}: "
        + (f"min_score {target.score:.4f}, " if target.score is not None else "")
        + f"similarity {target.cosine:.4f}",
        f"  {level} interval from the {n:,} non-mated comparisons: "
        + _interval(report.score_interval, report.cosine_interval),
    ]
    over_people = ""
    if report.people is not None:
        lines.append(
            f"  {level} interval over the {comparisons.compared_people:,} people compared (resampled): "
            + _interval(report.people_score_interval, report.people.cosine)
        )
        over_people = f", {_range(report.people.fpir)} over people"
    lines.append(
        f"  at it: FPIR {_percent(target.fpir)} ({level} interval {_range(target.fpir_interval)} from the "
        f"comparisons{over_people}), FNIR {_percent(target.fnir)} ({target.misses:,} of "
        f"{len(comparisons.mated):,} mated probes)"
    )
    if target.score is None:
        lines.append("  no score table for this face model yet: --write-scores FILE fits one on these photos")
    lines += [f"warning: {warning}" for warning in report.warnings]
    return "\n".join(lines)
