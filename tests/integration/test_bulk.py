"""`facesearch enroll` / `facesearch erase` over real photos against the real service: failures CSV,
resuming (done rows skipped, an interrupted row's transaction waited for, not submitted again), folder
mode, erasure."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from facesearch_client import FaceSearchClient
from serve_app.launch.cli import main
from tests.faces_dev import FacesDev
from tests.service_harness import Client, RunningService

pytestmark = pytest.mark.service


def run_cli(
    capsys: pytest.CaptureFixture[str], service: RunningService, client: Client, *args: str
) -> tuple[int, dict[str, Any]]:
    code = main(
        [
            *args,
            "--url",
            service.base_url,
            "--client-id",
            client.client_id,
            # The "=" form: an option's value may begin with "-".
            f"--client-secret={client.client_secret}",
            "--concurrency",
            "3",
            "--no-progress",
        ]
    )
    summary: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, summary


def write_csv(path: Path, rows: list[tuple[Path, str]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "client_reference"])
        writer.writerows((str(photo), reference) for photo, reference in rows)


def test_bulk_enrolment_resumes_and_reports_failures(
    service: RunningService, faces_dev: FacesDev, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = service.new_client("bulk")
    api = FaceSearchClient(service.base_url, client.client_id, client.client_secret)
    identities = list(faces_dev.by_identity().values())
    photos = [(group[0].path, f"bulk-{n:03d}") for n, group in enumerate(identities[:6])]
    negative = faces_dev.of_kind("negative")[0].path
    source, state, failures = tmp_path / "gallery.csv", tmp_path / "state.jsonl", tmp_path / "failures.csv"
    files = ("--state", str(state), "--failures", str(failures))

    write_csv(source, [*photos[:3], (negative, "bulk-negative")])
    code, summary = run_cli(capsys, service, client, "enroll", str(source), *files)
    assert code == 1
    assert (summary["total"], summary["done"], summary["skipped"], summary["failed"]) == (4, 3, 0, 1)
    with failures.open() as handle:
        (failure,) = list(csv.DictReader(handle))
    assert failure["client_reference"] == "bulk-negative" and "no face" in failure["reason"]

    # An interrupted run: row 4 was submitted (its state line written) but the run stopped before it
    # finished. The next run waits for that transaction instead of enrolling the photo twice.
    interrupted_path, interrupted_reference = photos[3]
    reference_id = api.submit_face_search(interrupted_path, client_reference=interrupted_reference)
    with state.open("a") as handle:
        key = f"{interrupted_path.resolve()}\t{interrupted_reference}"
        handle.write(json.dumps({"key": key, "status": "submitted", "reference_id": reference_id}) + "\n")
        handle.write('{"key": "cut sh')  # the line the interruption cut short
    write_csv(source, [*photos, (negative, "bulk-negative")])
    code, summary = run_cli(capsys, service, client, "enroll", str(source), *files)
    assert (summary["total"], summary["done"], summary["skipped"], summary["failed"]) == (7, 3, 3, 1)
    faces = list(api.iter_faces())
    assert sorted(face.client_reference for face in faces) == [reference for _, reference in photos]
    assert f"f{reference_id}" in {face.face_id for face in faces}

    # Everything done: a third run enrols nothing again (the non-face photo is tried and fails again).
    code, summary = run_cli(capsys, service, client, "enroll", str(source), *files)
    assert (summary["done"], summary["skipped"], summary["failed"]) == (0, 6, 1)
    assert api.gallery_stats().faces == 6

    # Folder mode: the client_reference is the file name stem (links to the photos, never copies).
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "folder-ref-1.jpg").symlink_to(identities[6][0].path)
    (folder / "notes.txt").write_text("ignored: not an image")
    code, summary = run_cli(
        capsys,
        service,
        client,
        "enroll",
        str(folder),
        "--state",
        str(tmp_path / "f.jsonl"),
        "--failures",
        str(tmp_path / "f.csv"),
    )
    assert code == 0 and summary["done"] == 1
    assert [face.client_reference for face in api.list_faces("folder-ref-1").faces] == ["folder-ref-1"]

    # Bulk erasure from a list, resumable the same way.
    erase_list = tmp_path / "erase.txt"
    erase_list.write_text("\n".join(reference for _, reference in photos[:2]) + "\nnever-enrolled\n")
    erase_files = ("--state", str(tmp_path / "erase.jsonl"), "--failures", str(tmp_path / "erase.csv"))
    code, summary = run_cli(capsys, service, client, "erase", str(erase_list), *erase_files)
    assert code == 0 and (summary["done"], summary["faces_erased"]) == (3, 2)
    code, summary = run_cli(capsys, service, client, "erase", str(erase_list), *erase_files)
    assert (summary["done"], summary["skipped"]) == (0, 3)
    assert api.gallery_stats().faces == 5
    api.close()
