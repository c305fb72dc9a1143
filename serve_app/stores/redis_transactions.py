"""Transactions and the work queue in Redis.

Keys (prefix default "fs:"):
  {p}txn:{reference_id}       hash of the Transaction's attributes (encode_transaction: defaults left out,
                              the outcome as short fields, see outcome_codec)
  {p}txn-done:{reference_id}  short-lived list: the completion signal wait_final blocks on
  {p}sys:tx-counts            hash state -> number of transactions in that state
  {p}sys:tx-queue             stream of {"ref": reference_id}; consumer group "workers"
  {p}sys:tx-consumers         sorted set consumer -> last heartbeat (Redis server time, ms)
  {p}sys:tx-finished          stream of {"ref": reference_id}, one entry per transaction that became final
                              while results are archived (archive_after_s): the result archiver's to-do list
  {p}wh-event:..., {p}sys:wh-*  a completion webhook's event and its queue entries, written by the final
                              state's script when the tenant has an endpoint (redis_webhooks.py: layout
                              and the script's part that writes them)
  {p}idem:{digest}            hash {fp, ref, replays}: the request fingerprint and the reference_id of the
                              transaction an Idempotency-Key created (domain/idempotency.py); expires
                              idempotency_ttl_s after the create (24 h by default)

Each family has a prefix that no other key starts with, so a reference_id can only ever name a key of its
own family (an earlier layout put the queue at {p}tx:queue, where reference_id "queue" reached it). The API
also refuses anything that is not an issued reference_id (serve_app/domain/identifiers.py) before it gets
here, and get() treats such a value as unknown.

Why a hash and not one JSON document: state changes run as Lua scripts that only touch a few scalar
fields, so the script never has to decode and re-encode JSON (Lua's cjson would round floats and turn {}
into []), and they stay atomic: a final state is never overwritten.

Acknowledging an entry also deletes it from the stream, so the stream holds exactly the entries that are
not yet acknowledged and depth() is XLEN.

Each worker replica is one consumer of the group, named after its Serve replica. A replica that dies leaves
its consumer behind; once its entries have been reclaimed and it has been silent long past the stale window,
prune_consumers removes it, so the group holds the live workers and the recently dead ones, however often
workers restart. Whether a consumer is silent is read from a heartbeat each worker leaves when it prunes,
not only from the group's own idle time: Redis 6.2 moves that only when entries are delivered or claimed,
so a live worker polling an empty queue would look as idle as a dead one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from redis import exceptions as redis_exceptions
from redis.asyncio import Redis
from redis.typing import EncodableT

from serve_app.domain.errors import NotReplicated
from serve_app.domain.idempotency import IdempotencyClaim, IdempotencyConflict
from serve_app.domain.identifiers import is_reference_id
from serve_app.domain.outcomes import Outcome
from serve_app.domain.transactions import Transaction, TransactionState, upload_key
from serve_app.stores.interfaces import FinishedEntry, QueueEntry
from serve_app.stores.outcome_codec import outcome_fields
from serve_app.stores.redis_support import redis_errors, socket_timeout_of, text, text_map
from serve_app.stores.redis_webhooks import QUEUE_COMPLETION_EVENT, WebhookKeys
from serve_app.stores.transaction_codec import decode_transaction, encode_transaction

logger = logging.getLogger(__name__)

_FINAL = (TransactionState.COMPLETED.value, TransactionState.FAILED.value)

# The create-and-enqueue writes as one script, so they run on the connection that then sends WAIT (WAIT
# counts the replicas that acknowledged the writes of its own connection; a pipeline may use another).
# KEYS: transaction hash, counts hash, stream, and with an Idempotency-Key its record. ARGV: state,
# reference_id, fingerprint, the record's expiry in s (0: none), then the hash's field/value pairs.
# Returns {0, reference_id} when it created the transaction; with a key already recorded, nothing is
# created: {1, its reference_id} for the same fingerprint, {2, its reference_id} for another. A replay
# still writes (the replay count), so the WAIT after it also covers the original create: replicas apply
# the stream of writes in order, and a retry after a WAIT shortfall learns whether the create is now safe.
# The transaction itself existing already means this very call ran before and its reply was lost (redis-py
# resends a command whose connection dropped): it answers as a replay, and nothing is counted or queued
# twice.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], 0)
  return {1, ARGV[2]}
end
if #KEYS == 4 then
  local held = redis.call('HMGET', KEYS[4], 'fp', 'ref')
  if held[2] then
    redis.call('HINCRBY', KEYS[4], 'replays', 1)
    if held[1] == ARGV[3] then return {1, held[2]} end
    return {2, held[2]}
  end
  redis.call('HSET', KEYS[4], 'fp', ARGV[3], 'ref', ARGV[2])
  if tonumber(ARGV[4]) > 0 then redis.call('EXPIRE', KEYS[4], ARGV[4]) end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('XADD', KEYS[3], '*', 'ref', ARGV[2])
return {0, ARGV[2]}
"""

