"""The split topology (config/serve-gpu.yaml's layout on CPU): face search and age estimation end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.faces_dev import REPO_ROOT


@pytest.mark.service
def test_split_topology_searches_and_estimates_ages() -> None:
    # Its own process: Ray runs once per process and the session's fused service already holds it here.
    finished = subprocess.run(
        [sys.executable, "-m", "tests.integration.split_service_check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "split topology OK" in finished.stdout
