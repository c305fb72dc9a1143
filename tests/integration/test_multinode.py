"""A two-node Ray cluster in two network namespaces (one veth pair, nothing else): the application deployed
with `serve deploy`, the replica that runs the models (the transaction worker) pinned to the worker node,
Ray token authentication on. The worker node is killed in the middle of a burst of face searches and age
estimations and started again: nothing accepted is lost, every answer equals the undisturbed run's, and the
worker replica comes back on that node.

The scenario runs in its own process inside namespace A (tests/integration/multinode_check.py); this test
makes the namespaces and removes them, and every process in them, whatever happens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import netns
from tests.faces_dev import REPO_ROOT


@pytest.mark.service
def test_worker_node_lost_mid_burst_loses_nothing() -> None:
    why = netns.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-node test must run in CI: {why}")
        pytest.skip(why)
    tag = os.getpid() % 100000
    link = netns.Link(f"fsA{tag}", f"fsB{tag}", "10.250.0.1", "10.250.0.2")
    work = Path(tempfile.mkdtemp(prefix="fs-multinode-"))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        link.create()
        assert link.a is not None
        finished = subprocess.run(
            ["ip", "netns", "exec", link.a, sys.executable, "-m", "tests.integration.multinode_check",
             str(work), link.b],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    finally:
        link.teardown()
        shutil.rmtree(work, ignore_errors=True)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-6000:]
    summary = json.loads(finished.stdout.strip().splitlines()[-1])
    print(output)
    assert summary["accepted"] == summary["sent"] == summary["completed"] == summary["same_as_undisturbed"]
    assert summary["lost"] == 0 and summary["replica_back_on_node_b"] is True
    assert summary["sent_after_the_kill"] > 0  # those needed the node that came back
