"""`facesearch start` checks the model files, and sets the config's environment, before it starts anything."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import ray

from serve_app.deployments.front_door import FRONT_DOOR_FLAG
from serve_app.launch import cli, embedded, haproxy
from serve_app.launch.deploy_config import load_serve_config
from serve_app.launch.haproxy import FrontDoor

CONFIG = Path(__file__).resolve().parents[2] / "config" / "serve.yaml"


def test_a_missing_model_stops_start_before_ray_or_the_servers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in cli.LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)  # start() sets them; this restores the test process's afterwards
    monkeypatch.setenv("FACESEARCH_MODELS_DIR", str(tmp_path / "no-models-here"))

    def must_not_run(*args: object, **kwargs: object) -> None:
        pytest.fail("started before the model files were checked")

    monkeypatch.setattr(ray, "init", must_not_run)
    monkeypatch.setattr(embedded, "start_embedded_services", must_not_run)
    assert cli.start(CONFIG, "127.0.0.1", None, 0) == 2
    message = capsys.readouterr().err
    assert "facesearch models fetch" in message and "FACESEARCH_MODELS_DIR" in message
    assert str(tmp_path / "no-models-here") in message


def test_the_installed_models_pass_the_check() -> None:
    from models.analyzer import ModelConfig

    ModelConfig().verify_files()  # the models `make install` built: raises if one is missing or differs


class _Stop(Exception):
    pass


def _front_door_variables(tmp_path: Path) -> set[str]:
    return set(FrontDoor("127.0.0.1", 1, tmp_path, Path("/bin/true")).environment({}))


def test_the_configs_serve_switches_are_set_before_the_servers_and_ray_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Serve's controller reads its switches from the environment Ray starts in (a config's runtime_env
    reaches only the application's replicas): start() must export them first, the front door's with them."""
    switches = load_serve_config(CONFIG).env_vars
    assert switches  # the default config has some to set
    for key in {*cli.LOOPBACK_ENV, *switches, *_front_door_variables(tmp_path)}:
        monkeypatch.setenv(key, "")  # start() sets them; this restores the test process's afterwards
    seen: dict[str, str] = {}

    def first_thing_started(*args: object, **kwargs: object) -> None:
        seen.update(os.environ)
        raise _Stop

    monkeypatch.setattr(embedded, "start_embedded_services", first_thing_started)
    monkeypatch.setattr(ray, "init", first_thing_started)
    try:
        with pytest.raises(_Stop):
            cli.start(CONFIG, "127.0.0.1", 18123, 0)
    finally:
        shutil.rmtree(haproxy.runtime_dir_for(18123), ignore_errors=True)
    assert {key: seen[key] for key in switches} == switches
    # HAProxy will hold the public port: Ray is told where its files go and to start it through the wrapper.
    assert seen[FRONT_DOOR_FLAG] == "1"
    wrapper = Path(seen["RAY_SERVE_HAPROXY_BINARY_PATH"])
    assert wrapper == haproxy.runtime_dir_for(18123) / "haproxy"
    assert Path(seen["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"]).parent == wrapper.parent


def test_without_an_haproxy_binary_start_stops_before_ray_or_the_servers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in cli.LOOPBACK_ENV:
        monkeypatch.setenv(key, "")

    def no_binary(*args: object, **kwargs: object) -> Path:
        raise haproxy.FrontDoorError("no HAProxy binary: reinstall the environment (`make install`)")

    def must_not_run(*args: object, **kwargs: object) -> None:
        pytest.fail("started without a front door")

    monkeypatch.setattr(haproxy, "find_haproxy", no_binary)
    monkeypatch.setattr(ray, "init", must_not_run)
    monkeypatch.setattr(embedded, "start_embedded_services", must_not_run)
    assert cli.start(CONFIG, "127.0.0.1", 18124, 0) == 2
    assert "make install" in capsys.readouterr().err
