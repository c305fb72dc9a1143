"""The default service runs with its config's Ray Serve switches in every process that reads them: the
replicas (user code on their own event loop, direct ingress) and Serve's controller (its loop interval),
which a config's runtime_env alone would not reach."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serve_app.launch.deploy_config import load_serve_config
from tests.service_harness import DEFAULT_CONFIG, RunningService

pytestmark = pytest.mark.service


def _environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _processes_of(service: RunningService, needle: str) -> list[dict[str, str]]:
    """The environments of this service's processes whose command line contains `needle` (the harness gives
    every service its own FACESEARCH_DATA_DIR, which all of its Ray processes inherit)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command_line = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if needle not in command_line:
                continue
            environment = _environment(int(entry))
        except OSError:
            continue  # ended meanwhile
        if environment.get("FACESEARCH_DATA_DIR") == str(service.data_dir):
            found.append(environment)
    return found


@pytest.mark.parametrize(
    "process",
    [
        "ray::ServeController",
        "ray::ServeReplica:facesearch:ApiIngress",
        "ray::ServeReplica:facesearch:TransactionWorker",
    ],
)
def test_the_configs_serve_switches_reach_the_controller_and_the_replicas(
    service: RunningService, process: str
) -> None:
    switches = load_serve_config(DEFAULT_CONFIG).env_vars
    environments = _processes_of(service, process)
    assert environments, f"no {process} process of this service"
    for environment in environments:
        assert {key: environment.get(key) for key in switches} == switches