# QUEUED/PROCESSING -> PROCESSING with attempts + 1; returns the hash, or nil if unknown or final.
_MARK_PROCESSING = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return nil end
if state ~= 'queued' and state ~= 'processing' then return nil end
redis.call('HSET', KEYS[1], 'state', 'processing', 'updated_at', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if state == 'queued' then
  redis.call('HINCRBY', KEYS[2], 'queued', -1)
  redis.call('HINCRBY', KEYS[2], 'processing', 1)
end
return redis.call('HGETALL', KEYS[1])
"""

# Non-final -> final (ARGV[1]) at time ARGV[2]: sets the field/value pairs from ARGV[8] on (the result or
# the error), the expiry ARGV[3] (0: none), pushes the completion signal (kept ARGV[4] s) and, when ARGV[5]
# names the reference id, appends it to the stream of finished transactions the result archiver reads
# (KEYS[4]; its entry ids are the completion times). ARGV[6]: the reference id. When ARGV[7..11] are set
# (redis_webhooks.WebhookKeys.completion_args), the transaction's completion event is queued in the same
# step if its tenant has a webhook url (redis_webhooks.QUEUE_COMPLETION_EVENT, which owns the event's
# layout). Returns 1 when it changed the state, 0 when unknown or already final.
_FINALIZE = (
    QUEUE_COMPLETION_EVENT
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state == 'completed' or state == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', ARGV[2], unpack(ARGV, 12))
redis.call('HINCRBY', KEYS[2], state, -1)
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('EXPIRE', KEYS[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('XADD', KEYS[4], '*', 'ref', ARGV[5]) end
if ARGV[7] ~= '' then
  local tenant = redis.call('HGET', KEYS[1], 'tenant_id')
  if tenant then
    queue_completion_event(tenant, ARGV[6], ARGV[1], math.floor(tonumber(ARGV[2]) * 1000),
      ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
  end
end
return 1
"""
)

# Drops archived transactions: KEYS[1] the finished stream, KEYS[i + 1] the hash whose stream entry id is
# ARGV[i]. A hash goes only while it is final (the archived copy is of that final state), then its entry.
_DROP_ARCHIVED = """
local dropped = 0
for i = 1, #ARGV do
  local state = redis.call('HGET', KEYS[i + 1], 'state')
  if state == 'completed' or state == 'failed' then
    redis.call('DEL', KEYS[i + 1])
    dropped = dropped + 1
  end
  redis.call('XDEL', KEYS[1], ARGV[i])
end
return dropped
"""

# Lease renewal: for each id still pending with consumer ARGV[2], XCLAIM ... JUSTID (idle time back to 0,
# delivery count unchanged). Ids another consumer holds are skipped, never taken back. Returns held ids.
_RENEW = """
local held = {}
for i = 3, #ARGV do
  local owned = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if owned[1] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    held[#held + 1] = ARGV[i]
  end
end
return held
"""

# Forgetting consumers that are gone. KEYS: stream, heartbeat set. ARGV: group, gone_after_ms, the calling
# consumer, the most to remove. The caller is alive: it is added to the group (XINFO lists it even before
# its first entry) and its heartbeat is set to now. Then every other consumer that holds no pending entry,
# has had no entry delivered or claimed for gone_after_ms and has left no heartbeat for as long is removed.
# One script, so no consumer can be handed an entry between the check and XGROUP DELCONSUMER: that command
# drops the consumer's pending entries with it, and an entry dropped so is never delivered again. Heartbeats
# older than the window go too. Returns the names removed.
_PRUNE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local gone_after_ms = tonumber(ARGV[2])
local most = tonumber(ARGV[4])
local removed = {}
redis.call('XGROUP', 'CREATECONSUMER', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[2], now_ms, ARGV[3])
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  if #removed >= most then break end
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  local name = info['name']
  if name ~= ARGV[3] and tonumber(info['pending']) == 0 and tonumber(info['idle']) >= gone_after_ms then
    local beat = redis.call('ZSCORE', KEYS[2], name)
    if not beat or now_ms - tonumber(beat) >= gone_after_ms then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
      removed[#removed + 1] = name
    end
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now_ms - gone_after_ms))
return removed
"""

# Requeue: only an entry still pending (XACK acknowledges it: 1) is dropped and put back as a new entry. One
# acknowledged meanwhile is done: putting it back would deliver a finished transaction again.
# KEYS: stream. ARGV: group, entry id, reference_id. Returns 1 when requeued.
_REQUEUE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[1], '*', 'ref', ARGV[3])
return 1
"""


