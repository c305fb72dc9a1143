"""`facesearch start` checks the model files before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from serve_app.launch import cli, embedded

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
    monkeypatch.setattr(embedded, "start_embedded_backends", must_not_run)
    assert cli.start(CONFIG, "127.0.0.1", None, 0) == 2
    message = capsys.readouterr().err
    assert "facesearch models fetch" in message and "FACESEARCH_MODELS_DIR" in message
    assert str(tmp_path / "no-models-here") in message


def test_the_installed_models_pass_the_check() -> None:
    from models.analyzer import ModelConfig

    ModelConfig().verify_files()  # the models `make install` built: raises if one is missing or differs
