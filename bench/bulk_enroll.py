"""Bulk enrolment benchmark: `facesearch enroll` in folder mode over the dev photos (every photo, with
client_reference = its file name stem) against a fresh local service, at a few concurrencies, each into a
fresh tenant. Prints one table: rows, enrolled, failed (photos without a usable face), seconds, rows/s.

    python -m bench.bulk_enroll [--concurrency 1 4 8]
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import asyncio
import collections
import csv
import tempfile
from pathlib import Path

from bench.common import format_table
from facesearch_client import AsyncFaceSearchClient, bulk
from tests.faces_dev import faces_dev_dir
from tests.service_harness import running_service


async def enroll_once(
    base_url: str, client_id: str, secret: str, rows: list[bulk.Row], work: Path, concurrency: int
) -> tuple[bulk.Summary, list[str]]:
    """One bulk run; its summary and the failure reasons."""
    state, failures = work / f"state-{concurrency}.jsonl", work / f"failures-{concurrency}.csv"
    async with AsyncFaceSearchClient(base_url, client_id, secret) as api:
        summary = await bulk.enroll(api, rows, state, failures, concurrency=concurrency, progress=False)
    with failures.open(newline="") as handle:
        reasons = [line["reason"].split(" (")[0] for line in csv.DictReader(handle)]
    return summary, reasons


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    table: list[list[str]] = []
    reasons: collections.Counter[str] = collections.Counter()
    with (
        tempfile.TemporaryDirectory(prefix="facesearch-bench-") as work,
        running_service(Path(work) / "data") as service,
    ):
        rows = bulk.enrolment_rows(faces_dev_dir())
        for concurrency in args.concurrency:
            client = service.new_client(f"bulk-{concurrency}")
            summary, failed = asyncio.run(
                enroll_once(
                    service.base_url, client.client_id, client.client_secret, rows, Path(work), concurrency
                )
            )
            reasons.update(failed)
            table.append(
                [
                    str(concurrency),
                    str(summary.total),
                    str(summary.done),
                    str(summary.failed),
                    f"{summary.elapsed_s:.1f}",
                    f"{summary.total / summary.elapsed_s:.2f}",
                ]
            )
    print(f"facesearch enroll over {faces_dev_dir()} (folder mode), one fresh tenant per row")
    print(format_table(["concurrency", "rows", "enrolled", "failed", "seconds", "rows/s"], table))
    print("failure reasons (all runs):", dict(reasons))


if __name__ == "__main__":
    main()
