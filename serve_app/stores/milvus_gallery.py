"""Face vectors in Milvus (a milvus-lite server or a Milvus cluster) through pymilvus' MilvusClient.

- pymilvus is synchronous: every call runs in a thread of the Milvus pool the process' wiring gives the
  store (serve_app/wiring/stores.py), bounded and apart from the threads that decode images and run the
  models: a Milvus that hangs holds those threads only (calls beyond them wait their turn), never the
  transactions that need no Milvus. The index switch's steps run in the pool of the long jobs.
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
  (or IVF_SQ8 / HNSW when configured; milvus-lite always stays FLAT, see _wanted_index). The switch is a
  background job of the workers (serve_app/pipelines/index_switch.py: one replica at a time, under a
  renewed lease, resumable); this store gives it its steps (interfaces.GalleryIndexSwitch). The new index
  is built beside the served collection, which serves every search throughout:
  1. a second collection `{name}__g{n+1}` is created with the new index and loaded; from then on every
     replica's writes go to both (the served one first): each looks for such a collection at most
     _MARKER_TTL_S before a batch of writes, and the switch waits out a write's window before it copies;
  2. the rows are copied from the served collection a page at a time (copy_page: a row the new one
     already has is newer and kept; a row removed while it was copied is removed again);
  3. once the index covers the sealed segments, the served name moves to the new collection: a Milvus
     alias, swapped with alter_alias; the old collection is dropped a write's window later, when the calls
     that found it have ended. A collection made before this scheme holds the name itself: it is renamed
     (it goes on serving what is under way) and the alias created at once, and the calls that look the
     name up in between are tried again within their deadline (_run), never failed.
  A switch that stops half-way leaves the served collection as it was; the job's next holder resumes it
  (or drops the half-built collection and starts over). At the peak the server holds both collections.
- Adding is delete-then-insert, never `upsert`: Milvus 2.3.5's upsert writes rows of a partition-key
  collection into the wrong partitions (a tenant filter then misses them; fixed upstream later), and an
  upsert is a delete plus an insert inside the server anyway, no more atomic than this.
- Consistency (`consistency_level`, "Tenant" by default): a face is searchable as soon as its enrolment
  is answered, on every replica, without Strong's wait on every search (up to one time tick, ~200-400 ms on
  a Milvus server). `add` records, per tenant, the Milvus timestamp of its newest write in Redis
  (interfaces.TenantWriteClock: a monotone maximum, before `add` returns), and a search passes its
  tenant's timestamp as its guarantee ("Customized" level): the server waits only until that write is
  visible, which it already is unless the write was a moment ago. A tenant with no recorded write searches
  Bounded (its writes, if any, predate the clock, by more than gracefulTime in practice). Deletes need no
  guarantee: Milvus 2.3.5 gives them no timestamp, and a match whose face record is gone is never
  returned (pipelines/processing.py); for up to gracefulTime such a vector can take one of the top places.
  Without a clock, and on milvus-lite (whose Strong costs nothing), "Tenant" is Strong. "Strong",
  "Bounded" (a new face becomes searchable within the server's gracefulTime, 5 s by default), "Session"
  and "Eventually" are Milvus' own. See docs/scaling.md, "Milvus at scale".
  Search parameters carry the keys of every index family, so a replica that has not yet noticed the
  switch still searches the new index with the configured nprobe / ef.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.domain.faces import GalleryEntry, GalleryMatch
from serve_app.stores.interfaces import CopiedPage, IndexSwitchPlan, SwitchStage, TenantWriteClock

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
CONSISTENCY_LEVELS = ("Tenant", "Strong", "Bounded", "Session", "Eventually")
_TRANSIENT_WORDS = (
    "connect",
    "UNAVAILABLE",
    "DEADLINE",
    "unavailable",
    "Retry",
    "not loaded",
    "index not found",
    "collection not found",
    "can't find collection",
    "alias not found",
    "channel not available",
)
# The moment of a switch when the served name points nowhere (module docstring, "Index by size"), and calls
# still running on the collection it drops (a search waiting for its guarantee: "delegator closed during
# wait tsafe: channel not available"): a call failing with these words is tried again within its deadline.
_SWAP_WORDS = (
    "collection not found",
    "can't find collection",
    "alias not found",
    "not loaded",
    "channel not",
)
_MARKER_TTL_S = 1.0  # how long a store trusts its last look at whether a switch is building a collection
_MAX_ITERATOR_BATCH = 16_384  # pymilvus refuses a larger query iterator batch


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
        consistency_level: str = "Tenant",
        switch_timeout_s: float = 1800.0,
        write_clock: TenantWriteClock | None = None,
        write_window_s: float | None = None,
        executor: Executor | None = None,
        job_executor: Executor | None = None,
    ) -> None:
        """index_policy None: exact FLAT search at any size. partition_key: create new collections with
        tenant_id as partition key where the server supports it (an existing collection keeps its
        layout). write_clock: where the "Tenant" consistency level keeps each tenant's last write
        (without one, "Tenant" searches are Strong). write_window_s: how long an index switch waits for
        writes that began before it to end; None: the longest a write of any replica can take, which only
        a gallery with a single writer may shorten. executor: where the blocking Milvus calls run (the
        process' Milvus pool); job_executor: where the index switch's steps run (the pool of the long jobs,
        as one can wait minutes for an index); None: the event loop's default pool (the CLI, tests).
        switch_timeout_s: the deadline of a switch step that builds (creating, flushing the target)."""
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
        self._switch_timeout_s = switch_timeout_s
        self._executor = executor
        self._job_executor = job_executor
        self._clock = write_clock
        # A write that looked for a collection being built before the switch created one ends within this
        # (its delete and insert, each within its deadline, after a look at most _MARKER_TTL_S old).
        longest_write_s = 2 * timeout_s + _MARKER_TTL_S + 1.0
        self._write_window_s = longest_write_s if write_window_s is None else write_window_s
        self._build_target: tuple[float, str | None] = (-math.inf, None)  # (when looked, collection)
        self._generation_re = re.compile(re.escape(self._collection) + r"__g(\d+)")
        self._want_partition_key = partition_key
        self._index_type = "FLAT"  # the collection's actual index, learnt when it is prepared
        self._partitioned = False  # whether the collection's tenant_id is its partition key
        self._lite: bool | None = None  # milvus-lite (no partitions, no HNSW); probed when first needed
        self._stays_flat = False  # the policy keeps FLAT past its threshold (milvus-lite): never recount
        self._client: Any = None
        self._init_lock = threading.Lock()  # a thread lock: initialisation runs in worker threads

    # -- plumbing ---------------------------------------------------------------------------------------

    async def _run(self, operation: Callable[[Any], T]) -> T:
        # The served name points nowhere for a moment at the first switch of a collection (module
        # docstring): calls then are tried again, within their deadline, instead of failing.
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, operation)
            except BackendUnavailable as error:
                if not any(word in str(error) for word in _SWAP_WORDS) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.1)

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
            generations = sorted(
                (self._generation(name), name) for name in client.list_collections(timeout=timeout)
                if self._generation(name) is not None
            )  # fmt: skip
            if generations:
                # A switch stopped between dropping the first collection and naming its successor: the
                # successor was complete before the drop (module docstring), so it is the one to serve.
                client.create_alias(generations[-1][1], self._collection, timeout=timeout)
                logger.warning("Milvus: %s names %s again", self._collection, generations[-1][1])
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

    def _create_collection(
        self,
        client: Any,
        name: str,
        *,
        partitioned: bool,
        index_type: str | None = "FLAT",
        timeout: float | None = None,
    ) -> None:
        """index_type None: no index, not loaded (a probe)."""
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
        index_params = None
        if index_type is not None:
            index_params = client.prepare_index_params()
            index_params.add_index(
                field_name="embedding", index_type=index_type, metric_type="IP",
                params=self._build_params(index_type),
            )  # fmt: skip
        client.create_collection(
            name, schema=schema, index_params=index_params, consistency_level="Strong",
            timeout=timeout or self._timeout_s,
        )  # fmt: skip

    def _is_lite(self, client: Any) -> bool:
        """Whether the server is milvus-lite, told by behaviour rather than by version strings: a
        partition-key collection there reports no partitions (a server reports its default, 64 on 2.3.5)."""
        if self._lite is None:
            probe = f"probe_{uuid.uuid4().hex[:12]}"
            self._create_collection(client, probe, partitioned=True, index_type=None)
            try:
                described = client.describe_collection(probe, timeout=self._timeout_s)
                self._lite = int(described.get("num_partitions") or 0) == 0
            finally:
                client.drop_collection(probe, timeout=self._timeout_s)
        return self._lite

    def _count(self, client: Any, name: str | None = None) -> int:
        rows = client.query(
            name or self._collection, filter="", output_fields=["count(*)"], consistency_level="Strong",
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

    def _build_params(self, index_type: str) -> dict[str, int | float]:
        params: dict[str, int | float] = dict(_BUILD_PARAMS.get(index_type, {}))
        if index_type != "FLAT" and self._policy is not None:
            params.update({key: value for key, value in self._policy.build_params.items() if key in params})
        return params

    def _build_index(self, client: Any, index_type: str) -> None:
        params = self._build_params(index_type)
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="embedding", index_type=index_type, metric_type="IP", params=params)
        # Building reads the whole collection: a long deadline (minutes at 10M rows), but a deadline.
        client.create_index(self._collection, index_params, timeout=self._switch_timeout_s)
        self._index_type = index_type
        logger.info("Milvus collection %s: index %s %s", self._collection, index_type, params)

    # -- the switch beside the served collection (module docstring, "Index by size") --------------------

    def _generation(self, name: str) -> int | None:
        """n for `{collection}__g{n}`, a collection of this store's own that a switch built; else None."""
        match = self._generation_re.fullmatch(name)
        return int(match.group(1)) if match else None

    def _served(self, client: Any, names: Sequence[str]) -> str | None:
        """The collection the served name stands for: itself (a collection never switched), the one its
        alias names, or None for the moment between the first switch's drop and its alias."""
        if self._collection in names:
            return self._collection
        from pymilvus.exceptions import MilvusException

        try:
            return str(client.describe_alias(self._collection, timeout=self._timeout_s)["collection_name"])
        except MilvusException:
            return None

    def _being_built(self, client: Any) -> str | None:
        """The collection a switch is building beside the served one (writes go to both), as seen at most
        _MARKER_TTL_S ago; None on milvus-lite, which never switches."""
        looked, target = self._build_target
        now = time.monotonic()
        if now - looked < _MARKER_TTL_S or self._is_lite(client):
            return target
        names = client.list_collections(timeout=self._timeout_s)
        served = self._served(client, names)
        built = [name for name in names if self._generation(name) is not None and name != served]
        target = max(built, key=lambda name: self._generation(name) or 0) if built else None
        self._build_target = (now, target)
        return target

    async def _switch_step(self, step: Callable[[Any], T]) -> T:
        """One step of a switch, in the pool of the long jobs (a step may wait minutes for an index)."""
        return await asyncio.get_running_loop().run_in_executor(self._job_executor, self._call, step)

    # -- interfaces.GalleryIndexSwitch: the steps pipelines/index_switch.py takes under its lease ----------

    @property
    def switch_name(self) -> str:
        return self._collection

    @property
    def write_window_s(self) -> float:
        return self._write_window_s

    async def plan_switch(self) -> IndexSwitchPlan | None:
        def plan(client: Any) -> IndexSwitchPlan | None:
            if self._policy is None or self._stays_flat:
                return None
            current = client.describe_index(self._collection, "embedding", timeout=self._timeout_s) or {}
            if current.get("index_type") not in (None, "", "FLAT"):
                self._index_type = str(current["index_type"])  # switched already (by another replica)
                return None
            rows = self._count(client)
            wanted = self._wanted_index(client, rows)
            if wanted == "FLAT":
                # Past the threshold and still FLAT (milvus-lite): no switch will ever be due, so the job
                # stops counting the collection.
                self._stays_flat = rows > self._policy.flat_max_rows
                return None
            served = self._served(client, client.list_collections(timeout=self._timeout_s))
            if served is None:
                raise BackendUnavailable(f"Milvus: {self._collection} names no collection")
            target = f"{self._collection}__g{(self._generation(served) or 0) + 1}"
            # A collection made before switches built beside it holds the served name itself: it is renamed
            # (promote), so it goes on serving the calls under way.
            retired = served if served != self._collection else f"{self._collection}__g0"
            return IndexSwitchPlan(served, target, retired, wanted, rows)

        return await self._switch_step(plan)

    async def switch_stage(self, target: str) -> SwitchStage:
        def stage(client: Any) -> SwitchStage:
            names = client.list_collections(timeout=self._timeout_s)
            if self._served(client, names) == target:
                return "served"
            return "beside" if target in names else "absent"

        return await self._switch_step(stage)

    async def begin_switch(self, plan: IndexSwitchPlan) -> None:
        def begin(client: Any) -> None:
            names = client.list_collections(timeout=self._timeout_s)
            served = self._served(client, names)
            if served != plan.served:
                raise BackendUnavailable(f"Milvus: {self._collection} names {served}, not {plan.served}")
            for name in names:
                if self._generation(name) is not None and name != served:
                    client.drop_collection(name, timeout=self._timeout_s)  # left by an abandoned switch
            self._create_collection(
                client, plan.target, partitioned=self._partitioned, index_type=plan.index_type,
                timeout=self._switch_timeout_s,
            )  # fmt: skip
            self._build_target = (-math.inf, None)  # this process' writes go to both from now
            logger.info(
                "Milvus collection %s: %d rows, building %s beside it (%s)",
                self._collection, plan.rows, plan.target, plan.index_type,
            )  # fmt: skip

        await self._switch_step(begin)

    async def copy_page(self, target: str, after: str | None, limit: int) -> CopiedPage:
        """Writes meanwhile reach both collections, the served one first, so per face id: a row the target
        already holds is newer than the copy and is kept; a row deleted from the served collection after
        the copy read it is deleted from the target again by the check that follows each insert (the
        writer deleted it from the served collection first, so the check sees it gone whenever the
        writer's own delete from the target came before the copy's insert)."""
        fields = ["tenant_id", "model_version", "created_at", "embedding"]
        batch = min(limit, _MAX_ITERATOR_BATCH)
        after_term = f"face_id > {milvus_string(_checked_id(after, 'face_id'))}" if after else 'face_id != ""'

        def copy(client: Any) -> CopiedPage:
            # A query iterator returns rows in primary key order, the next ones after the cursor; a batch
            # may hold fewer than batch_size while more follow (the server stops merging early): only an
            # empty one ends the collection.
            iterator = client.query_iterator(
                self._collection, batch_size=batch, filter=after_term, output_fields=fields,
                timeout=self._timeout_s,
            )  # fmt: skip
            rows: list[dict[str, Any]] = []
            ended = False
            try:
                while len(rows) < batch and not ended:
                    got = iterator.next()
                    rows.extend(got)
                    ended = not got
            finally:
                iterator.close()
            copied = 0
            for start in range(0, len(rows), _BATCH):
                copied += self._copy_rows(client, target, rows[start : start + _BATCH], fields)
            last = max((str(row["face_id"]) for row in rows), default=None)
            return CopiedPage(len(rows), copied, None if ended else last)

        return await self._switch_step(copy)

    async def seal(self, target: str) -> None:
        await self._switch_step(lambda client: client.flush(target, timeout=self._switch_timeout_s))

    async def index_built(self, target: str) -> bool:
        """Segments under the server's minimum size for an index (1,024 rows on 2.3.5) stay unindexed and
        are searched exactly: the index covers the sealed segments."""

        def built(client: Any) -> bool:
            info = client.describe_index(target, "embedding", timeout=self._timeout_s) or {}
            return int(info.get("pending_index_rows") or 0) == 0 and str(info.get("state")) == "Finished"

        return await self._switch_step(built)

    async def promote(self, plan: IndexSwitchPlan) -> None:
        """Safe to repeat: a holder that died between the rename and the alias left the name pointing
        nowhere, and the next one names the target."""

        def promote(client: Any) -> None:
            timeout = self._timeout_s
            # Strong counts: the query nodes hold every row written so far before searches move.
            logger.info(
                "Milvus: %s holds %d rows, %s %d", plan.target, self._count(client, plan.target),
                plan.served, self._count(client, plan.served),
            )  # fmt: skip
            names = client.list_collections(timeout=timeout)
            if plan.served == self._collection and self._collection in names:
                # Renamed, it goes on serving the calls already under way (dropped, it answered some
                # searches with nothing); the calls that look the name up before the alias names it are
                # tried again (_run).
                client.rename_collection(self._collection, plan.retired, timeout=timeout)
                client.create_alias(plan.target, self._collection, timeout=timeout)
            elif (served := self._served(client, names)) is None:
                client.create_alias(plan.target, self._collection, timeout=timeout)  # a holder died here
            elif served != plan.target:
                client.alter_alias(plan.target, self._collection, timeout=timeout)
            self._index_type = plan.index_type
            self._build_target = (-math.inf, None)
            logger.info("Milvus collection %s: now %s (%s)", self._collection, plan.target, plan.index_type)

        await self._switch_step(promote)

    async def drop(self, name: str) -> None:
        def drop(client: Any) -> None:
            if client.has_collection(name, timeout=self._timeout_s):
                client.drop_collection(name, timeout=self._timeout_s)
            self._build_target = (-math.inf, None)

        await self._switch_step(drop)

    def _copy_rows(self, client: Any, target: str, rows: list[dict[str, Any]], fields: list[str]) -> int:
        """Copy into `target` the rows (at most _BATCH) it lacks; returns how many it holds now."""
        ids = ", ".join(milvus_string(str(row["face_id"])) for row in rows)
        present = self._ids_in(client, target, ids)
        missing = [{key: row[key] for key in ("face_id", *fields)} for row in rows]
        missing = [row for row in missing if row["face_id"] not in present]
        if not missing:
            return 0
        client.insert(target, missing, timeout=self._timeout_s)
        copied_ids = ", ".join(milvus_string(str(row["face_id"])) for row in missing)
        kept = self._ids_in(client, self._collection, copied_ids)
        gone = [milvus_string(str(row["face_id"])) for row in missing if row["face_id"] not in kept]
        if gone:
            client.delete(target, filter=f"face_id in [{', '.join(gone)}]", timeout=self._timeout_s)
        return len(missing) - len(gone)

    def _ids_in(self, client: Any, name: str, quoted_ids: str) -> set[str]:
        rows = client.query(
            name, filter=f"face_id in [{quoted_ids}]", output_fields=["face_id"], consistency_level="Strong",
            limit=_MAX_TOPK, timeout=self._timeout_s,
        )  # fmt: skip
        return {str(row["face_id"]) for row in rows}

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

    def _version_collections(self, client: Any, *, building: bool = False) -> list[tuple[str, bool]]:
        """(name, loaded) of the gallery's collections: those of the other model versions, then the
        store's own (loaded: it is prepared before any call), then with `building` the one a switch is
        building beside it."""
        others = []
        for name in sorted(client.list_collections(timeout=self._timeout_s)):
            if name == self._collection or self._generation(name) is not None:
                continue  # the store's own: served under its name, or being built (below)
            if not name.startswith(self._prefix):
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
        target = self._being_built(client) if building else None
        return [*others, (self._collection, True), *([(target, True)] if target else [])]

    # -- GalleryStore -----------------------------------------------------------------------------------

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        """Adding a face_id again replaces its row (retries of an enrolment stay idempotent). Returns once
        the rows are searchable at the store's consistency level (with "Tenant", once each tenant's write
        timestamp is recorded)."""
        rows = [self._row(entry) for entry in entries]
        if not rows:
            return

        def replace(client: Any) -> dict[str, int]:
            stamps: dict[str, int] = {}
            for start in range(0, len(rows), _BATCH):
                batch = rows[start : start + _BATCH]
                ids = ", ".join(milvus_string(row["face_id"]) for row in batch)
                target = self._being_built(client)  # looked at per batch: a switch may start meanwhile
                for name in (self._collection, *([target] if target else [])):
                    # Delete, then insert (see the module docstring: no upsert). Without a tenant condition:
                    # the primary key is unique across tenants.
                    client.delete(name, filter=f"face_id in [{ids}]", timeout=self._timeout_s)
                    stamp = self._insert(client, name, batch)
                    for row in batch:
                        stamps[row["tenant_id"]] = max(stamps.get(row["tenant_id"], 0), stamp)
            return stamps

        stamps = await self._run(replace)
        if self._clock is not None and self._consistency == "Tenant":
            for tenant_id, stamp in stamps.items():
                await self._clock.advance(tenant_id, stamp)

    def _insert(self, client: Any, name: str, rows: list[dict[str, Any]]) -> int:
        """Insert; returns the write's Milvus timestamp (0 where the server gives none). MilvusClient.insert
        leaves the timestamp out of its answer; its connection handler returns it (MutationResult)."""
        result = client._get_connection().insert_rows(name, rows, timeout=self._timeout_s)
        return int(getattr(result, "timestamp", 0) or 0)

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
        tenant_clock = self._clock if self._consistency == "Tenant" else None
        stamp = await tenant_clock.read(tenant_id) if tenant_clock is not None else 0

        def search(client: Any) -> list[Any]:
            result: list[Any] = client.search(
                self._collection,
                data=[vector.tolist()],
                filter=expression,
                limit=min(limit, _MAX_TOPK),
                output_fields=[],  # ids and distances only, never the vectors
                search_params=self._search_params(),
                timeout=self._timeout_s,
                **self._consistency_args(client, stamp),
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

    def _consistency_args(self, client: Any, stamp: int) -> dict[str, Any]:
        """A search's consistency (module docstring, "Consistency"): the configured level, or for "Tenant"
        a wait for the tenant's last write (`stamp`), Bounded when none is recorded, and Strong without a
        clock or on milvus-lite."""
        if self._consistency != "Tenant":
            return {"consistency_level": self._consistency}
        if self._clock is None or self._is_lite(client):
            return {"consistency_level": "Strong"}
        if stamp:
            # "Customized": pymilvus passes guarantee_timestamp as given, and the server waits for it.
            return {"consistency_level": "Customized", "guarantee_timestamp": stamp}
        return {"consistency_level": "Bounded"}

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None:
        """Removes the faces from every model version's collection (module docstring)."""
        if not face_ids:
            return
        tenant = milvus_string(_checked_id(tenant_id, "tenant_id"))
        ids = [milvus_string(_checked_id(face_id, "face_id")) for face_id in face_ids]

        def delete(client: Any) -> None:
            from pymilvus.exceptions import MilvusException

            # The served collection before the one a switch builds beside it (see _backfill).
            for name, loaded in self._version_collections(client, building=True):
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
                    name, batch_size=min(limit, _MAX_ITERATOR_BATCH), filter=expression,
                    output_fields=["face_id"], timeout=self._timeout_s,
                )  # fmt: skip
                try:
                    taken = 0
                    while taken < limit and (rows := iterator.next()):
                        found.update(str(row["face_id"]) for row in rows)
                        taken += len(rows)
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

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, client.close)
