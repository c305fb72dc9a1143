"""The offline kit (serve_app.launch.kit, docs/offline-kit.md) end to end, as an air-gapped user runs it:
built for this Python on CPU, installed by its own install.sh into a clean virtual environment with every
package index out of reach (no index, no configured find-links, proxies to a closed port), then the
service started from the install alone (its `facesearch start`, its redis-server, its models and config)
and one face search answered. Building the kit downloads the wheels (pip's cache serves what `make
install` fetched already)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from serve_app.launch.deploy_config import DIRECT_INGRESS_FLAG
from serve_app.launch.embedded import free_port
from serve_app.launch.kit import ARCHIVE, DEFAULT_PART_SIZE
from tests.faces_dev import FacesDev
from tests.integration.api_client import face_search_json, reference_of, wait_result
from tests.integration.faults.faults_support import poll
from tests.service_harness import loopback_ray_env

pytestmark = pytest.mark.service

START_TIMEOUT_S = 300.0
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing answers
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def _clean_environment() -> dict[str, str]:
    """This process' environment without anything of a running service, pip or a proxy."""
    dropped = ("RAY_SERVE_", "FACESEARCH_", "REDIS_URL", "MILVUS_URI", "PIP_", "VIRTUAL_ENV", "PYTHONPATH")
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(dropped) and key.lower() not in PROXY_VARIABLES and key != DIRECT_INGRESS_FLAG
    }


def _offline_environment() -> dict[str, str]:
    """The clean environment with no way to reach a package index (for the install)."""
    return {
        **_clean_environment(),
        "PIP_CONFIG_FILE": os.devnull,  # no configured index or find-links
        "PIP_NO_INDEX": "1",
        "PIP_INDEX_URL": f"{CLOSED}/simple",
        "HTTP_PROXY": CLOSED,
        "HTTPS_PROXY": CLOSED,
        "http_proxy": CLOSED,
        "https_proxy": CLOSED,
        "PYTHON": sys.executable,
    }


def _token(base_url: str, client: dict[str, str]) -> str:
    response = httpx.post(
        f"{base_url}/request-access-token",
        json={"client_id": client["client_id"], "client_secret": client["client_secret"]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["result"]["data"]["token"])


def test_the_kit_installs_with_no_index_and_the_installed_service_answers_a_face_search(
    tmp_path: Path, faces_dev: FacesDev
) -> None:
    kit = tmp_path / "kit"
    started = time.monotonic()
    built = subprocess.run(
        [sys.executable, "-m", "serve_app.launch.kit", "build", "--out", str(kit)],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    built_at = time.monotonic()
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    assert manifest["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert manifest["parts"] and all(
        part["bytes"] <= DEFAULT_PART_SIZE for part in manifest["parts"].values()
    )
    assert sorted(path.name for path in kit.iterdir()) == sorted(
        ["install.sh", "MANIFEST.json", *manifest["parts"]]
    )
    assert all(name.startswith(f"{ARCHIVE}.") for name in manifest["parts"])

    offline = _offline_environment()
    target = tmp_path / "installed"
    installed = subprocess.run(
        [str(kit / "install.sh"), str(target)], env=offline, capture_output=True, text=True, timeout=1200,
        check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    installed_at = time.monotonic()
    parts = len(manifest["parts"])
    print(f"KIT {parts} parts, built {built_at - started:.0f} s, installed {installed_at - built_at:.0f} s")
    venv_bin = target / "venv" / "bin"
    assert (venv_bin / "redis-server").is_file() and (venv_bin / "facesearch").is_file()

    # The service from the install alone: its own interpreter, config, models and redis-server.
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-kit-", dir="/tmp"))  # Ray's socket paths stay short
    port, metrics_port = free_port(), free_port()
    service_env = {
        **_clean_environment(),  # no proxy: gRPC would send the service's own Milvus calls through it
        **loopback_ray_env(ray_tmp),
        "PATH": f"{venv_bin}:/usr/bin:/bin",
        "FACESEARCH_DATA_DIR": str(tmp_path / "data"),
        "FACESEARCH_MODELS_DIR": str(target / "models"),
        "XDG_DATA_HOME": str(tmp_path / "xdg"),
    }
    log = tmp_path / "service.log"
    base_url = f"http://127.0.0.1:{port}"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [str(venv_bin / "facesearch"), "start", "--config", "config/serve.yaml", "--port", str(port),
             "--metrics-port", str(metrics_port)],
            cwd=target, env=service_env, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def serving() -> bool:
            if process.poll() is not None:
                raise AssertionError(
                    f"facesearch start exited {process.returncode}:\n{log.read_text()[-3000:]}"
                )
            # The launcher says so once the whole application is up, the worker and its models included.
            if f"facesearch is serving on {base_url}".encode() not in log.read_bytes():
                return False
            try:
                return httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        poll(serving, START_TIMEOUT_S, "the installed service to serve", interval_s=0.5)
        made = subprocess.run(
            [str(venv_bin / "facesearch"), "clients", "create", "kit"],
            cwd=target, env=service_env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        token = _token(base_url, json.loads(made.stdout))
        photo = faces_dev.of_kind("identity")[0].path
        with httpx.Client(base_url=base_url, timeout=60) as http:
            body = wait_result(http, token, reference_of(face_search_json(http, token, photo, enroll_face=0)))
        assert body["status"] is True, body
        assert body["result"]["data"]["face_search_response"]["result"]["is_face_found"] is True
        print(
            f"KIT service from the install served a face search {time.monotonic() - installed_at:.0f} s after"
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
