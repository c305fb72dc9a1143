"""Face vectors in Milvus (a milvus-lite server or a Milvus cluster) through pymilvus' MilvusClient.

- pymilvus is synchronous: every call runs in a worker thread (asyncio.to_thread).
- One collection per face model version (`{collection}_{model_version}`, dimension and all), and every
  search is also filtered by model_version: vectors of different models are never compared. Vectors are
  unit length and searched by inner product (metric IP), so a match carries the cosine similarity.
  Galleries enrolled with an older version stay in their own collection, untouched and unsearched.
- Filters are strings parsed by the server. milvus-lite 2.5.1 rejects filter templates (filter_params:
  "token recognition error at '{'"), so values are validated and quoted by `milvus_string()`; only
  tenant ids and face ids (both ours) ever reach a filter.
- No user input is stored here: client_reference (5-255 characters of any Unicode, up to 1020 UTF-8 bytes)
  lives only in the face record in Redis and is joined by face_id after a search. Milvus counts VARCHAR
  lengths in bytes and refuses longer values, which made a long CJK or emoji reference fail after its
  record was written; keeping one copy in Redis also spares collections created earlier a migration.
- Every call has a deadline: pymilvus otherwise retries some failures up to 75 times (minutes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.domain.faces import GalleryEntry, GalleryMatch

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ID_RE = re.compile(r"^[A-Za-z0-9_\-.:@]{1,64}$")
_MAX_TOPK = 16384  # Milvus' limit on search limit
_BATCH = 2000  # rows per insert / ids per delete request, well under gRPC's message size limit
# A private subchannel pool and a short reconnect backoff: with gRPC's defaults a channel that saw the
# server down keeps failing for up to minutes of backoff after the server is back (measured: 0.6-1.1 s
# after a restart even for a new client, which shares the failed subchannel through the global pool).
_GRPC_OPTIONS = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}


def milvus_string(value: str) -> str:
    """A Milvus expression string literal for `value`: double-quoted, backslash and quote escaped.
    Control characters are refused because the expression lexer does not accept them raw."""
    if any(ord(ch) < 0x20 for ch in value):
        raise ValueError("control characters are not allowed in filter values")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _checked_id(value: str, what: str) -> str:
    # Allow-list on top of quoting: ids are ours, so anything unusual is a bug, not data.
    if not _ID_RE.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}")
    return value


class MilvusGalleryStore:
    def __init__(
        self,
        uri: str,
        collection: str = "faces",
        token: str = "",
        *,
        model_version: str,
        dimension: int,
        timeout_s: float = 10.0,
        index_type: str = "FLAT",
        nlist: int = 1024,
        nprobe: int = 64,
    ) -> None:
        """index_type: FLAT (exact; the default, fast enough on milvus-lite up to ~1M faces) or IVF_FLAT
        (approximate: nlist clusters, nprobe of them searched). The index is chosen when the collection
        is created; an existing collection keeps its index."""
        if index_type not in ("FLAT", "IVF_FLAT"):
            raise ValueError("index_type must be FLAT or IVF_FLAT")
        if dimension <= 0:
            raise ValueError("dimension must be positive")
        self._uri = uri
        self._model_version = _checked_id(model_version, "model_version")
        self._collection = f"{collection}_{model_version}".replace(".", "_").replace("-", "_")
        self._dimension = dimension
        self._token = token
        self._timeout_s = timeout_s
        self._index_type = index_type
        self._nlist = nlist
        self._nprobe = nprobe
        self._client: Any = None
        self._init_lock = threading.Lock()  # a thread lock: initialisation runs in worker threads

    # -- plumbing ---------------------------------------------------------------------------------------

    async def _run(self, operation: Callable[[Any], T]) -> T:
        return await asyncio.to_thread(self._call, operation)

    def _call(self, operation: Callable[[Any], T]) -> T:
        from pymilvus.exceptions import MilvusException

        try:
            return operation(self._ready_client())
        except MilvusException as error:
            raise self._unavailable(error) from error
        except Exception as error:
            # grpc errors and socket errors that pymilvus lets through.
            if type(error).__module__.startswith(("grpc", "pymilvus")) or isinstance(error, OSError):
                raise self._unavailable(error) from error
            raise

    @staticmethod
    def _unavailable(error: Exception) -> BackendUnavailable:
        text = str(error)
        transport = type(error).__module__.startswith("grpc") or isinstance(error, OSError)
        if not transport and not any(
            word in text for word in ("connect", "UNAVAILABLE", "DEADLINE", "unavailable", "Retry")
        ):
            # Not a transport failure (a rejected request, a bug): keep the traceback in the log, and let a
            # worker count it as a failed attempt rather than requeue it as an outage forever.
            logger.error("unexpected Milvus error", exc_info=error)
            return BackendRejected(f"Milvus is unavailable: {text}")
        return BackendUnavailable(f"Milvus is unavailable: {text}")

    def _ready_client(self) -> Any:
        client = self._client
        if client is not None:
            return client
        with self._init_lock:
            if self._client is None:
                from pymilvus import MilvusClient

                # Connects at construction (fails fast on a closed port); only a client whose
                # collection is ready is kept, so a failed attempt is retried by the next call.
                client = MilvusClient(
                    uri=self._uri, token=self._token, timeout=self._timeout_s, grpc_options=_GRPC_OPTIONS
                )
                try:
                    self._prepare_collection(client)
                except BaseException:
                    client.close()
                    raise
                self._client = client
            return self._client

    def _prepare_collection(self, client: Any) -> None:
        from pymilvus import DataType
        from pymilvus.exceptions import MilvusException

        timeout = self._timeout_s
        if not client.has_collection(self._collection, timeout=timeout):
            schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
            schema.add_field("face_id", DataType.VARCHAR, max_length=64, is_primary=True)
            schema.add_field("tenant_id", DataType.VARCHAR, max_length=64)
            schema.add_field("model_version", DataType.VARCHAR, max_length=64)
            schema.add_field("created_at", DataType.INT64)
            schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=self._dimension)
            index_params = client.prepare_index_params()
            params = {"nlist": self._nlist} if self._index_type == "IVF_FLAT" else {}
            index_params.add_index(
                field_name="embedding", index_type=self._index_type, metric_type="IP", params=params
            )
            try:
                client.create_collection(
                    self._collection,
                    schema=schema,
                    index_params=index_params,
                    consistency_level="Strong",
                    timeout=timeout,
                )
                logger.info("created Milvus collection %s (%s, IP)", self._collection, self._index_type)
            except MilvusException:
                # Another replica may have created it first; anything else re-raises below.
                if not client.has_collection(self._collection, timeout=timeout):
                    raise
        else:
            # Search parameters follow the index the collection actually has.
            described = client.describe_index(self._collection, "embedding", timeout=timeout) or {}
            self._index_type = str(described.get("index_type", self._index_type))
        client.load_collection(self._collection, timeout=timeout)

    def _search_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"nprobe": self._nprobe} if self._index_type == "IVF_FLAT" else {}
        return {"metric_type": "IP", "params": params}

    # -- GalleryStore -----------------------------------------------------------------------------------

    async def ensure_ready(self) -> None:
        """Connect, create the collection and index if missing, load it. Other methods do this lazily."""
        await self._run(lambda client: None)

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        """Upsert: adding a face_id again replaces its row (retries of an enrolment stay idempotent)."""
        rows = [self._row(entry) for entry in entries]
        if not rows:
            return

        def upsert(client: Any) -> None:
            for start in range(0, len(rows), _BATCH):
                client.upsert(self._collection, rows[start : start + _BATCH], timeout=self._timeout_s)

        await self._run(upsert)

    def _checked_vector(self, embedding: np.ndarray) -> np.ndarray:
        vector = np.asarray(embedding, dtype=np.float32).reshape(-1)
        if vector.shape != (self._dimension,) or not np.isfinite(vector).all():
            raise ValueError(f"embedding must be {self._dimension} finite floats")
        return vector

    def _row(self, entry: GalleryEntry) -> dict[str, Any]:
        if entry.model_version != self._model_version:
            raise ValueError(
                f"a {entry.model_version!r} vector cannot join the {self._model_version!r} gallery"
            )
        vector = self._checked_vector(entry.embedding)
        return {
            "face_id": _checked_id(entry.face_id, "face_id"),
            "tenant_id": _checked_id(entry.tenant_id, "tenant_id"),
            "model_version": entry.model_version,
            "created_at": round(entry.created_at * 1000),
            "embedding": vector.tolist(),
        }

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        if limit <= 0:
            return []
        vector = self._checked_vector(embedding)
        expression = (
            f"tenant_id == {milvus_string(_checked_id(tenant_id, 'tenant_id'))}"
            f" and model_version == {milvus_string(self._model_version)}"
        )

        def search(client: Any) -> list[Any]:
            result: list[Any] = client.search(
                self._collection,
                data=[vector.tolist()],
                filter=expression,
                limit=min(limit, _MAX_TOPK),
                output_fields=[],  # ids and distances only, never the vectors
                search_params=self._search_params(),
                consistency_level="Strong",
                timeout=self._timeout_s,
            )
            return list(result[0]) if result else []

        matches = []
        for hit in await self._run(search):
            similarity = float(hit["distance"])  # metric IP: the inner product, i.e. the cosine
            if not math.isfinite(similarity) or similarity < min_similarity:
                continue
            matches.append(GalleryMatch(face_id=str(hit["id"]), similarity=similarity))
        matches.sort(key=lambda match: -match.similarity)
        return matches

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None:
        if not face_ids:
            return
        tenant = milvus_string(_checked_id(tenant_id, "tenant_id"))
        ids = [milvus_string(_checked_id(face_id, "face_id")) for face_id in face_ids]

        def delete(client: Any) -> None:
            for start in range(0, len(ids), _BATCH):
                batch = ", ".join(ids[start : start + _BATCH])
                # The tenant condition keeps a delete from ever touching another tenant's faces.
                client.delete(
                    self._collection, filter=f"tenant_id == {tenant} and face_id in [{batch}]",
                    timeout=self._timeout_s,
                )  # fmt: skip

        await self._run(delete)

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        if tenant_id is None:
            expression = 'face_id != ""'
        else:
            expression = f"tenant_id == {milvus_string(_checked_id(tenant_id, 'tenant_id'))}"

        def scan(client: Any) -> set[tuple[str, str]]:
            found: set[tuple[str, str]] = set()
            iterator = client.query_iterator(
                self._collection, batch_size=1000, filter=expression, output_fields=["tenant_id"],
                timeout=self._timeout_s,
            )  # fmt: skip
            try:
                while rows := iterator.next():
                    found.update((str(row["tenant_id"]), str(row["face_id"])) for row in rows)
            finally:
                iterator.close()
            return found

        return await self._run(scan)

    async def count(self) -> int:
        def count(client: Any) -> int:
            rows = client.query(
                self._collection, filter="", output_fields=["count(*)"], consistency_level="Strong",
                timeout=self._timeout_s,
            )  # fmt: skip
            return int(rows[0]["count(*)"]) if rows else 0

        return await self._run(count)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)
