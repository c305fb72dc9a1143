"""The build step: each converted model is built from verified sources, checked against its recorded sha256,
kept when already there, and `facesearch models fetch` prints where they are."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from model_build import fetch
from model_build.npm_fetch import cache_dir_for, ensure_npm_files
from models import weights
from models.errors import WeightFileError
from serve_app.launch import cli

DLIB = "dlib_resnet_v1"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fetch.ensure_converted(DLIB, tmp_path_factory.mktemp("models"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_build_reproduces_the_recorded_bytes(built: Path) -> None:
    spec = weights.CONVERTED[DLIB]
    assert built.name == f"dlib_resnet_v1-{weights.WEIGHTS[DLIB].sha256[:16]}.onnx" == spec.file_name
    assert _sha256(built) == spec.sha256
    assert weights.converted(DLIB, built.parent) == built
    # The atomic write leaves no temporary files behind.
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name]


def test_a_verified_model_is_kept_not_rebuilt(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = built.stat()

    def must_not_convert(models_dir: Path) -> onnx.ModelProto:
        raise AssertionError("the verified model was converted again")

    monkeypatch.setitem(fetch.BUILDERS, DLIB, must_not_convert)
    assert fetch.ensure_converted(DLIB, built.parent) == built
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_file_with_another_hash_is_rebuilt(built: Path, tmp_path: Path) -> None:
    damaged = tmp_path / built.name
    damaged.write_bytes(built.read_bytes()[:-10])
    assert fetch.ensure_converted(DLIB, tmp_path) == damaged
    assert _sha256(damaged) == weights.CONVERTED[DLIB].sha256


def _other_model(models_dir: Path) -> onnx.ModelProto:
    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "other",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph)


def test_output_with_another_hash_fails_the_build_and_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(fetch.BUILDERS, DLIB, _other_model)
    with pytest.raises(WeightFileError, match=r"record the new hash in models/weights\.py"):
        fetch.ensure_converted(DLIB, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_default_models_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FACESEARCH_MODELS_DIR", str(tmp_path / "cache"))
    assert weights.default_models_dir() == tmp_path / "cache"
    monkeypatch.delenv("FACESEARCH_MODELS_DIR")
    assert weights.default_models_dir() == Path.home() / ".cache" / "facesearch" / "models"


def test_models_fetch_builds_every_converted_model(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The age model's npm files are seeded from the shared cache (already verified), so nothing is fetched.
    spec = weights.NPM_WEIGHTS["faceres_deep"]
    seeded = cache_dir_for(spec, tmp_path)
    seeded.mkdir(parents=True)
    for path in ensure_npm_files(spec, weights.default_models_dir()).values():
        shutil.copyfile(path, seeded / path.name)
    assert cli.main(["models", "fetch", "--models-dir", str(tmp_path)]) == 0
    printed = capfd.readouterr().out.split()
    assert printed == [str(tmp_path / spec.file_name) for spec in weights.CONVERTED.values()]
    for converted in weights.CONVERTED.values():
        assert _sha256(tmp_path / converted.file_name) == converted.sha256
