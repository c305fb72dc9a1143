"""Service configuration: one pydantic-settings model, read from the environment by each process that
needs it.

Every operational knob is a field below, in a group; its default is written here once and its environment
variable is derived from the group's prefix (or named by an alias where an older name must keep working).
The configuration table in docs/configuration.md is generated from these fields
(`python -m serve_app.settings`), and a unit test keeps the two equal.

Every deployment builds its own Settings in its constructor, from its replica's environment (no
module-level singletons, and never a bind argument: Ray would keep the signing key in its stored state).
The launcher exports the embedded servers' addresses before it starts Ray, so all replicas inherit them.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import sys
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, SecretStr, StrictFloat, StrictInt, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from serve_app.domain.keys import KeyRing

# Bounds shared by the service-wide setting and the per-tenant override (`facesearch clients update`).
MinScore = Annotated[float, Field(ge=0.0, le=1.0)]
MaxMatches = Annotated[int, Field(ge=1, le=100)]


class _Group(BaseSettings):
    # Empty variables mean "unset", as they always did; the names are the public contract
    # (docs/configuration.md). Each group says only its prefix; the rest is inherited.
    model_config = SettingsConfigDict(
        env_prefix="FACESEARCH_", env_ignore_empty=True, extra="forbid", frozen=True, populate_by_name=True
    )


class RedisSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_REDIS_")

    url: str | None = Field(
        None,
        validation_alias="REDIS_URL",
        description="a real server, with its credentials: `redis://:password@redis:6379/0`, with an ACL "
        "user `redis://user:password@redis:6379/0`, over TLS `rediss://user:password@redis:6380/0`; "
        "the master of a Sentinel group, followed across failovers: "
        "`redis+sentinel://:password@s1:26379,s2:26379,s3:26379/service_name[/db]` (TLS to the master: "
        '`rediss+sentinel://`; sentinels with a password: `?sentinel_password=...`; see "Redis with '
        'failover"); unset: embedded redis-server on 127.0.0.1 with a generated password '
        "(`facesearch start`)",
    )
    # Every wait_for_result waiter holds a connection (BLPOP): well above the ingress' max_ongoing_requests.
    pool_size: int = Field(1024, ge=1, description="connections per process (each long poll holds one)")
    key_prefix: str = Field("fs:", validation_alias="FACESEARCH_KEY_PREFIX", description="Redis key prefix")
    wait_replicas: int | None = Field(
        None,
        ge=0,
        description="replicas that must hold a new transaction before its reference_id is returned (Redis "
        "`WAIT`); unset: 1 with a `redis+sentinel://` URL (a replica exists), else 0",
    )
    wait_timeout_ms: int = Field(
        1000, ge=1, description="how long a create waits for those replicas before answering 503"
    )
    # The lock of a face's client_reference (pipelines/lifecycle.py), taken by enrolments, removals,
    # re-indexing and reconciliation's repairs.
    lock_wait_s: float = Field(
        30.0,
        gt=0,
        description="waiting for a client_reference's lock gives up after this: 503 to an API caller, a "
        "failed attempt to a worker (a transaction whose attempts all time out ends `failed`)",
    )
    lock_ttl_s: float = Field(
        10.0,
        gt=0,
        description="a client_reference's lock lapses this long after its holder last renewed it (it renews "
        "every third of this while it works)",
    )
    lock_max_hold_s: float = Field(
        300.0,
        gt=0,
        description="a holder stops renewing a client_reference's lock after this, so one stuck while alive "
        "cannot block the reference for ever",
    )


class MilvusSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_MILVUS_")

    uri: str | None = Field(
        None,
        validation_alias="MILVUS_URI",
        description="e.g. `http://milvus:19530`; unset: embedded milvus-lite server on 127.0.0.1 "
        "(`facesearch start`)",
    )
    token: str = Field("", validation_alias="MILVUS_TOKEN", description="Milvus credentials")
    timeout_s: float = Field(10.0, gt=0, description="deadline of one Milvus call")
    flat_max_rows: int = Field(
        200_000,
        ge=0,
        description="exact (FLAT) search up to this many vectors per collection; the insert that crosses "
        'it switches the collection to the large index (see "Milvus at scale")',
    )
    large_index: str = Field(
        "",
        description="`IVF_FLAT`, `IVF_SQ8` or `HNSW` on a Milvus server; unset: IVF_FLAT (it kept the most "
        "matches, docs/scaling.md). milvus-lite keeps FLAT whatever this says",
    )
    # JSON objects of numbers in the environment; strict, so a quoted number or a boolean stops start-up.
    index_params: dict[str, StrictInt | StrictFloat] = Field(
        default_factory=dict,
        description="JSON, overrides the large index's build parameters key by key; defaults: IVF_FLAT "
        '`{"nlist": 1024}`, HNSW `{"M": 16, "efConstruction": 200}`',
    )
    search_params: dict[str, StrictInt | StrictFloat] = Field(
        default_factory=dict,
        description="JSON, search parameters of the large index (`nprobe` for IVF_FLAT / IVF_SQ8, `ef` for "
        "HNSW); "
        'defaults: `{"nprobe": 64, "ef": 128}`',
    )
    consistency_level: Literal["Tenant", "Strong", "Bounded", "Session", "Eventually"] = Field(
        "Tenant",
        description="of searches: `Tenant` makes a face searchable as soon as its enrolment is answered, "
        "and a search waits only for its own tenant's last write (its Milvus timestamp, kept in Redis), "
        "which is visible already unless it was a moment ago; `Strong` waits for every write (a Milvus "
        "server adds up to one time tick, ~200 ms, to every search); `Bounded` waits for none and a new "
        'face becomes searchable within the server\'s gracefulTime (5 s by default); see "Milvus at scale"',
    )
    index_switch_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="bound on copying the rows into the collection built beside the served one and "
        "building its large index at the switch; one replica at a time switches, under a Redis lease, "
        "while the served collection goes on serving",
    )

    @field_validator("large_index")
    @classmethod
    def _upper(cls, value: str) -> str:
        return value.upper()


class AuthSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    secret_keys: SecretStr = Field(
        SecretStr(""),
        description="the key ring: comma-separated `<kid>:<secret>` entries (kid: 1-32 of `A-Za-z0-9._-`, "
        "secret: at least 16 characters), the current key first; it signs tokens and proof URLs and hashes "
        "client secrets and audit subjects (a key per purpose is derived from it), the others only verify "
        "(a rotation's grace, docs/security.md); unset: `FACESEARCH_SECRET_KEY` as the one key, kid `0`",
    )
    secret_key: SecretStr = Field(
        SecretStr(""),
        description="the single key of a ring of one (kid `0`), when `FACESEARCH_SECRET_KEYS` is unset; "
        "both unset: generated once into the data dir (development only)",
    )
    access_token_ttl_s: int = Field(900, ge=1, description="access-token lifetime")
    proof_ttl_s: int = Field(900, ge=1, description="proof-URL lifetime (the interface says 15 minutes)")
    login_failures_per_window: int = Field(
        10, ge=1, description="login attempts per (client_id, source) before the back-off starts"
    )
    login_window_s: int = Field(
        300, ge=1, description="seconds without an attempt after which failed logins are forgotten"
    )
    login_backoff_max_s: int = Field(
        900, ge=1, description="the longest wait between login attempts (the wait doubles from 1 s)"
    )
    verified_token_cache: int = Field(
        10_000,
        ge=0,
        description="access tokens each ingress replica remembers as verified until they expire (0: check "
        "every signature); revocation is still checked on every request",
    )

    def key_ring(self) -> KeyRing:
        """The key ring (serve_app/domain/keys.py): FACESEARCH_SECRET_KEYS, else FACESEARCH_SECRET_KEY."""
        ring = _revealed(self.secret_keys)
        return KeyRing.parse(ring) if ring else KeyRing.single(_revealed(self.secret_key))

    @property
    def has_key(self) -> bool:
        return bool(_revealed(self.secret_keys) or _revealed(self.secret_key))


def _revealed(value: SecretStr | str) -> str:
    # from_env puts the development secret in as a plain str (model_copy does not validate).
    return value.get_secret_value() if isinstance(value, SecretStr) else value


class LimitSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1, description="request body limit (413)")
    max_image_pixels: int = Field(40_000_000, ge=1, description="decoded image limit (413)")
    requests_per_minute: int = Field(6000, ge=1, description="per client")
    unauthenticated_per_minute: int = Field(
        300, ge=1, description="per source address: logins and requests whose credentials or proof URL fail"
    )
    wait_for_result_timeout_s: float = Field(
        10.0, gt=0, description="bound of `wait_for_result=1` and of `Prefer: wait`"
    )


class HttpSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    public_base_url: str | None = Field(
        None, description="base of proof URLs behind a proxy; unset: taken from each request"
    )
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="comma-separated CIDRs of reverse proxies whose `X-Forwarded-For` is believed, "
        "e.g. `10.0.0.0/8,192.168.1.5`",
    )

    @field_validator("public_base_url")
    @classmethod
    def _strip_slash(cls, value: str | None) -> str | None:
        return value.rstrip("/") or None if value else None

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _networks(cls, value: object) -> tuple[str, ...]:
        """Comma-separated CIDRs (or single addresses), normalised; a malformed one stops start-up."""
        items = value.split(",") if isinstance(value, str) else list(value)  # type: ignore[call-overload]
        networks = []
        for item in (str(entry).strip() for entry in items):
            if item:
                try:
                    networks.append(str(ipaddress.ip_network(item, strict=False)))
                except ValueError:
                    raise ValueError(f"{item!r} is not an IP address or CIDR") from None
        return tuple(networks)


class SearchSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    max_matches: MaxMatches = Field(
        10, description="matches returned; a tenant's `--max-matches` comes first"
    )
    match_min_score: MinScore | None = Field(
        None,
        description="minimum match score; unset: calibrated per tenant for its gallery size (FPIR ≤ 1 %); "
        "a tenant's `--min-score` comes first, then the service-wide one set at run time (`facesearch "
        "calibrate --apply default`, `facesearch clients update default`; docs/models.md)",
    )


class ModelSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    analysis_max_side: int = Field(1920, ge=64, description="larger images are downscaled before detection")
    model_call_timeout_s: float = Field(
        10.0, gt=0, description="deadline of one model (analysis) call; a call past it is a failed attempt"
    )
    age_minor_cleared_rate: float = Field(
        0.005,
        gt=0,
        lt=1,
        description="share of people under 18 (under 21) whose under_18 (under_21) may be 0: the age "
        "interval's calibrated error rate; the shipped calibration (models/age_interval.json, 343 people "
        "under 18) supports rates from 0.003 (docs/age.md)",
    )
    # A recognition model the operator brings (models.face_model.OperatorFaceModel). Every process reads it
    # here: the ingress and the stores name the gallery's collection after its version, the worker loads it.
    face_model_path: Path | None = Field(
        None,
        description="an ArcFace-format ONNX recognition model to serve instead of face model v2 (absolute "
        "path; 112x112 RGB input normalised as (x − 127.5) / 127.5, embedding output); its vectors are a "
        "gallery version of their own (`facesearch reindex`); unset: face model v2 (docs/models.md)",
    )
    face_model_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="the sha256 of `FACESEARCH_FACE_MODEL_PATH` (`facesearch models inspect PATH` prints "
        "it); a file with another hash stops the worker's start",
    )
    face_model_dim: int = Field(
        512, ge=1, description="the embedding size of `FACESEARCH_FACE_MODEL_PATH` (checked when it loads)"
    )
    face_model_scores: Path | None = Field(
        None,
        description="the score table of `FACESEARCH_FACE_MODEL_PATH` (absolute path), written by "
        "`facesearch calibrate --write-scores`; required to serve it",
    )

    @model_validator(mode="after")
    def _face_model_declared_whole(self) -> ModelSettings:
        if (self.face_model_path is None) != (self.face_model_sha256 is None):
            raise ValueError("FACESEARCH_FACE_MODEL_PATH and FACESEARCH_FACE_MODEL_SHA256 go together")
        if self.face_model_scores is not None and self.face_model_path is None:
            raise ValueError("FACESEARCH_FACE_MODEL_SCORES is the table of FACESEARCH_FACE_MODEL_PATH, unset")
        for path in (self.face_model_path, self.face_model_scores):
            # Each process (Ray replicas included) would resolve a relative path from its own directory.
            if path is not None and not path.is_absolute():
                raise ValueError(f"the face model's files must be given by absolute paths, not {path}")
        return self


class WorkerSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_WORKER_")

    # The deployment's user_config may override the first three on running replicas.
    concurrency: int = Field(32, ge=1, description="transactions in flight per worker replica")
    stale_after_s: float = Field(
        30.0,
        gt=0,
        validation_alias="FACESEARCH_STALE_AFTER_S",
        description="a claimed transaction whose worker stopped renewing its lease is reclaimed after this",
    )
    max_deliveries: int = Field(
        5,
        ge=1,
        validation_alias="FACESEARCH_MAX_DELIVERIES",
        description="attempts before a transaction that keeps failing is marked `failed`",
    )
    reconcile_every_s: float = Field(
        600.0,
        gt=0,
        description="how often a reconciliation pass (Redis/Milvus drift, orphaned blobs) starts; one pass "
        "at a time across the cluster, whichever worker takes the lease",
    )
    reconcile_grace_s: float = Field(
        600.0,
        ge=0,
        description="a face must stay inconsistent (a vector without its record, or a record of a final "
        "transaction without its vector) this long, across two reads, before reconciliation repairs it",
    )
    reconcile_batch: int = Field(1000, ge=1, description="face ids reconciliation reads per batch")
    reconcile_lease_s: float = Field(
        120.0,
        gt=0,
        description="the reconciliation lease, renewed after every batch; a worker that dies holding it "
        "loses it after this and another resumes its pass",
    )
    metrics_every_s: float = Field(5.0, gt=0, description="how often each worker exports its queue gauges")
    score_metrics_tenants: int = Field(
        100,
        ge=0,
        description="tenants each worker replica labels its match-score metrics with, the first it serves; "
        'later ones share the label `tenant="_other"` (0: every tenant under `_all`), so the series stay '
        "bounded however many tenants there are (docs/operations.md)",
    )


class WebhookSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_WEBHOOK_")

    allowed_hosts: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="comma-separated host names or addresses a webhook may reach although they resolve to "
        "a loopback, private, link-local or otherwise internal address, and over plain http (every other "
        "host must resolve to public addresses only and use https; docs/security.md)",
    )
    connect_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a delivery's timeout for resolving the host's name, and for its TCP (and TLS) connect",
    )
    read_timeout_s: float = Field(10.0, gt=0, description="a delivery's wait for the receiver's answer")
    total_timeout_s: float = Field(15.0, gt=0, description="bound on one delivery attempt, all of it")
    max_response_bytes: int = Field(
        16 * 1024,
        ge=256,
        description="the longest status line and headers of a receiver's answer accepted (the body is never "
        "read); a longer head fails the attempt",
    )
    retry_base_s: float = Field(
        5.0, gt=0, description="bound of the first retry's delay; each retry doubles it (full jitter)"
    )
    retry_max_delay_s: float = Field(3600.0, gt=0, description="the longest wait between two attempts")
    give_up_after_s: float = Field(
        24 * 3600.0, gt=0, description="an event not delivered this long after it was queued is marked dead"
    )
    lease_s: float = Field(
        60.0,
        gt=0,
        description="a claimed event is due again this long after its claim if its worker died delivering "
        "it; must exceed total_timeout_s",
    )
    batch: int = Field(16, ge=1, description="events each worker replica attempts at once")
    secret_grace_s: float = Field(
        24 * 3600.0,
        ge=0,
        description="after a secret rotation the old secret signs beside the new one this long",
    )
    log_size: int = Field(100, ge=1, description="delivery attempts kept per client (the delivery log)")
    event_retention_s: int = Field(
        7 * 24 * 3600,
        ge=60,
        description="a delivered or dead event is kept this long (for redelivery), and an idle delivery log",
    )

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, value: object) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else list(value)  # type: ignore[call-overload]
        return tuple(str(item).strip().rstrip(".").lower().strip("[]") for item in items if str(item).strip())

    @model_validator(mode="after")
    def _lease_outlasts_attempt(self) -> WebhookSettings:
        if self.lease_s <= self.total_timeout_s:
            raise ValueError("FACESEARCH_WEBHOOK_LEASE_S must exceed FACESEARCH_WEBHOOK_TOTAL_TIMEOUT_S")
        return self


class RetentionSettings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    transaction_retention_s: int = Field(
        30 * 24 * 3600,
        ge=0,
        description="finished transactions expire this long after they became final (`/result` then "
        "answers 422 as for an unknown id); 0 keeps them",
    )
    result_hot_window_s: int = Field(
        24 * 3600,
        ge=0,
        description="finished transactions stay in Redis this long, then move to the result archive "
        "(`FACESEARCH_RESULTS_DIR`), where `/result` finds them until the retention ends; 0 keeps them in "
        "Redis for the whole retention",
    )
    result_archive_every_s: float = Field(
        60.0, gt=0, description="how often one worker (holding a lease) moves results past the hot window"
    )
    done_signal_ttl_s: int = Field(
        60, ge=1, description="how long a transaction's completion signal outlives it, for slow waiters"
    )
    idempotency_key_ttl_s: int = Field(
        24 * 3600,
        ge=1,
        description="how long an `Idempotency-Key` is remembered after its create: a retry within it "
        "answers the first request's reference_id, a key sent again later creates a new transaction. "
        "Bounded on purpose: every keyed create leaves about 270 bytes in Redis for this long",
    )
    audit_retention_s: int = Field(
        365 * 24 * 3600,
        ge=0,
        description="entries of a tenant's gallery audit trail (deletions and erasures) are kept this long; "
        "0 keeps them for ever, which lets the trail grow with every deletion request",
    )
    orphan_upload_grace_s: int = Field(
        3600,
        ge=0,
        description="blobs that no queued transaction and no face record refers to are deleted by "
        "reconciliation once this old",
    )

    @property
    def archive_after_s(self) -> int:
        """The hot window when results are archived at all (0: they stay in Redis until they expire)."""
        hot = self.result_hot_window_s
        keeps_longer = self.transaction_retention_s == 0 or hot < self.transaction_retention_s
        return hot if hot and keeps_longer else 0

    @property
    def erasure_memory_s(self) -> int | None:
        """How long an erasure's tombstone is kept: as long as a result could still name the reference
        (the retention, plus a day for transactions still queued at the erasure); None: for ever."""
        return self.transaction_retention_s + 24 * 3600 if self.transaction_retention_s else None


class Settings(_Group):
    model_config = SettingsConfigDict(env_prefix="FACESEARCH_")

    data_dir: Path = Field(
        default_factory=lambda: default_data_dir(),
        description="embedded Redis/Milvus data, blobs, development secret: the same from any working "
        "directory, so the service and every `facesearch` command find one another",
        json_schema_extra={"shown_default": "`$XDG_DATA_HOME/facesearch`, else `~/.local/share/facesearch`"},
    )
    blob_dir: Path | None = Field(
        None, description="proof images (a shared volume on a cluster); unset: `$FACESEARCH_DATA_DIR/blobs`"
    )
    results_dir: Path | None = Field(
        None,
        description="results archived after their hot window (a shared volume on a cluster); unset: "
        "`$FACESEARCH_DATA_DIR/results`",
    )
    env: str = Field(
        "development", description="`production` requires `FACESEARCH_SECRET_KEYS` or `FACESEARCH_SECRET_KEY`"
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    milvus: MilvusSettings = Field(default_factory=MilvusSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    search: SearchSettings = Field(default_factory=SearchSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)

    # Read by models.weights and model_build (models/ knows nothing of this service); in the config table.
    EXTERNAL_VARIABLES: ClassVar[dict[str, tuple[str, str]]] = {
        "FACESEARCH_MODELS_DIR": (
            "`~/.cache/facesearch/models`",
            "converted ONNX models, and the age model's verified npm files (`npm/`)",
        ),
    }

    @property
    def production(self) -> bool:
        return self.env.lower() == "production"

    @property
    def blobs(self) -> Path:
        return self.blob_dir or self.data_dir / "blobs"

    @property
    def results(self) -> Path:
        return self.results_dir or self.data_dir / "results"

    @model_validator(mode="after")
    def _results_apart_from_blobs(self) -> Settings:
        """Reconciliation sweeps the blob directory of every file no upload or face names: an archived
        result inside it would be swept, and the blob store inside the archive would be expired."""
        blobs, results = self.blobs.resolve(), self.results.resolve()
        if blobs == results or blobs in results.parents or results in blobs.parents:
            raise ValueError("FACESEARCH_RESULTS_DIR and FACESEARCH_BLOB_DIR must not contain each other")
        return self

    @classmethod
    def from_env(cls) -> Settings:
        """Read the environment; resolve the data dir, and outside production the development secret."""
        settings = cls()
        data_dir = settings.data_dir.resolve()
        auth = settings.auth
        if not auth.has_key:
            if settings.production:
                raise RuntimeError(
                    "FACESEARCH_SECRET_KEYS or FACESEARCH_SECRET_KEY must be set when "
                    "FACESEARCH_ENV=production"
                )
            auth = auth.model_copy(update={"secret_key": _development_secret(data_dir)})
        return settings.model_copy(update={"data_dir": data_dir, "auth": auth})

    def backend_environment(self) -> dict[str, str]:
        """The environment variables naming these settings' Redis and Milvus: the launcher exports them
        before it starts Ray, so every replica reads the same servers from its own environment."""
        named: list[tuple[type[BaseSettings], str, str | None]] = [
            (RedisSettings, "url", self.redis.url),
            (MilvusSettings, "uri", self.milvus.uri),
        ]
        return {
            _variable(model, name, model.model_fields[name]): value for model, name, value in named if value
        }

    def with_backends(self, redis_url: str | None, milvus_uri: str | None) -> Settings:
        """These settings with the given backend addresses (those of started embedded servers)."""
        return self.model_copy(
            update={
                "redis": self.redis.model_copy(update={"url": redis_url}),
                "milvus": self.milvus.model_copy(update={"uri": milvus_uri}),
            }
        )


def default_data_dir() -> Path:
    """The per-user home of the service's state (XDG base directories): one place whatever the working
    directory, so `facesearch clients ...` run anywhere reaches the store `facesearch start` serves."""
    base = os.environ.get("XDG_DATA_HOME") or ""
    root = Path(base) if Path(base).is_absolute() else Path.home() / ".local" / "share"
    return root / "facesearch"


def wait_replicas(settings: Settings) -> int:
    """Replicas a new transaction must reach (see RedisSettings.wait_replicas)."""
    if settings.redis.wait_replicas is not None:
        return settings.redis.wait_replicas
    scheme = (settings.redis.url or "").split("://", 1)[0]
    return 1 if scheme.endswith("+sentinel") else 0


def development_secret_path(data_dir: Path) -> Path:
    return data_dir / "secret_key"


def _development_secret(data_dir: Path) -> str:
    """Outside production, generate a signing key once and keep it in the data dir (mode 0600), so tokens
    and proof URLs stay valid across restarts without anyone configuring a secret."""
    path = development_secret_path(data_dir)
    if path.is_file():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(48)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


# --- docs/configuration.md's table, generated from the fields above --------------------------------------


def _variable(model: type[BaseSettings], name: str, field: FieldInfo) -> str:
    # An alias is an environment name that predates the group's prefix (the field name still works as a
    # keyword argument: populate_by_name).
    if isinstance(field.validation_alias, str):
        return field.validation_alias
    return f"{model.model_config.get('env_prefix', '')}{name}".upper()


def _default(field: FieldInfo) -> str:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("shown_default"), str):
        return str(extra["shown_default"])  # a default that depends on the machine, said in words
    value = field.get_default(call_default_factory=True)  # an empty JSON object, not "PydanticUndefined"
    if value is None or value == {} or value == () or value == "" or value == SecretStr(""):
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def environment_variables() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting, in model order, then the external ones."""
    rows: list[tuple[str, str, str]] = []

    def walk(model: type[BaseSettings]) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseSettings):
                walk(annotation)
            else:
                rows.append((_variable(model, name, field), _default(field), field.description or ""))

    walk(Settings)
    rows.extend((name, default, meaning) for name, (default, meaning) in Settings.EXTERNAL_VARIABLES.items())
    return rows


def markdown_table() -> str:
    lines = ["| Variable | Default | Meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {default} | {meaning} |" for name, default, meaning in environment_variables()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
