"""Face vectors in Milvus (a milvus-lite server or a Milvus cluster) through pymilvus' MilvusClient.

- pymilvus is synchronous: every call runs in a worker thread (asyncio.to_thread).
- One collection per face model version (`{collection}_{model_version}`, dimension and all, '.' and '-'
  written '_'), holding that version's vectors only: vectors of different models are never compared.
  Searches rely on it and filter on the tenant alone (a model_version term cost ~45 % of the filter's
  time on a Milvus server, docs/scaling.md), so it is kept, not assumed: `add` refuses a vector of
  another version, a collection records its version in its description when created, and a store
  refuses to open (BackendRejected) a collection recorded for another version, as "a.1" and "a_1" would
  share one name; a collection created before that record is checked by its rows when opened (one scan
  of the column per store). The rows keep their model_version field (older collections have it, and the
  schema check of `_version_collections` uses it). Vectors are unit length and searched by inner product
  (metric IP), so a match carries the cosine similarity. Galleries enrolled with an older version stay
  in their own collection, unsearched.
- Removal reaches every version: `delete` removes the faces from every collection of the gallery (every
  `{collection}_*` collection with the gallery's schema, found when the delete runs), so a face deleted or
  erased after a re-index leaves no copy in an older version's collection, which a switch back, or anyone
  reading that collection, would otherwise still find. The older collections go first and the store's own
  collection last: a removal interrupted in between leaves the face whole and searchable where it is
  served, and the caller's retry (or reconciliation) finishes it. A collection the server has not loaded
  (released to save memory) cannot evaluate a filter on a Milvus server ("collection not loaded"), so
  there the face ids alone select the rows: a face_id names one face in every tenant (see
  interfaces.GalleryStore), and the caller has matched it to the tenant's face record.
- Filters are strings parsed by the server. milvus-lite 2.5.1 rejects filter templates (filter_params:
  "token recognition error at '{'"), so values are validated and quoted by `milvus_string()`; only
  tenant ids and face ids (both ours) ever reach a filter.
- No user input is stored here: client_reference (5-255 characters of any Unicode, up to 1020 UTF-8 bytes)
  lives only in the face record in Redis and is joined by face_id after a search. Milvus counts VARCHAR
  lengths in bytes and refuses longer values, which made a long CJK or emoji reference fail after its
  record was written; keeping one copy in Redis also spares collections created earlier a migration.
- Every call has a deadline: pymilvus otherwise retries some failures up to 75 times (minutes).
- Tenant as partition key: a collection created on a Milvus server marks tenant_id as the partition key,
  so the tenant filter every search carries prunes the search to the partitions holding that tenant
  (tenants are hashed over the collection's partitions, 64 on Milvus 2.3.5). milvus-lite 2.5.1 has no
  partitions: it accepts the schema flag but then rejects every filter ("Invalid expr"), so a throwaway
  probe collection decides once per process, and lite collections keep the plain layout. A collection
  created before this layout existed (no partition key) is read and written as it is; docs/scaling.md,
  "Milvus at scale" section gives the migration.
- Index by size (IndexPolicy): exact FLAT up to `flat_max_rows` rows, then IVF_FLAT on a Milvus server
  (or IVF_SQ8 / HNSW when configured; milvus-lite always stays FLAT, see _wanted_index). The
  replica whose insert crosses the threshold rebuilds the index (release, drop, create, load) while it
  holds a cluster-wide lease (interfaces.Leases, in Redis), so of many replicas crossing it together one
  rebuilds and the others carry on inserting; the rebuild is bounded (`switch_timeout_s` for the build,
  and again for the load; past it the collection goes back to FLAT and a later insert tries again).
  Searches meanwhile fail as BackendUnavailable ("not loaded") and are retried.
- Adding is delete-then-insert, never `upsert`: Milvus 2.3.5's upsert writes rows of a partition-key
  collection into the wrong partitions (a tenant filter then misses them; fixed upstream later), and an
  upsert is a delete plus an insert inside the server anyway, no more atomic than this.
- Consistency (`consistency_level`, "Strong" by default): a search sees every write acknowledged before it
  started, on every replica, so an enrolled face is searchable as soon as its enrolment is answered. On a
  Milvus server that costs up to one time tick per search (~200 ms at the default
  proxy.timeTickInterval); "Bounded" drops it, and a new face then becomes searchable within the
  server's gracefulTime (5 s by default). See docs/scaling.md, "Milvus at scale".
  Search parameters carry the keys of every index family, so a replica that has not yet noticed the
  switch still searches the new index with the configured nprobe / ef.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.domain.faces import GalleryEntry, GalleryMatch
from serve_app.stores.interfaces import Leases

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


class _NoSessionTsNotice(logging.Filter):
    """milvus-lite answers a query iterator without a session timestamp and pymilvus logs a warning for
    every iterator it opens (one per batch of a reconciliation scan); the client-side timestamp it falls
    back to is what a single-process server needs, so the notice says nothing actionable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to get mvccTs" not in record.getMessage()


