"""`facesearch calibrate` fits a threshold on half of faces-calib's people and sets it on the running
service (the session's) as the service-wide default; the other half, searched through the API against a
gallery of the size calibrated for, then falls at the target FPIR within the binomial noise of both halves.

Bounded: a fixed, deterministic subset (people sorted by name and dealt alternately into the two halves):
CALIBRATION_PHOTOS photos analysed in this process, then GALLERY enrolments and NONMATED_PROBES searches
through the API. The target (FPIR 10 % at a gallery of 60) is chosen so both halves measure it: about 80
non-mated comparisons of the calibration half are expected above the threshold, and about 15 of the held-out
searches, which keeps the acceptance band narrow enough to tell the calibrated bar from the default one
(FPIR 1 %: about 1.5 of 150). Its cost on the shared 2-core machine is stated in the closing note.
"""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_app.launch.cli import main
from serve_app.pipelines.calibration import binomial_quantile, clopper_pearson, fpir_at_gallery
from serve_app.wiring.stores import redis_stores
from tests.faces_dev import FacesDev, LabelledImage
from tests.integration.api_client import face_search_multipart, reference_of, wait_result
from tests.service_harness import RunningService

pytestmark = pytest.mark.service

TARGET_FPIR = 0.1
GALLERY = 60
CALIBRATION_PHOTOS = 300
NONMATED_PROBES = 150
# Two-sided: the chance that a correct calibration lands outside the band (the photos are fixed, so a
# result is the same on every run; this bounds how unlucky the fixed subset may be).
ALPHA = 0.001


def halves(calib: FacesDev) -> tuple[list[LabelledImage], list[LabelledImage], list[LabelledImage]]:
    """(calibration photos, held-out gallery photos, held-out non-mated probes), deterministic."""
    people = calib.by_identity()
    names = sorted(people)
    calibration: list[LabelledImage] = []
    for name in names[0::2]:
        if len(calibration) >= CALIBRATION_PHOTOS:
            break
        calibration.extend(people[name])
    held_out = names[1::2]
    gallery = [people[name][0] for name in held_out[:GALLERY]]
    probes = [photo for name in held_out[GALLERY:] for photo in people[name]][:NONMATED_PROBES]
    assert len(gallery) == GALLERY and len(probes) == NONMATED_PROBES
    return calibration, gallery, probes


def _search_all(
    http: httpx.Client, token: str, photos: list[LabelledImage], **fields: Any
) -> list[dict[str, Any]]:
    """Submit every photo, then wait for every result (the worker runs them side by side)."""
    references = [reference_of(face_search_multipart(http, token, photo.path, **fields)) for photo in photos]
    return [wait_result(http, token, reference, timeout_s=600)["result"]["data"] for reference in references]


def test_a_threshold_calibrated_on_half_the_people_holds_on_the_other_half(
    service: RunningService,
    faces_dev: FacesDev,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calib = faces_dev.sibling("faces-calib")
    calibration, gallery, probes = halves(calib)
    labels = tmp_path / "labels.csv"
    with labels.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "identity", "notes"])
        writer.writerows([photo.path.name, photo.identity, "calibration half"] for photo in calibration)

    # The admin command reaches the running service as the operator's would: its data directory.
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(service.data_dir))
    clients = redis_stores(service.settings).clients
    try:
        status = main(
            [
                "calibrate", str(labels), "--photos", str(calib.root), "--target-fpir", str(TARGET_FPIR),
                "--gallery-size", str(GALLERY), "--apply", "default", "--json", "--no-progress",
            ]
        )  # fmt: skip
        printed = capsys.readouterr()
        assert status == 0, printed.err
        report = json.loads(printed.out)
        target = report["target"]
        assert report["gallery_size"] == GALLERY and target["measurable"] and not report["warnings"]
        assert asyncio.run(clients.default_min_score()) == target["score"]

        # The held-out half, through the API, with no setting of the client's own: the default applies.
        token = service.token_for(service.new_client("calibrate-held-out"))
        with service.http(60) as http:
            enrolled = _search_all(http, token, gallery, enroll_face=1)
            gallery_size = sum(
                bool(data["face_search_response"]["result"].get("enrolled")) for data in enrolled
            )
            searched = _search_all(http, token, probes, enroll_face=0)
    finally:
        asyncio.run(clients.set_default_min_score(None))

    results = [data["face_search_response"]["result"] for data in searched]
    # Probes below the search bar are held to a ten times lower FPIR by the service and were left out of
    # the calibration; a photo without a face is no search.
    counted = [r for r in results if r["is_face_found"] and not r.get("probe_quality")]
    false_positives = sum(bool(r["matched_faces"]) for r in counted)
    assert gallery_size >= GALLERY - 5 and len(counted) >= NONMATED_PROBES - 10

    # The calibration half measured the threshold's FMR (its false matches of its non-mated comparisons);
    # carried to the gallery actually enrolled, the held-out count must fall in the binomial band of it.
    low, high = clopper_pearson(target["false_matches"], report["nonmated_comparisons"], 1 - ALPHA)
    fewest = binomial_quantile(ALPHA / 2, len(counted), fpir_at_gallery(low, gallery_size))
    most = binomial_quantile(1 - ALPHA / 2, len(counted), fpir_at_gallery(high, gallery_size))
    measured = false_positives / len(counted)
    calibrated = f"min_score {target['score']}, FPIR {target['fpir']:.3f} of {report['nonmated_comparisons']}"
    held_out = f"{false_positives}/{len(counted)} = {measured:.3f} at a gallery of {gallery_size}"
    print(f"calibrated: {calibrated}; held out: {held_out}; band [{fewest}, {most}]")
    assert fewest <= false_positives <= most
