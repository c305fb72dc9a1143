"""Embedded Redis/Milvus start only when the launcher asks (`facesearch start`, `facesearch backends`), never
as a side effect of importing or building the application."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.launch.topology import bind_app, build_app
from serve_app.settings import Settings


def _without_backends(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FACESEARCH_SECRET_KEY", "unit-test-secret-0123456789abcdef")
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("MILVUS_URI", raising=False)


def test_building_without_backends_or_the_flag_fails_naming_the_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _without_backends(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match=r"REDIS_URL and MILVUS_URI.*facesearch backends"):
        bind_app({"topology": "in_process"})
    assert not (tmp_path / "redis").exists() and not (tmp_path / "milvus").exists()  # nothing started


def test_building_with_backends_binds_the_graph_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _without_backends(monkeypatch, tmp_path)
    settings = Settings.from_env().with_backends("redis://127.0.0.1:1/0", "http://127.0.0.1:1")
    for name, value in settings.backend_environment().items():
        monkeypatch.setenv(name, value)
    app = bind_app({"topology": "split"})
    assert app is not None
    assert not (tmp_path / "redis").exists() and not (tmp_path / "milvus").exists()


@pytest.mark.parametrize("topology", ["in_process", "split"])
def test_no_secret_is_in_what_serve_pickles_for_the_replicas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, topology: str
) -> None:
    # What Serve keeps of an application: each deployment's pickled init args and kwargs (ReplicaConfig),
    # built from the bound graph the way serve.run builds it.
    from ray import cloudpickle
    from ray.serve._private.build_app import build_app as serve_build_app

    signing_key = "signing-key-that-must-never-reach-ray-0123456789"
    redis_password = "redis-password-that-must-never-reach-ray"
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FACESEARCH_SECRET_KEY", signing_key)
    monkeypatch.setenv("REDIS_URL", f"redis://:{redis_password}@127.0.0.1:1/0")
    monkeypatch.setenv("MILVUS_URI", "http://127.0.0.1:1")
    built = serve_build_app(build_app({"topology": topology}), name="facesearch")
    assert len(built.deployments) >= 2
    for deployment in built.deployments:
        config = deployment._replica_config
        stored = b"".join(
            (
                config.serialized_init_args or b"",
                config.serialized_init_kwargs or b"",
                cloudpickle.dumps(deployment._deployment_config.user_config),
            )
        )
        for secret in (signing_key, redis_password):
            assert secret.encode() not in stored, f"{deployment.name} carries a secret in its bind arguments"


def test_importing_the_application_does_not_import_the_supervisor() -> None:
    code = (
        "import json, sys; import serve_app.launch.topology; "
        "print(json.dumps('serve_app.launch.embedded' in sys.modules))"
    )
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
    assert build_app({"topology": "in_process", "model_config": {"intra_op_threads": 2}}) is not None