def _pairs_to_dict(flat: Sequence[Any]) -> dict[str, str]:
    """HGETALL as returned from a Lua script: [field, value, field, value, ...]."""
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _from_hash(reference_id: str, fields: Any) -> Transaction | None:
    """A transaction from its hash as HGETALL returns it; None for an empty (missing) hash."""
    return decode_transaction(reference_id, text_map(fields)) if fields else None


class RedisTransactionStore:
    """TransactionStore and WorkQueue over one Redis client (decode_responses=True, see connect_redis)."""

    def __init__(
        self,
        redis: Redis,
        prefix: str = "fs:",
        *,
        group: str = "workers",
        finished_ttl_s: int | None = None,
        done_signal_ttl_s: int = 60,
        replicas: int = 0,
        replica_timeout_ms: int = 1000,
        archive_after_s: int = 0,
        idempotency_ttl_s: int = 0,
        webhooks: bool = True,
    ) -> None:
        """finished_ttl_s: expire final transactions after this long (None: keep them).
        done_signal_ttl_s: how long a completion signal outlives the completion, for slow waiters.
        replicas: create_and_enqueue returns only once this many replicas hold the new transaction (WAIT),
        else raises BackendUnavailable after replica_timeout_ms (see docs/scaling.md, "Redis with failover").
        archive_after_s: > 0: list final transactions for the result archiver (finished_before), which
        moves them out of Redis this long after they became final (pipelines/result_archive.py).
        idempotency_ttl_s: how long an Idempotency-Key is remembered after its create (0: as long as Redis
        keeps it); the wiring passes FACESEARCH_IDEMPOTENCY_KEY_TTL_S (24 h), so keys cannot fill Redis.
        webhooks: queue a completion event for tenants with a webhook (stores/redis_webhooks.py) in the
        script that makes a transaction final."""
        if replicas < 0 or replica_timeout_ms <= 0:
            raise ValueError("replicas must be >= 0 and replica_timeout_ms > 0")
        self._replicas = replicas
        self._replica_timeout_ms = replica_timeout_ms
        self._redis = redis
        self._prefix = prefix
        self._stream = f"{prefix}sys:tx-queue"
        self._counts = f"{prefix}sys:tx-counts"
        self._consumers = f"{prefix}sys:tx-consumers"
        self._group = group
        self._finished_ttl_s = finished_ttl_s or 0
        self._idempotency_ttl_s = idempotency_ttl_s
        self._archive_after_s = archive_after_s
        self._finished = f"{prefix}sys:tx-finished"
        self._webhook_keys = WebhookKeys(prefix) if webhooks else None
        # A completion signal never outlives its transaction.
        self._done_ttl_s = max(1, min(done_signal_ttl_s, self._finished_ttl_s or done_signal_ttl_s))
        self._group_ready = False
        # Blocking commands must return before the socket read times out, or redis-py would treat the
        # quiet connection as dead; long waits are made of several shorter blocking calls.
        socket_timeout = socket_timeout_of(redis)
        self._max_block_s = 2.0 if socket_timeout is None else max(0.05, min(2.0, socket_timeout - 1.0))
        self._create = redis.register_script(_CREATE)
        self._mark_processing = redis.register_script(_MARK_PROCESSING)
        self._finalize = redis.register_script(_FINALIZE)
        self._drop_archived = redis.register_script(_DROP_ARCHIVED)
        self._renew = redis.register_script(_RENEW)
        self._prune = redis.register_script(_PRUNE)
        self._requeue = redis.register_script(_REQUEUE)

    @property
    def redis(self) -> Redis:
        """The client, for other stores of the same process to share (a lease, say)."""
        return self._redis

    def _tx_key(self, reference_id: str) -> str:
        return f"{self._prefix}txn:{reference_id}"

    def _done_key(self, reference_id: str) -> str:
        return f"{self._prefix}txn-done:{reference_id}"

    # -- TransactionStore -------------------------------------------------------------------------------

    async def create_and_enqueue(self, tx: Transaction, claim: IdempotencyClaim | None = None) -> str:
        pairs: list[EncodableT] = [item for pair in encode_transaction(tx).items() for item in pair]
        keys = [self._tx_key(tx.reference_id), self._counts, self._stream]
        if claim is not None:
            keys.append(f"{self._prefix}idem:{claim.digest}")
        args = [tx.state.value, tx.reference_id, claim.fingerprint if claim else "", self._idempotency_ttl_s]
        acknowledged = 0
        async with redis_errors():
            if self._replicas == 0:
                answer = await self._create(keys=keys, args=[*args, *pairs])
            else:
                async with self._redis.client() as connection:  # one connection: the script, then WAIT
                    answer = await self._create(keys=keys, args=[*args, *pairs], client=connection)
                    if int(answer[0]) != 2:
                        acknowledged = int(await connection.wait(self._replicas, self._replica_timeout_ms))
        if int(answer[0]) == 2:
            raise IdempotencyConflict(
                "The Idempotency-Key was already used for a different request.",
                {"Idempotency-Key": "used for a different request"},
            )
        if acknowledged < self._replicas:
            # Written on the master but not yet on a replica: a failover now could lose it, so the client
            # is not given a reference_id. It may still be processed: a retry with the same
            # Idempotency-Key gets this transaction once it is safe, one without a key makes a new one.
            raise NotReplicated(
                f"Redis: the transaction reached {acknowledged} of {self._replicas} replica(s) within "
                f"{self._replica_timeout_ms} ms",
                text(answer[1]),
            )
        return text(answer[1])

    async def get(self, reference_id: str) -> Transaction | None:
        if not is_reference_id(reference_id):
            return None  # never issued, so never stored
        async with redis_errors():
            fields = await self._redis.hgetall(self._tx_key(reference_id))
        return _from_hash(reference_id, fields)

    async def mark_processing(self, reference_id: str) -> Transaction | None:
        async with redis_errors():
            flat = await self._mark_processing(
                keys=[self._tx_key(reference_id), self._counts], args=[repr(time.time())]
            )
        return decode_transaction(reference_id, _pairs_to_dict(flat)) if flat else None

    async def complete(self, reference_id: str, result: Outcome) -> bool:
        return await self._finish(reference_id, TransactionState.COMPLETED, outcome_fields(result))

    async def fail(self, reference_id: str, error: str) -> None:
        await self._finish(reference_id, TransactionState.FAILED, {"error": error})

    async def _finish(self, reference_id: str, state: TransactionState, fields: Mapping[str, str]) -> bool:
        pairs = [item for pair in fields.items() for item in pair]
        async with redis_errors():
            changed = await self._finalize(
                keys=[
                    self._tx_key(reference_id),
                    self._counts,
                    self._done_key(reference_id),
                    self._finished,
                ],
                args=[
                    state.value,
                    repr(time.time()),
                    self._finished_ttl_s,
                    self._done_ttl_s,
                    reference_id if self._archive_after_s else "",
                    reference_id,
                    *(
                        self._webhook_keys.completion_args(reference_id)
                        if self._webhook_keys is not None
                        else WebhookKeys.NO_COMPLETION_EVENT
                    ),
                    *pairs,
                ],
            )
        if not changed:
            logger.info("transaction %s is unknown or already final; %s ignored", reference_id, state.value)
        return bool(changed)

    async def finished_before(self, age_s: float, limit: int) -> list[FinishedEntry]:
        """Up to `limit` transactions that became final more than age_s ago (by Redis' clock), oldest
        first, with their stored state (None once expired). Only those finished while archiving was on
        (archive_after_s) are listed."""
        async with redis_errors():
            seconds, micros = await self._redis.time()
            cutoff_ms = int((seconds + micros / 1e6 - age_s) * 1000)
            if cutoff_ms <= 0:
                return []
            page: Any = await self._redis.xrange(self._finished, "-", f"{cutoff_ms}", count=limit)
            entries = [
                (text(entry_id), text(fields["ref"])) for entry_id, fields in page or [] if "ref" in fields
            ]
            async with self._redis.pipeline(transaction=False) as pipe:
                for _entry_id, reference_id in entries:
                    pipe.hgetall(self._tx_key(reference_id))
                hashes = await pipe.execute() if entries else []
        return [
            FinishedEntry(entry_id, reference_id, _from_hash(reference_id, raw))
            for (entry_id, reference_id), raw in zip(entries, hashes, strict=True)
        ]

    async def drop_archived(self, entries: Sequence[FinishedEntry]) -> int:
        """Delete the Redis copy of transactions whose archived copy is written, and their entries in the
        finished stream; returns how many copies were deleted."""
        if not entries:
            return 0
        keys = [self._finished, *(self._tx_key(entry.reference_id) for entry in entries)]
        async with redis_errors():
            return int(await self._drop_archived(keys=keys, args=[entry.entry_id for entry in entries]))

    async def wait_final(
        self, reference_id: str, timeout_s: float, *, seen_pending: bool = False
    ) -> Transaction | None:
        """Blocks on the completion signal list, so it returns within a round trip of the completion.

        BLMOVE from the list onto itself takes the signal and puts it back in one atomic step, so every
        other waiter on the same transaction sees it too. The state is read before blocking, unless the
        caller has just read it (seen_pending); a completion in between leaves the signal in the list, so
        the wait returns at once (no lost wake-up)."""
        if not seen_pending:
            tx = await self.get(reference_id)
            if tx is None or tx.state.is_final or timeout_s <= 0:
                return tx
        deadline = time.monotonic() + timeout_s
        done_key = self._done_key(reference_id)
        fields: Any = None
        async with redis_errors():
            while (remaining := deadline - time.monotonic()) > 0:
                # Fractional seconds, which Redis accepts since 6.0 (redis-py's hint says int).
                block_s: Any = max(0.01, min(remaining, self._max_block_s))
                # One round trip for the wait and the read: Redis runs a client's pipelined commands in
                # order, so the HGETALL waits for the BLMOVE to return, and then reads the final state.
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.blmove(done_key, done_key, block_s, "LEFT", "RIGHT")
                    pipe.hgetall(self._tx_key(reference_id))
                    signal, fields = await pipe.execute()
                if signal is not None:
                    break
        if fields is None:
            return await self.get(reference_id)  # no time left to wait at all
        return _from_hash(reference_id, fields)

    async def image_keys_in_flight(self) -> set[str]:
        """Blob keys of the uploads of transactions still on the queue: reconciliation keeps them."""
        found: set[str] = set()
        start = "-"
        async with redis_errors():
            while True:
                page: list[Any] = await self._redis.xrange(self._stream, min=start, max="+", count=1000) or []
                references = [text(fields["ref"]) for _entry_id, fields in page if fields and "ref" in fields]
                async with self._redis.pipeline(transaction=False) as pipe:
                    for reference_id in references:
                        pipe.hmget(self._tx_key(reference_id), ["tenant_id", "image_key"])
                    values = await pipe.execute() if references else []
                for reference_id, (tenant_id, image_key) in zip(references, values, strict=True):
                    if image_key is not None:
                        found.add(text(image_key))
                    elif tenant_id is not None:  # the usual upload key, left out of the hash
                        found.add(upload_key(text(tenant_id), reference_id))
                if len(page) < 1000:
                    return found
                start = f"({text(page[-1][0])}"  # exclusive: the next page starts after the last entry

    async def count_by_state(self) -> dict[str, int]:
        """Counters kept by every state change. With finished_ttl_s set, expired final transactions stay
        counted (the counts are totals of what reached each state, not a scan)."""
        async with redis_errors():
            raw = await self._redis.hgetall(self._counts)
        counts = {state.value: 0 for state in TransactionState}
        counts.update({state: int(value) for state, value in text_map(raw).items()})
        return counts

    # -- WorkQueue --------------------------------------------------------------------------------------

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            # From id 0, not $: entries added before the group existed are delivered too.
            await self._redis.xgroup_create(self._stream, self._group, id="0", mkstream=True)
        except redis_exceptions.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    async def claim(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        deadline = time.monotonic() + block_ms / 1000
        async with redis_errors():
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                block = min(remaining_ms, int(self._max_block_s * 1000))
                # BLOCK 0 would mean "forever": no wait left means a non-blocking read.
                response = await self._read_group(consumer, count, block if block > 0 else None)
                entries = [
                    QueueEntry(entry_id=entry_id, reference_id=fields["ref"], deliveries=1)
                    for _stream, messages in response or []
                    for entry_id, fields in messages
                    if fields and "ref" in fields
                ]
                if entries or block <= 0 or time.monotonic() >= deadline:
                    return entries

    async def _read_group(self, consumer: str, count: int, block_ms: int | None) -> Any:
        await self._ensure_group()
        try:
            return await self._redis.xreadgroup(
                self._group, consumer, {self._stream: ">"}, count=count, block=block_ms
            )
        except redis_exceptions.ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            # The stream or group vanished (e.g. Redis lost its data): recreate and read again.
            self._group_ready = False
            await self._ensure_group()
            return await self._redis.xreadgroup(
                self._group, consumer, {self._stream: ">"}, count=count, block=block_ms
            )

    async def reclaim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[QueueEntry]:
        claimed: list[tuple[str, dict[str, str]]] = []
        async with redis_errors():
            await self._ensure_group()
            cursor = "0-0"
            # XAUTOCLAIM scans a bounded part of the pending list per call; a few calls cover a long one.
            for _ in range(10):
                try:
                    response = await self._redis.xautoclaim(
                        self._stream, self._group, consumer, min_idle_ms, start_id=cursor,
                        count=count - len(claimed),
                    )  # fmt: skip
                except redis_exceptions.ResponseError as error:
                    if "NOGROUP" not in str(error):
                        raise
                    self._group_ready = False
                    return []
                cursor = response[0]
                for entry_id, fields in response[1]:
                    if entry_id is None or not fields:
                        # Redis 6.2 returns entries deleted from the stream as nil; ours are never
                        # deleted before being acknowledged, so there is nothing to hand out.
                        logger.warning("reclaimed a pending entry that no longer exists in %s", self._stream)
                        continue
                    claimed.append((entry_id, fields))
                if cursor in ("0-0", "0") or len(claimed) >= count:
                    break
            if not claimed:
                return []
            # The delivery count (already incremented by the claim) is what lets a worker give up on a
            # poison message; XAUTOCLAIM does not return it, XPENDING does.
            async with self._redis.pipeline(transaction=False) as pipe:
                for entry_id, _fields in claimed:
                    pipe.xpending_range(self._stream, self._group, min=entry_id, max=entry_id, count=1)
                pending = await pipe.execute()
        deliveries = {info["message_id"]: int(info["times_delivered"]) for rows in pending for info in rows}
        return [
            QueueEntry(entry_id=entry_id, reference_id=fields["ref"], deliveries=deliveries.get(entry_id, 1))
            for entry_id, fields in claimed
            if "ref" in fields
        ]

    async def renew(self, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        if not entry_ids:
            return []
        async with redis_errors():
            await self._ensure_group()
            held = await self._renew(keys=[self._stream], args=[self._group, consumer, *entry_ids])
        return [text(entry_id) for entry_id in held or []]

    async def prune_consumers(self, consumer: str, gone_after_ms: int, limit: int = 1000) -> list[str]:
        """limit: the most consumers one call removes (a group that grew for long, before pruning existed,
        is worked off over several calls, each a short script)."""
        if gone_after_ms <= 0 or limit <= 0:
            raise ValueError("gone_after_ms and limit must be positive")
        async with redis_errors():
            await self._ensure_group()
            try:
                removed = await self._prune(
                    keys=[self._stream, self._consumers], args=[self._group, gone_after_ms, consumer, limit]
                )
            except redis_exceptions.ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                self._group_ready = False  # the stream or group vanished: recreated by the next call
                return []
        return [text(name) for name in removed or []]

    async def ack(self, entry_ids: Sequence[str]) -> None:
        if not entry_ids:
            return
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self._stream, self._group, *entry_ids)
            pipe.xdel(self._stream, *entry_ids)
            await pipe.execute()

    async def requeue(self, entry: QueueEntry) -> None:
        async with redis_errors():
            await self._ensure_group()
            await self._requeue(keys=[self._stream], args=[self._group, entry.entry_id, entry.reference_id])

    async def depth(self) -> int:
        """Entries not yet acknowledged: acknowledged ones are deleted, so this is the stream length."""
        async with redis_errors():
            return int(await self._redis.xlen(self._stream))
