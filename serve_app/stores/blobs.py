"""Blobs (uploaded images, enrolled proofs) as files in a local directory.

Layout: <dir>/<h[0:2]>/<h[2:4]>/<h> with h = sha256(key), plus <h>.type holding the content type and, on
its second line, the key (so a scan of the files can name each blob's owner: scan_old). Keys are validated
before use and only their hash names a file, so no key can address a path outside the directory; the
two-level fan-out keeps directories small. Writes go to a temporary file that is fsynced and renamed
over the target, so a reader sees the old blob or the new one, never a partial file.

A file system out of space (ENOSPC) or quota (EDQUOT) is StorageFull, a busy server to the callers (507
with Retry-After to a client, an outage to a worker), not a bug: a write refused so leaves nothing behind
(neither its temporary file nor the content-type file of a blob whose data never arrived).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from serve_app.domain.errors import StorageFull
from serve_app.stores.interfaces import BlobPage

_KEY_RE = re.compile(r"^[A-Za-z0-9_\-/]+$")
_MAX_KEY_LENGTH = 512
_CONTENT_TYPE_RE = re.compile(r"^[\x20-\x7e]{1,255}$")
DEFAULT_CONTENT_TYPE = "application/octet-stream"


def validate_key(key: str) -> str:
    """The key itself when it is acceptable; ValueError otherwise."""
    if (
        not key
        or len(key) > _MAX_KEY_LENGTH
        or not _KEY_RE.fullmatch(key)
        or ".." in key
        or key.startswith("/")
        or key.endswith("/")
        or "//" in key
    ):
        raise ValueError(f"invalid blob key {key!r}")
    return key


def validate_content_type(content_type: str) -> str:
    """The content type itself when it is 1-255 printable ASCII characters; ValueError otherwise (it is
    sent back as a response header)."""
    if not _CONTENT_TYPE_RE.fullmatch(content_type):
        raise ValueError(f"invalid content type {content_type!r}")
    return content_type


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _space_errors(root: Path) -> Iterator[None]:
    """A write or a removal (a full copy-on-write file system refuses those too) the file system refused
    for space becomes StorageFull; any other OSError stays what it is."""
    try:
        yield
    except OSError as error:
        if error.errno in _NO_SPACE:
            raise StorageFull(f"blob store {root}: {error.strerror}") from error
        raise


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


class LocalBlobStore:
    def __init__(self, directory: Path | str) -> None:
        self._root = Path(directory).resolve()

    @property
    def directory(self) -> Path:
        return self._root

    def _path(self, key: str) -> Path:
        digest = hashlib.sha256(validate_key(key).encode()).hexdigest()
        return self._root / digest[:2] / digest[2:4] / digest

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        path = self._path(key)
        validate_content_type(content_type)
        with _space_errors(self._root):
            await asyncio.to_thread(self._put_sync, path, bytes(data), content_type, key)

    @staticmethod
    def _put_sync(path: Path, data: bytes, content_type: str, key: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Type first: a reader that finds the data finds its type too.
        type_path = path.with_suffix(".type")
        _atomic_write(type_path, f"{content_type}\n{key}".encode())
        try:
            _atomic_write(path, data)
        except BaseException:
            # A new blob whose data never arrived leaves no content-type file either: the sweep walks data
            # files only (scan_old), so it would stay for ever. An older blob under the key keeps its own.
            if not path.exists():
                with contextlib.suppress(FileNotFoundError):
                    type_path.unlink()
            raise
        _fsync_directory(path.parent)

    async def get(self, key: str) -> tuple[bytes, str] | None:
        return await asyncio.to_thread(self._get_sync, self._path(key))

    @staticmethod
    def _get_sync(path: Path) -> tuple[bytes, str] | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            content_type = path.with_suffix(".type").read_text().partition("\n")[0].strip()
        except FileNotFoundError:
            content_type = ""
        return data, content_type or DEFAULT_CONTENT_TYPE

    async def delete(self, key: str) -> None:
        path = self._path(key)
        with _space_errors(self._root):
            await asyncio.to_thread(self._delete_sync, path)

    @staticmethod
    def _delete_sync(path: Path) -> None:
        for target in (path, path.with_suffix(".type")):
            with contextlib.suppress(FileNotFoundError):
                target.unlink()

    async def sweep(self, keep: Collection[str], older_than_s: float) -> int:
        """Delete blobs whose key is not in `keep` and whose file is older than older_than_s, with the
        temporary files interrupted writes left behind. File names are key hashes, so the keys to keep are
        hashed and everything else in the fan-out directories is a candidate."""
        keep_names = set()
        for key in keep:
            with contextlib.suppress(ValueError):  # a key no blob could have been stored under
                keep_names.add(self._path(key).name)
        return await asyncio.to_thread(self._sweep_sync, keep_names, time.time() - older_than_s)

    def _sweep_sync(self, keep_names: set[str], cutoff: float) -> int:
        removed = 0
        for directory in self._root.glob("*/*"):
            if not directory.is_dir():
                continue
            for path in directory.iterdir():
                if path.name.removesuffix(".type") in keep_names:
                    continue
                try:
                    if path.stat().st_mtime >= cutoff:
                        continue
                    path.unlink()
                except FileNotFoundError:
                    continue  # deleted meanwhile
                if not path.name.endswith(".type") and not path.name.startswith(".tmp-"):
                    removed += 1
        return removed

    async def scan_old(self, after: str | None, older_than_s: float, limit: int) -> BlobPage:
        """Walks the fan-out directories in name order, whole directories at a time, until about `limit`
        old blobs were found; the cursor is the last directory walked ("ab/cd"). Memory: one page, whatever
        the number of blobs. Temporary files of interrupted writes found old are deleted on the way."""
        return await asyncio.to_thread(self._scan_sync, after, time.time() - older_than_s, limit)

    def _scan_sync(self, after: str | None, cutoff: float, limit: int) -> BlobPage:
        keys: list[str] = []
        unnamed = 0
        last: str | None = None
        for top in _subdirectories(self._root, after.split("/")[0] if after else None, inclusive=True):
            start = after.split("/")[1] if after and after.startswith(top.name + "/") else None
            for directory in _subdirectories(top, start, inclusive=False):
                last = f"{top.name}/{directory.name}"
                for entry in os.scandir(directory):
                    name = entry.name
                    if name.endswith(".type"):
                        continue
                    try:
                        if entry.stat().st_mtime >= cutoff:
                            continue
                        if name.startswith(".tmp-"):
                            os.unlink(entry.path)
                            continue
                        key = (directory / f"{name}.type").read_text().partition("\n")[2].strip()
                    except FileNotFoundError:
                        continue  # deleted meanwhile
                    if key:
                        keys.append(key)
                    else:
                        unnamed += 1
                if len(keys) + unnamed >= limit:
                    return BlobPage(keys, unnamed, last)
        return BlobPage(keys, unnamed, None)


def _subdirectories(parent: Path, start: str | None, *, inclusive: bool) -> list[Path]:
    """The fan-out directories of `parent` (two hex digits each: at most 256) in name order, from `start`
    (that one included or not)."""
    try:
        names = sorted(entry.name for entry in os.scandir(parent) if entry.is_dir() and len(entry.name) == 2)
    except FileNotFoundError:
        return []
    return [parent / name for name in names if start is None or name > start or (inclusive and name == start)]
