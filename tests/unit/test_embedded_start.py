"""Embedded Redis/Milvus start only when asked (the launcher, or `embedded_backends: true` in the app args),
never as a side effect of importing or building the application."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.graph import build_app
from serve_app.settings import AuthSettings, MilvusSettings, RedisSettings, Settings


def _without_backends(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        redis=RedisSettings(url=None),
        milvus=MilvusSettings(uri=None),
        auth=AuthSettings(secret_key="unit-test-secret-0123456789abcdef"),
    )


def test_building_without_backends_or_the_flag_fails_naming_the_variables(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"REDIS_URL and MILVUS_URI.*embedded_backends"):
        build_app({"topology": "fused"}, settings=_without_backends(tmp_path))
    assert not (tmp_path / "redis").exists() and not (tmp_path / "milvus").exists()  # nothing started


def test_building_with_backends_binds_the_graph_and_starts_nothing(tmp_path: Path) -> None:
    settings = _without_backends(tmp_path).with_backends("redis://127.0.0.1:1/0", "http://127.0.0.1:1")
    app = build_app({"topology": "split", "embedded_backends": True}, settings=settings)
    assert app is not None
    assert not (tmp_path / "redis").exists() and not (tmp_path / "milvus").exists()


def test_importing_the_application_does_not_import_the_supervisor() -> None:
    code = "import json, sys; import serve_app.graph; print(json.dumps('serve_app.embedded' in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False
