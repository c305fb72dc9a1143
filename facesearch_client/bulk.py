"""Bulk enrolment and erasure through the public API (`facesearch enroll` / `facesearch erase`).

Sources:
- enrol: a folder (every .jpg/.jpeg/.png directly in it; client_reference = the file name without its
  extension, e.g. customer-0001.jpg -> customer-0001) or a CSV with the columns path,client_reference
  (a header row naming them; relative paths are relative to the CSV's folder);
- erase: a CSV with a client_reference column, or a text file with one client_reference per line.

Resumable: every row's progress is appended to a state file (JSON lines, flushed per row). A row recorded
as done is skipped by a later run with the same state file; a row submitted but not yet finished when the
run stopped is not submitted again, its transaction is waited for instead; failed rows are tried again.
Each submission's Idempotency-Key is recorded before it is sent: a row whose submission got no answer
(a 503 after the retries, a lost connection, an interruption) is submitted again with the same key, so
the service answers with the transaction it may already have created instead of enrolling the face twice.
Failures are written to a CSV (row, client_reference, reason) at the end of each run.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from facesearch_client.aio import AsyncFaceSearchClient
from facesearch_client.errors import FaceSearchError
from facesearch_client.models import FaceSearchResult

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
CREATE_WAIT_S = 10.0  # how long a submission asks the service to hold its request for the result


@dataclass(frozen=True)
class Row:
    key: str  # identifies the row in the state file
    client_reference: str
    path: Path | None = None  # enrolment only


@dataclass
class Summary:
    total: int = 0
    done: int = 0
    skipped: int = 0
    failed: int = 0
    faces_erased: int = 0
    elapsed_s: float = 0.0
    failures_csv: str | None = None


def enrolment_rows(source: Path) -> list[Row]:
    if source.is_dir():
        paths = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        return [Row(str(p.resolve()), p.stem, p.resolve()) for p in paths]
    rows = []
    with source.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or not {"path", "client_reference"} <= set(reader.fieldnames):
            raise ValueError(f"{source}: the CSV needs a header row with the columns path,client_reference")
        for line in reader:
            path = Path(line["path"])
            path = path if path.is_absolute() else (source.parent / path)
            rows.append(Row(f"{path.resolve()}\t{line['client_reference']}", line["client_reference"], path))
    return rows


def erasure_rows(source: Path) -> list[Row]:
    text = source.read_text(encoding="utf-8")
    first = text.splitlines()[0].strip() if text.strip() else ""
    if first == "client_reference" or first.startswith("client_reference,"):
        references = [line["client_reference"] for line in csv.DictReader(text.splitlines())]
    else:
        references = [line for line in text.splitlines() if line.strip()]
    return [Row(reference, reference) for reference in references]


class StateFile:
    """Append-only JSON lines: {"key", "status": "submitting" | "submitted" | "done" | "failed", ...}; the
    last line of a key wins."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.latest: dict[str, dict[str, Any]] = {}
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by the interruption
            self.latest[str(entry["key"])] = entry
        self._handle: TextIO = path.open("a", encoding="utf-8")
        if text and not text.endswith("\n"):
            # End the cut line, or the first entry of this run would be glued to it and lost.
            self._handle.write("\n")

    def record(self, key: str, status: str, **fields: Any) -> None:
        entry = {"key": key, "status": status, **fields}
        self.latest[key] = entry
        self._handle.write(json.dumps(entry) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def _failure_reason(result: FaceSearchResult) -> str | None:
    if not result.is_face_found:
        return "no face found in the image"
    unindexed = result.raw.get("face_search_response", {}).get("result", {}).get("unindexed_faces")
    if unindexed is None:
        unindexed = result.raw.get("unindexed_faces")
    if unindexed:
        reasons = ", ".join(str(reason) for face in unindexed for reason in face.get("reasons", []))
        return f"face below the enrolment quality bar ({reasons})"
    return None


async def _run(
    rows: list[Row],
    state: StateFile,
    concurrency: int,
    work: Callable[[Row, dict[str, Any] | None], Awaitable[tuple[str | None, dict[str, Any]]]],
    summary: Summary,
    progress: bool,
    label: str,
) -> list[tuple[Row, str]]:
    """Runs `work` over the rows not done yet, at most `concurrency` at a time. `work` returns (failure
    reason or None, fields to record)."""
    pending = [row for row in rows if state.latest.get(row.key, {}).get("status") != "done"]
    summary.total, summary.skipped = len(rows), len(rows) - len(pending)
    failures: list[tuple[Row, str]] = []
    queue: asyncio.Queue[Row] = asyncio.Queue()
    for row in pending:
        queue.put_nowait(row)
    bar = tqdm(total=len(rows), initial=summary.skipped, desc=label, unit="row", disable=not progress)

    async def worker() -> None:
        while not queue.empty():
            row = queue.get_nowait()
            try:
                reason, fields = await work(row, state.latest.get(row.key))
            except (FaceSearchError, OSError) as error:
                reason, fields = str(error) or type(error).__name__, _unanswered(state.latest.get(row.key))
            if reason is None:
                state.record(row.key, "done", **fields)
                summary.done += 1
            else:
                state.record(row.key, "failed", reason=reason, **fields)
                failures.append((row, reason))
                summary.failed += 1
            bar.update(1)

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    finally:
        bar.close()
    return failures


def _unanswered(entry: dict[str, Any] | None) -> dict[str, Any]:
    """What a failed row keeps of its last entry: the Idempotency-Key of a submission that was never
    answered with a reference_id (its retry must send that key again)."""
    if entry and entry.get("idempotency_key") and not entry.get("reference_id"):
        return {"idempotency_key": entry["idempotency_key"]}
    return {}


def _write_failures(path: Path, failures: list[tuple[Row, str]], summary: Summary) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["row", "client_reference", "reason"])
        for row, reason in failures:
            writer.writerow(
                [str(row.path) if row.path is not None else row.key, row.client_reference, reason]
            )
    summary.failures_csv = str(path)


