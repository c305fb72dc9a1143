"""`facesearch start` as a supervisor runs it (systemd, a container restart policy): stopped with SIGTERM
and started again the moment it has exited, several times in a row (FACESEARCH_RESTART_CYCLES, 4 by
default; the first cycle also kills the embedded servers), on the default config (the front door:
HAProxy on the public port in front of two ingress replicas). Each start must end serving: a client logs in
and a face search completes. Before each stop, connections the server closed are left in TIME_WAIT on the
port, as real traffic leaves them. Each stop must leave nothing behind: the launcher exits with the public
port free and no HAProxy of the service running.

The API client is made with `facesearch clients create` run from another working directory with no
FACESEARCH_DATA_DIR: it must reach the running service's store through the per-user default, not make
one of its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_app.launch.embedded import free_port
from serve_app.launch.haproxy import FrontDoor, runtime_dir_for
from tests.faces_dev import FacesDev
from tests.integration.api_client import face_search_json, reference_of, wait_result
from tests.integration.faults.faults_support import close_connections_from_the_server, poll
from tests.service_harness import DEFAULT_CONFIG, loopback_ray_env

pytestmark = pytest.mark.service

# Each cycle costs about 30 s on a 2-core machine (start 17, stop 10), and the cycles after the second repeat
# the same path; a longer soak: FACESEARCH_RESTART_CYCLES=10 pytest tests/integration/faults/test_restarts.py
CYCLES = int(os.environ.get("FACESEARCH_RESTART_CYCLES", "4"))
START_TIMEOUT_S = 300.0  # a shared 2-core machine: Ray, the embedded servers and the models' load
STOP_TIMEOUT_S = 120.0


class Launcher:
    """`facesearch start` in a process of its own, with everything it reads from the environment."""

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cwd = work / "launcher-cwd"
        self.cwd.mkdir()
        self.log = work / "launcher.log"
        # Ray's socket paths must stay under 108 bytes: a short directory of its own, not one in tmp_path.
        ray_tmp = Path(tempfile.mkdtemp(prefix="ray-restarts-", dir="/tmp"))
        self.ray_tmp = ray_tmp
        environment = {
            key: value
            for key, value in os.environ.items()
            # Nothing of a service the test process may have run before: the launcher reads the config.
            if not key.startswith(("RAY_SERVE_", "FACESEARCH_", "REDIS_URL", "MILVUS_URI"))
        }
        self.environment = {**environment, **loopback_ray_env(ray_tmp), "XDG_DATA_HOME": str(work / "xdg")}
        self.data_dir = work / "xdg" / "facesearch"  # the per-user default under that XDG_DATA_HOME
        self.process: subprocess.Popen[bytes] | None = None
        self._offset = 0

    def start(self) -> None:
        self._offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            log.write(b"\n--- start\n")
            self.process = subprocess.Popen(
                [sys.executable, "-m", "serve_app.launch.cli", "start", "--config", str(DEFAULT_CONFIG),
                 "--port", str(self.port), "--metrics-port", str(self.metrics_port)],
                cwd=self.cwd, env=self.environment, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def wait_serving(self) -> None:
        def serving() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"facesearch start exited {self.process.returncode}:\n{self.tail()}")
            # The launcher says so once the whole application is up, the worker and its models included.
            serving = f"facesearch is serving on {self.base_url}".encode()
            if serving not in self.log.read_bytes()[self._offset :]:
                return False
            try:
                return httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        poll(serving, START_TIMEOUT_S, "facesearch start to serve", interval_s=0.5)

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"facesearch start ignored SIGTERM:\n{self.tail()}") from None

    def left_nothing_behind(self) -> str:
        """After the launcher exited: the public port is free at once and no HAProxy of this service runs.
        Returns the stop's own words about HAProxy processes it had to stop itself (Serve normally has)."""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HAProxy binds it
            sock.bind(("127.0.0.1", self.port))
        front_door = FrontDoor("127.0.0.1", self.port, runtime_dir_for(self.port), Path("haproxy"))
        assert front_door.processes() == [], f"HAProxy still running after the stop:\n{self.tail()}"
        this_run = self.log.read_bytes()[self._offset :].decode(errors="replace")
        return "\n".join(line for line in this_run.splitlines() if "left behind" in line)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def cli(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "serve_app.launch.cli", *args],
            cwd=cwd, env=self.environment, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    running = Launcher(tmp_path)
    try:
        yield running
    finally:
        if running.process is not None and running.process.poll() is None:
            running.stop()
        shutil.rmtree(running.ray_tmp, ignore_errors=True)
        shutil.rmtree(runtime_dir_for(running.port), ignore_errors=True)


def _search_completes(base_url: str, token: str, photo: Path) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as http:
        reference_id = reference_of(face_search_json(http, token, photo, enroll_face=0))
        body = wait_result(http, token, reference_id)
    assert body["status"] is True, body
    assert body["result"]["data"]["face_search_response"]["result"]["is_face_found"] is True


def _token(base_url: str, client: dict[str, str]) -> str:
    response = httpx.post(
        f"{base_url}/request-access-token",
        json={"client_id": client["client_id"], "client_secret": client["client_secret"]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["result"]["data"]["token"])


def _embedded_servers_killed_come_back(launcher: Launcher, client: dict[str, str], photo: Path) -> None:
    """SIGKILL the embedded redis-server and milvus-lite that the launcher started: it starts them again in
    place, and the service serves again without anyone acting."""
    data_dir = launcher.data_dir
    for name in ("redis", "milvus"):
        state = json.loads((data_dir / name / f"{name}.json").read_text())
        os.kill(int(state["pid"]), signal.SIGKILL)

    def searches_again() -> bool:
        try:
            _search_completes(launcher.base_url, _token(launcher.base_url, client), photo)
        except (AssertionError, httpx.HTTPError):
            return False
        return True

    poll(searches_again, START_TIMEOUT_S, "a face search after the embedded servers were killed", 1.0)
    print("RESTARTS embedded Redis and Milvus SIGKILLed: started again by the launcher, serving")


def test_restarts_at_once_each_end_serving(launcher: Launcher, tmp_path: Path, faces_dev: FacesDev) -> None:
    photo = faces_dev.of_kind("identity")[0].path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    client: dict[str, str] | None = None
    for cycle in range(1, CYCLES + 1):
        launcher.start()  # at once: the previous launcher has just exited
        launcher.wait_serving()
        if client is None:
            made = launcher.cli("clients", "create", "restarts", cwd=elsewhere)
            assert made.returncode == 0, made.stderr
            client = json.loads(made.stdout)
            assert not any(elsewhere.iterdir()), "the CLI wrote a store of its own in its working directory"
        _search_completes(launcher.base_url, _token(launcher.base_url, client), photo)
        if cycle == 1:
            _embedded_servers_killed_come_back(launcher, client, photo)
        close_connections_from_the_server(launcher.base_url, 3)
        assert launcher.stop() == 0, launcher.tail()
        stopped_by_the_launcher = launcher.left_nothing_behind() or "Serve stopped HAProxy"
        print(f"RESTARTS cycle {cycle}/{CYCLES}: served, stopped; {stopped_by_the_launcher}")
    print(f"RESTARTS {CYCLES} starts issued at once after the previous exit: {CYCLES} served")
