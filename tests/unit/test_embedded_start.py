"""Embedded Redis/Milvus start only when the launcher asks (`facesearch start`, `facesearch backends`), never
as a side effect of importing or building the application."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.graph import bind_app, build_app
from serve_app.settings import AuthSettings, MilvusSettings, RedisSettings, Settings


def _without_backends(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        redis=RedisSettings(url=None),
        milvus=MilvusSettings(uri=None),
        auth=AuthSettings(secret_key="unit-test-secret-0123456789abcdef"),
    )


def test_building_without_backends_or_the_flag_fails_naming_the_variables(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"REDIS_URL and MILVUS_URI.*facesearch backends"):
        bind_app({"topology": "fused"}, _without_backends(tmp_path))
    assert not (tmp_path / "redis").exists() and not (tmp_path / "milvus").exists()  # nothing started


def test_building_with_backends_binds_the_graph_and_starts_nothing(tmp_path: Path) -> None:
    settings = _without_backends(tmp_path).with_backends("redis://127.0.0.1:1/0", "http://127.0.0.1:1")
    app = bind_app({"topology": "split"}, settings)
    assert app is not None
    assert not (tmp_path / "redis").exists() and not (tmp_path / "milvus").exists()


def test_importing_the_application_does_not_import_the_supervisor() -> None:
    code = "import json, sys; import serve_app.graph; print(json.dumps('serve_app.embedded' in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False


def test_the_serve_builder_takes_exactly_the_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # `serve run config/serve.yaml` refuses a builder with any other signature.
    import inspect

    assert list(inspect.signature(build_app).parameters) == ["args"]
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("MILVUS_URI", "http://127.0.0.1:1")
    assert build_app({"topology": "fused", "model_config": {"intra_op_threads": 2}}) is not None