logging.getLogger("pymilvus.orm.iterator").addFilter(_NoSessionTsNotice())


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


# Build and search parameters of the approximate indexes (Milvus' recommended starting points; tune them
# with bench/vector_search.py against a Milvus server). A policy's own parameters override these key by key.
_BUILD_PARAMS: dict[str, dict[str, int]] = {
    "IVF_FLAT": {"nlist": 1024},
    "IVF_SQ8": {"nlist": 1024},  # IVF with 8-bit scalar-quantised vectors: ~1/4 of IVF_FLAT's memory
    "HNSW": {"M": 16, "efConstruction": 200},
}
_SEARCH_PARAMS: dict[str, int] = {"nprobe": 64, "ef": 128}
_DESCRIPTION = "facesearch face gallery of model version "  # + the version: a collection's own record
LARGE_INDEXES = ("IVF_FLAT", "IVF_SQ8", "HNSW")
CONSISTENCY_LEVELS = ("Strong", "Bounded", "Session", "Eventually")
_TRANSIENT_WORDS = (
    "connect",
    "UNAVAILABLE",
    "DEADLINE",
    "unavailable",
    "Retry",
    "not loaded",
    "index not found",
)


@dataclass(frozen=True)
class IndexPolicy:
    """Exact search up to `flat_max_rows` rows, then the approximate `large_index`.

    large_index: IVF_FLAT, IVF_SQ8 or HNSW on a Milvus server ("": IVF_FLAT); milvus-lite keeps FLAT whatever
    it says (MilvusGalleryStore._wanted_index). build_params / search_params override the defaults above,
    key by key."""

    flat_max_rows: int
    large_index: str = ""
    build_params: Mapping[str, int | float] = field(default_factory=dict)
    search_params: Mapping[str, int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.flat_max_rows < 0:
            raise ValueError("flat_max_rows must not be negative")
        if self.large_index not in ("", *LARGE_INDEXES):
            raise ValueError(f"large_index must be one of {LARGE_INDEXES} or empty")


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
        index_policy: IndexPolicy | None = None,
        partition_key: bool = True,
        consistency_level: str = "Strong",
        switch_leases: Leases | None = None,
        switch_timeout_s: float = 1800.0,
    ) -> None:
        """index_policy None: exact FLAT search at any size. partition_key: create new collections with
        tenant_id as partition key where the server supports it (an existing collection keeps its
        layout)."""
        if dimension <= 0:
            raise ValueError("dimension must be positive")
        self._uri = uri
        self._model_version = _checked_id(model_version, "model_version")
        self._prefix = f"{collection}_".replace(".", "_").replace("-", "_")
        self._collection = f"{self._prefix}{model_version}".replace(".", "_").replace("-", "_")
        self._gallery_names: set[str] = set()  # collections seen to have the gallery's schema
        self._dimension = dimension
        self._token = token
        self._timeout_s = timeout_s
        self._policy = index_policy
        if consistency_level not in CONSISTENCY_LEVELS:
            raise ValueError(f"consistency_level must be one of {CONSISTENCY_LEVELS}")
        self._consistency = consistency_level
        self._leases = switch_leases
        self._switch_timeout_s = switch_timeout_s
        self._want_partition_key = partition_key
        self._index_type = "FLAT"  # the collection's actual index, learnt when it is prepared
        self._partitioned = False  # whether the collection's tenant_id is its partition key
        self._lite: bool | None = None  # milvus-lite (no partitions, no HNSW); probed when first needed
        self._rows_seen = 0  # rows counted at preparation plus rows this store added: when to recount
        self._stays_flat = False  # the policy keeps FLAT past its threshold (milvus-lite): never recount
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
        # "not loaded" / "index not found": a collection in the middle of a switch of index (IndexPolicy).
        if not transport and not any(word in text for word in _TRANSIENT_WORDS):
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
        from pymilvus.exceptions import MilvusException

        timeout = self._timeout_s
        if not client.has_collection(self._collection, timeout=timeout):
            partitioned = self._want_partition_key and not self._is_lite(client)
            try:
                self._create_collection(client, self._collection, partitioned=partitioned)
                logger.info(
                    "created Milvus collection %s (FLAT, IP, %s)",
                    self._collection, "tenant partition key" if partitioned else "no partitions",
                )  # fmt: skip
            except MilvusException:
                # Another replica may have created it first; anything else re-raises below.
                if not client.has_collection(self._collection, timeout=timeout):
                    raise
        described = client.describe_collection(self._collection, timeout=timeout)
        recorded = self._recorded_version(described)
        if recorded is not None and recorded != self._model_version:
            raise self._version_conflict(recorded)
        self._partitioned = any(
            f.get("name") == "tenant_id" and f.get("is_partition_key") for f in described.get("fields", [])
        )
        index = client.describe_index(self._collection, "embedding", timeout=timeout) or {}
        self._index_type = str(index.get("index_type", ""))
        if not self._index_type:
            # A switch of index interrupted between drop and create: build the one the size calls for.
            self._build_index(client, self._wanted_index(client, self._count(client)))
        client.load_collection(self._collection, timeout=timeout)
        if recorded is None:
            # Created before collections recorded their version: its rows tell (queried once loaded).
            rows = client.query(
                self._collection, filter=f"model_version != {milvus_string(self._model_version)}",
                output_fields=["model_version"], limit=1, consistency_level="Strong", timeout=timeout,
            )  # fmt: skip
            if rows:
                raise self._version_conflict(str(rows[0]["model_version"]))
        # Counted once loaded: a Milvus server answers no query on a released collection (one released to
        # save memory, say an older model version's, which a store may open again).
        self._rows_seen = self._count(client)
        # A FLAT collection already past the threshold switches through _switch_if_due (under the lease).

    @staticmethod
    def _recorded_version(described: Mapping[str, Any]) -> str | None:
        """The model version a collection was created for (its description), None if it records none."""
        description = str(described.get("description") or "")
        return description.removeprefix(_DESCRIPTION) if description.startswith(_DESCRIPTION) else None

    def _version_conflict(self, found: str) -> BackendRejected:
        message = (
            f"Milvus collection {self._collection} holds face model version {found!r}, not "
            f"{self._model_version!r}: the two versions' names map to the same collection name ('.' and "
            "'-' become '_'); give one of them a name that differs otherwise"
        )
        logger.error(message)
        return BackendRejected(message)

    def _create_collection(self, client: Any, name: str, *, partitioned: bool) -> None:
        from pymilvus import DataType

        # The description records the model version: a store of another version that maps to the same
        # name refuses to open the collection (searches rely on one version per collection).
        schema = client.create_schema(
            auto_id=False, enable_dynamic_field=False, description=_DESCRIPTION + self._model_version
        )
        schema.add_field("face_id", DataType.VARCHAR, max_length=64, is_primary=True)
        schema.add_field("tenant_id", DataType.VARCHAR, max_length=64, is_partition_key=partitioned)
        schema.add_field("model_version", DataType.VARCHAR, max_length=64)
        schema.add_field("created_at", DataType.INT64)
        schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=self._dimension)
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="embedding", index_type="FLAT", metric_type="IP", params={})
        client.create_collection(
            name, schema=schema, index_params=index_params, consistency_level="Strong",
            timeout=self._timeout_s,
        )  # fmt: skip

    def _is_lite(self, client: Any) -> bool:
        """Whether the server is milvus-lite, told by behaviour rather than by version strings: a
        partition-key collection there reports no partitions (a server reports its default, 64 on 2.3.5)."""
        if self._lite is None:
            probe = f"probe_{uuid.uuid4().hex[:12]}"
            self._create_collection(client, probe, partitioned=True)
            try:
                described = client.describe_collection(probe, timeout=self._timeout_s)
                self._lite = int(described.get("num_partitions") or 0) == 0
            finally:
                client.drop_collection(probe, timeout=self._timeout_s)
        return self._lite

    def _count(self, client: Any) -> int:
        rows = client.query(
            self._collection, filter="", output_fields=["count(*)"], consistency_level="Strong",
            timeout=self._timeout_s,
        )  # fmt: skip
        return int(rows[0]["count(*)"]) if rows else 0

    def _wanted_index(self, client: Any, rows: int) -> str:
        policy = self._policy
        if policy is None or rows <= policy.flat_max_rows:
            return "FLAT"
        if self._is_lite(client):
            # milvus-lite stays FLAT, even when large_index names another index. Its IVF_FLAT ignores nprobe
            # (measured: the same recall@10, ~0.3, at nprobe 1 and at nprobe = nlist) and it has no HNSW,
            # so exact search is its only accurate choice; and rows that another client inserts while it
            # builds an index are lost, some without an error (2026-11-27: 5 of 60 runs of two replicas
            # inserting across the threshold at once lost the other replica's 20 rows).
            if policy.large_index:  # said once: the store stops recounting once it stays FLAT
                logger.warning("milvus-lite keeps collection %s FLAT (large_index ignored)", self._collection)
            return "FLAT"
        # On a server, IVF_FLAT at nprobe 64 kept 99.65 % of the service's matches on face-like vectors at
        # 1 M (bench.vector_search, docs/scaling.md); HNSW at M 16, ef 128 kept 79 %.
        return policy.large_index or "IVF_FLAT"

    def _build_index(self, client: Any, index_type: str) -> None:
        params: dict[str, int | float] = dict(_BUILD_PARAMS.get(index_type, {}))
        if index_type != "FLAT" and self._policy is not None:
            params.update({key: value for key, value in self._policy.build_params.items() if key in params})
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="embedding", index_type=index_type, metric_type="IP", params=params)
        # Building reads the whole collection: a long deadline (minutes at 10M rows), but a deadline.
        client.create_index(self._collection, index_params, timeout=self._switch_timeout_s)
        self._index_type = index_type
        logger.info("Milvus collection %s: index %s %s", self._collection, index_type, params)

    def _apply_policy(self, client: Any, rows: int) -> None:
        """Switch a FLAT collection past the policy's threshold to its approximate index."""
        wanted = self._wanted_index(client, rows)
        if wanted == "FLAT":
            # Past the threshold and still FLAT (milvus-lite's default): no switch will ever be due, so
            # inserts stop recounting the collection.
            self._stays_flat = self._policy is not None and rows > self._policy.flat_max_rows
            return
        current = client.describe_index(self._collection, "embedding", timeout=self._timeout_s) or {}
        if current.get("index_type") not in (None, "", "FLAT"):
            self._index_type = str(current["index_type"])  # another replica switched it already
            return
        logger.info("Milvus collection %s: %d rows, switching FLAT -> %s", self._collection, rows, wanted)
        if not self._is_lite(client):
            # Seal what is still in growing segments, so the new index covers every row (a server searches
            # growing segments by brute force until they are sealed and indexed).
            client.flush(self._collection, timeout=self._switch_timeout_s)
        client.release_collection(self._collection, timeout=self._timeout_s)
        try:
            client.drop_index(self._collection, "embedding", timeout=self._timeout_s)
            try:
                self._build_index(client, wanted)
            except BaseException:
                self._build_index(client, "FLAT")  # stay searchable; the failure still surfaces
                raise
        finally:
            client.load_collection(self._collection, timeout=self._switch_timeout_s)

    def _search_params(self) -> dict[str, Any]:
        # Keys of every family: a FLAT search ignores them, and a replica that missed a switch still
        # searches the approximate index with the configured nprobe / ef.
        params: dict[str, Any] = dict(_SEARCH_PARAMS)
        if self._policy is not None:
            params.update(self._policy.search_params)
        return {"metric_type": "IP", "params": params}

    @property
    def index_type(self) -> str:
        """The index this store last saw on its collection (FLAT, IVF_FLAT or HNSW)."""
        return self._index_type

    @property
    def collection(self) -> str:
        """The collection's name (the configured prefix and the model version)."""
        return self._collection

    @property
    def partitioned(self) -> bool:
        """Whether the collection's tenant_id is its partition key."""
        return self._partitioned

    def _version_collections(self, client: Any) -> list[tuple[str, bool]]:
        """(name, loaded) of the gallery's collections: those of the other model versions, then the
        store's own (loaded: it is prepared before any call)."""
        others = []
        for name in sorted(client.list_collections(timeout=self._timeout_s)):
            if name == self._collection or not name.startswith(self._prefix):
                continue
            if name not in self._gallery_names:
                fields = client.describe_collection(name, timeout=self._timeout_s).get("fields", [])
                names = {str(f.get("name")) for f in fields}
                keyed = any(f.get("name") == "face_id" and f.get("is_primary") for f in fields)
                if not (keyed and {"tenant_id", "model_version", "embedding"} <= names):
                    continue  # another application's collection that happens to share the prefix
                self._gallery_names.add(name)
            state = client.get_load_state(name, timeout=self._timeout_s).get("state")
            others.append((name, getattr(state, "name", str(state)) == "Loaded"))
        return [*others, (self._collection, True)]

    # -- GalleryStore -----------------------------------------------------------------------------------

    async def ensure_ready(self) -> None:
        """Connect, create the collection and index if missing, load it, and switch its index if the
        policy calls for it. Other methods connect lazily."""
        await self._run(lambda client: None)
        await self._switch_if_due()

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        """Adding a face_id again replaces its row (retries of an enrolment stay idempotent)."""
        rows = [self._row(entry) for entry in entries]
        if not rows:
            return

        def replace(client: Any) -> None:
            for start in range(0, len(rows), _BATCH):
                batch = rows[start : start + _BATCH]
                ids = ", ".join(milvus_string(row["face_id"]) for row in batch)
                # Delete, then insert (see the module docstring: no upsert). Without a tenant condition:
                # the primary key is unique across tenants.
                client.delete(self._collection, filter=f"face_id in [{ids}]", timeout=self._timeout_s)
                client.insert(self._collection, batch, timeout=self._timeout_s)
            self._rows_seen += len(rows)  # a re-add replaces rows: an upper bound, recounted at the switch

        await self._run(replace)
        await self._switch_if_due()

    async def _switch_if_due(self) -> None:
        policy = self._policy
        due = policy is not None and self._rows_seen > policy.flat_max_rows
        if not due or self._index_type != "FLAT" or self._stays_flat:
            return
        if self._leases is None:
            await self._run(self._recount_and_switch)
            return
        try:
            # Build plus load, each bounded by switch_timeout_s: the lease outlives a live holder.
            lease = self._leases.try_hold(f"milvus-index:{self._collection}", 2 * self._switch_timeout_s + 60)
            async with lease as held:
                if held:
                    await self._run(self._recount_and_switch)
                # Not held: another replica is switching; this one notices the new index when it sees it.
        except BackendUnavailable as error:
            # The rows are in; the next insert tries the switch again.
            logger.warning("index switch of %s postponed: %s", self._collection, error)

    def _recount_and_switch(self, client: Any) -> None:
        with self._init_lock:  # one switch per process at a time
            self._rows_seen = self._count(client)
            self._apply_policy(client, self._rows_seen)

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
        # The tenant term alone: the collection holds this model version only (module docstring), and a
        # model_version term cost ~45 % of the filter's time (docs/scaling.md).
        expression = f"tenant_id == {milvus_string(_checked_id(tenant_id, 'tenant_id'))}"

        def search(client: Any) -> list[Any]:
            result: list[Any] = client.search(
                self._collection,
                data=[vector.tolist()],
                filter=expression,
                limit=min(limit, _MAX_TOPK),
                output_fields=[],  # ids and distances only, never the vectors
                search_params=self._search_params(),
                consistency_level=self._consistency,
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
        """Removes the faces from every model version's collection (module docstring)."""
        if not face_ids:
            return
        tenant = milvus_string(_checked_id(tenant_id, "tenant_id"))
        ids = [milvus_string(_checked_id(face_id, "face_id")) for face_id in face_ids]

        def delete(client: Any) -> None:
            from pymilvus.exceptions import MilvusException

            for name, loaded in self._version_collections(client):
                for start in range(0, len(ids), _BATCH):
                    batch = ", ".join(ids[start : start + _BATCH])
                    # The tenant condition keeps a delete from ever touching another tenant's faces; a
                    # collection that is not loaded cannot evaluate it (module docstring).
                    condition = f"tenant_id == {tenant} and " if loaded else ""
                    try:
                        client.delete(
                            name, filter=f"{condition}face_id in [{batch}]", timeout=self._timeout_s
                        )
                    except MilvusException:
                        # An older version's collection dropped since it was listed holds nothing to remove.
                        if name == self._collection or client.has_collection(name, timeout=self._timeout_s):
                            raise
                        self._gallery_names.discard(name)
                        break

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

    async def page_ids(
        self, tenant_id: str, after: str | None, limit: int, *, all_versions: bool = False
    ) -> tuple[list[str], str | None]:
        expression = f"tenant_id == {milvus_string(_checked_id(tenant_id, 'tenant_id'))}"
        if after is not None:
            expression += f" and face_id > {milvus_string(_checked_id(after, 'face_id'))}"

        def first_batches(client: Any) -> list[str]:
            # A query iterator returns rows in primary key order, which a plain query with a limit does
            # not promise: its first batch is the next `limit` face ids after the cursor. Over several
            # collections, the first `limit` of their merged batches are the next `limit` ids of all.
            found: set[str] = set()
            for name in self._scanned(client, all_versions):
                iterator = client.query_iterator(
                    name, batch_size=limit, filter=expression, output_fields=["face_id"],
                    timeout=self._timeout_s,
                )  # fmt: skip
                try:
                    found.update(str(row["face_id"]) for row in iterator.next())
                finally:
                    iterator.close()
            return sorted(found)[:limit]

        face_ids = await self._run(first_batches) if limit > 0 else []
        return face_ids, (face_ids[-1] if len(face_ids) == limit else None)

    def _scanned(self, client: Any, all_versions: bool) -> list[str]:
        # Queries need a loaded collection: one released to save memory is not scanned.
        if not all_versions:
            return [self._collection]
        return [name for name, loaded in self._version_collections(client) if loaded]

    async def present(
        self, tenant_id: str, face_ids: Sequence[str], *, all_versions: bool = False
    ) -> set[str]:
        if not face_ids:
            return set()
        tenant = milvus_string(_checked_id(tenant_id, "tenant_id"))
        ids = [milvus_string(_checked_id(face_id, "face_id")) for face_id in face_ids]

        def query(client: Any) -> set[str]:
            found: set[str] = set()
            for name in self._scanned(client, all_versions):
                for start in range(0, len(ids), _BATCH):
                    batch = ", ".join(ids[start : start + _BATCH])
                    rows = client.query(
                        name, filter=f"tenant_id == {tenant} and face_id in [{batch}]",
                        output_fields=["face_id"], consistency_level="Strong", timeout=self._timeout_s,
                    )  # fmt: skip
                    found.update(str(row["face_id"]) for row in rows)
            return found

        return await self._run(query)

    async def count(self) -> int:
        return await self._run(self._count)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)
