"""A bounded headless Locust run (loadtests/locustfile.py) against the session's running service.

Mixed traffic from a few users for FACESEARCH_LOAD_SECONDS (default 30) seconds: enrolment with and without
override, searches (in one request with `Prefer: wait`, or a create and polls), age estimation with and
without wait_for_result, result polling and proof downloads.
It must finish on its own with no failed request at all, having reached every endpoint. How many requests
it made is printed, not asserted: throughput is measured by `python -m bench.service`.

    FACESEARCH_LOAD_SECONDS=180 FACESEARCH_LOAD_USERS=8 pytest tests/integration/test_load.py -s
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.faces_dev import REPO_ROOT, faces_dev_dir
from tests.service_harness import RunningService

pytestmark = pytest.mark.service

LOAD_SECONDS = int(os.environ.get("FACESEARCH_LOAD_SECONDS", "30"))
USERS = int(os.environ.get("FACESEARCH_LOAD_USERS", "6"))
SPAWN_RATE = 3
# Start-up, the last in-flight requests and the summary; a run that is still going after this is hung.
GRACE_S = 60
SUMMARY = re.compile(r"requests=(\d+) failures=(\d+) p50=(\d+)ms p99=(\d+)ms")
# Endpoints every run must reach (users that stalled, every login refused or polls hanging, would miss
# some): proof URLs come from searches that match a face enrolled earlier in the run.
REQUIRED_ENDPOINTS = (
    "/request-access-token",
    "/face-search",
    "/face-search (Prefer: wait)",
    "/result",
    "/result (long poll)",
    "/age-estimation",
    "/get-proof/[token]",
)


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    failures: int
    p50_ms: int
    p99_ms: int
    requests_by_endpoint: Counter[str]
    failures_by_endpoint: Counter[str]


def parse_summary(output: str, stats: list[dict[str, Any]]) -> LoadSummary:
    match = SUMMARY.search(output)
    assert match is not None, f"no summary line in the locust output:\n{output[-3000:]}"
    requests, failures, p50, p99 = (int(value) for value in match.groups())
    by_endpoint: Counter[str] = Counter()
    failed_by_endpoint: Counter[str] = Counter()
    for entry in stats:  # one entry per (method, name)
        by_endpoint[entry["name"]] += int(entry["num_requests"])
        failed_by_endpoint[entry["name"]] += int(entry["num_failures"])
    return LoadSummary(requests, failures, p50, p99, by_endpoint, failed_by_endpoint)


def test_mixed_load_has_no_failures(service: RunningService, tmp_path: Path) -> None:
    client = service.new_client("load")
    stats_file = tmp_path / "locust-stats.json"
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(REPO_ROOT / "loadtests" / "locustfile.py"),
        "--headless",
        "--users",
        str(USERS),
        "--spawn-rate",
        str(SPAWN_RATE),
        "--run-time",
        f"{LOAD_SECONDS}s",
        "--host",
        service.base_url,
        "--only-summary",
        "--json-file",
        str(stats_file.with_suffix("")),  # locust appends .json
        "--loglevel",
        "WARNING",
    ]
    # The secret travels in the environment (the locustfile's defaults), not on a visible command line.
    env = {
        **os.environ,
        "FACESEARCH_CLIENT_ID": client.client_id,
        "FACESEARCH_CLIENT_SECRET": client.client_secret,
        "FACES_DEV_DIR": str(faces_dev_dir()),
    }
    completed = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LOAD_SECONDS + GRACE_S,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert stats_file.is_file(), f"locust wrote no stats (exit {completed.returncode}):\n{output[-3000:]}"
    summary = parse_summary(output, json.loads(stats_file.read_text()))
    per_endpoint = [line for line in output.splitlines() if line.startswith("  ") and "requests=" in line]
    print(
        f"\nlocust {USERS} users x {LOAD_SECONDS}s: requests={summary.requests} failures={summary.failures} "
        f"p50={summary.p50_ms}ms p99={summary.p99_ms}ms",
        *per_endpoint,
        sep="\n",
    )
    failed = +summary.failures_by_endpoint  # only the endpoints with failures
    assert summary.failures == 0, f"{summary.failures} failed requests {dict(failed)}:\n{output[-3000:]}"
    assert completed.returncode == 0, f"locust exited {completed.returncode}:\n{output[-3000:]}"
    missing = [name for name in REQUIRED_ENDPOINTS if not summary.requests_by_endpoint.get(name)]
    assert not missing, f"no traffic to {missing}: {summary.requests_by_endpoint}"
