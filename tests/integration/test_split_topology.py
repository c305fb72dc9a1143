"""Every topology passes the same end-to-end check (split_service_check.check_search_and_age): split
(config/serve-gpu.yaml's layout, on CPU) and in_process with a fast autoscaler (the worker owns the models and
scales on the queue's backlog) each in its own process, and the session's service (config/serve.yaml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.faces_dev import REPO_ROOT
from tests.integration.split_service_check import check_search_and_age
from tests.service_harness import RunningService


@pytest.mark.service
@pytest.mark.parametrize("topology", ["split", "in_process"])
def test_topology_in_its_own_process_searches_and_estimates_ages(topology: str) -> None:
    # Its own process: Ray runs once per process and the session's service already holds it here.
    finished = subprocess.run(
        [sys.executable, "-m", "tests.integration.split_service_check", topology],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert f"{topology} topology OK" in finished.stdout


@pytest.mark.service
def test_the_default_service_passes_the_same_check(service: RunningService) -> None:
    check_search_and_age(service, "default-check")