async def enroll(
    client: AsyncFaceSearchClient,
    rows: list[Row],
    state_path: Path,
    failures_path: Path,
    *,
    concurrency: int = 4,
    allow_override: bool = False,
    timeout_s: float = 300.0,
    progress: bool = True,
) -> Summary:
    summary = Summary()
    state = StateFile(state_path)
    started = time.monotonic()

    async def enrol_one(row: Row, previous: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
        assert row.path is not None
        reference_id = (
            previous.get("reference_id") if previous and previous["status"] == "submitted" else None
        )
        answer: FaceSearchResult | str | None = None
        if reference_id is None:
            key = _unanswered(previous).get("idempotency_key") or str(uuid.uuid4())
            state.record(row.key, "submitting", idempotency_key=key)
            # One request per row when the result is ready within the wait (Prefer: wait).
            answer = await client.face_search(
                row.path,
                wait_s=min(CREATE_WAIT_S, timeout_s),
                client_reference=row.client_reference,
                allow_override=allow_override or None,
                idempotency_key=key,
            )
            reference_id = answer if isinstance(answer, str) else answer.reference_id
            state.record(row.key, "submitted", reference_id=reference_id)
        if isinstance(answer, FaceSearchResult):
            result = answer
        else:
            waited = await client.wait(str(reference_id), timeout_s)
            assert isinstance(waited, FaceSearchResult)
            result = waited
        return _failure_reason(result), {"reference_id": reference_id, "face_id": f"f{reference_id}"}

    try:
        failures = await _run(rows, state, concurrency, enrol_one, summary, progress, "enroll")
    finally:
        state.close()
    summary.elapsed_s = round(time.monotonic() - started, 2)
    _write_failures(failures_path, failures, summary)
    return summary


async def erase(
    client: AsyncFaceSearchClient,
    rows: list[Row],
    state_path: Path,
    failures_path: Path,
    *,
    concurrency: int = 4,
    progress: bool = True,
) -> Summary:
    summary = Summary()
    state = StateFile(state_path)
    started = time.monotonic()

    async def erase_one(row: Row, previous: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
        erasure = await client.erase(row.client_reference)
        summary.faces_erased += erasure.faces_erased
        return None, {"faces_erased": erasure.faces_erased}

    try:
        failures = await _run(rows, state, concurrency, erase_one, summary, progress, "erase")
    finally:
        state.close()
    summary.elapsed_s = round(time.monotonic() - started, 2)
    _write_failures(failures_path, failures, summary)
    return summary
