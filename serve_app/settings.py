"""Service configuration, read once from the environment by each process that needs it.

Every deployment builds its own Settings in its constructor (no module-level singletons); the launcher and
the Serve config pass the same environment to all of them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


def _env_networks(name: str) -> tuple[str, ...]:
    """Comma-separated CIDRs (or single addresses), normalised; a malformed one stops start-up."""
    networks = []
    for item in (os.environ.get(name) or "").split(","):
        if item.strip():
            try:
                networks.append(str(ipaddress.ip_network(item.strip(), strict=False)))
            except ValueError:
                raise RuntimeError(f"{name}: {item.strip()!r} is not an IP address or CIDR") from None
    return tuple(networks)


def _env_numbers(name: str) -> dict[str, int | float]:
    """A JSON object of numbers, e.g. {"nprobe": 48}; anything else stops start-up."""
    raw = os.environ.get(name) or "{}"
    try:
        value = json.loads(raw)
    except ValueError:
        raise RuntimeError(f"{name}: not JSON: {raw!r}") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        raise RuntimeError(f"{name}: expected a JSON object of numbers, got {raw!r}")
    return {str(key): number for key, number in value.items()}


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    redis_url: str | None  # None: the launcher starts an embedded redis-server
    milvus_uri: str | None  # None: the launcher starts an embedded milvus-lite server
    milvus_token: str
    secret_key: str  # signs access and proof tokens; peppers client-secret hashes
    production: bool
    public_base_url: str | None  # base of proof URLs; None: taken from each request
    access_token_ttl_s: int = 900
    proof_ttl_s: int = 900  # the interface fixes proof URLs at 15 minutes
    max_upload_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    analysis_max_side: int = 1920  # larger images are downscaled before detection
    wait_for_result_timeout_s: float = 10.0
    login_failures_per_window: int = 10  # per (client_id, source): attempts before the back-off starts
    login_window_s: int = 300  # failed attempts are forgotten this long after the last one
    login_backoff_max_s: int = 900  # the doubling wait between attempts stops growing here
    unauthenticated_per_minute: int = 300  # per source: logins and requests whose credentials fail
    trusted_proxies: tuple[str, ...] = ()  # CIDRs whose X-Forwarded-For is believed
    requests_per_minute: int = 6000  # per client (tenant)
    max_matches: int = 10
    # None: calibrated per tenant for its gallery size (models.calibration.min_score_for_gallery).
    match_min_score: float | None = None
    worker_concurrency: int = 32  # transactions in flight per worker replica
    stale_after_s: float = 30.0  # a claimed transaction unacknowledged this long is reclaimed
    max_deliveries: int = 5  # after this many attempts a transaction is failed, not retried forever
    model_call_timeout_s: float = 10.0  # one analysis call; a hung model call must not pin a worker slot
    transaction_retention_s: int = 30 * 24 * 3600  # final transactions expire after this; 0 keeps them
    orphan_upload_grace_s: int = 3600  # unreferenced blobs older than this are swept by reconciliation
    # Replicas that must hold a new transaction before its reference_id is returned (Redis WAIT), and how
    # long to wait for them; None: 1 with a redis+sentinel:// URL (a replica exists), else 0.
    redis_wait_replicas: int | None = None
    redis_wait_timeout_ms: int = 1000
    # Milvus index policy: exact FLAT search up to this many vectors per collection, then the large index.
    milvus_flat_max_rows: int = 200_000
    milvus_large_index: str = ""  # IVF_FLAT or HNSW; "": HNSW on a Milvus server, FLAT kept on milvus-lite
    milvus_index_params: dict[str, int | float] = field(default_factory=dict)  # e.g. {"nlist": 2048}
    milvus_search_params: dict[str, int | float] = field(default_factory=dict)  # e.g. {"nprobe": 48}
    key_prefix: str = "fs:"
    blob_dir: Path = field(default_factory=lambda: Path("var/blobs"))

    @classmethod
    def from_env(cls) -> Settings:
        data_dir = Path(os.environ.get("FACESEARCH_DATA_DIR", "var")).resolve()
        production = os.environ.get("FACESEARCH_ENV", "development").lower() == "production"
        secret_key = os.environ.get("FACESEARCH_SECRET_KEY") or ""
        if not secret_key:
            if production:
                raise RuntimeError("FACESEARCH_SECRET_KEY must be set when FACESEARCH_ENV=production")
            secret_key = _development_secret(data_dir)
        return cls(
            data_dir=data_dir,
            redis_url=os.environ.get("REDIS_URL") or None,
            milvus_uri=os.environ.get("MILVUS_URI") or None,
            milvus_token=os.environ.get("MILVUS_TOKEN", ""),
            secret_key=secret_key,
            production=production,
            public_base_url=(os.environ.get("FACESEARCH_PUBLIC_BASE_URL") or "").rstrip("/") or None,
            access_token_ttl_s=_env_int("FACESEARCH_ACCESS_TOKEN_TTL_S", 900),
            proof_ttl_s=_env_int("FACESEARCH_PROOF_TTL_S", 900),
            max_upload_bytes=_env_int("FACESEARCH_MAX_UPLOAD_BYTES", 10 * 1024 * 1024),
            max_image_pixels=_env_int("FACESEARCH_MAX_IMAGE_PIXELS", 40_000_000),
            analysis_max_side=_env_int("FACESEARCH_ANALYSIS_MAX_SIDE", 1920),
            wait_for_result_timeout_s=_env_float("FACESEARCH_WAIT_FOR_RESULT_TIMEOUT_S", 10.0),
            login_failures_per_window=_env_int("FACESEARCH_LOGIN_FAILURES_PER_WINDOW", 10),
            login_window_s=_env_int("FACESEARCH_LOGIN_WINDOW_S", 300),
            login_backoff_max_s=_env_int("FACESEARCH_LOGIN_BACKOFF_MAX_S", 900),
            unauthenticated_per_minute=_env_int("FACESEARCH_UNAUTHENTICATED_PER_MINUTE", 300),
            trusted_proxies=_env_networks("FACESEARCH_TRUSTED_PROXIES"),
            requests_per_minute=_env_int("FACESEARCH_REQUESTS_PER_MINUTE", 6000),
            max_matches=_env_int("FACESEARCH_MAX_MATCHES", 10),
            match_min_score=(
                _env_float("FACESEARCH_MATCH_MIN_SCORE", 0.5)
                if os.environ.get("FACESEARCH_MATCH_MIN_SCORE")
                else None
            ),
            worker_concurrency=_env_int("FACESEARCH_WORKER_CONCURRENCY", 32),
            stale_after_s=_env_float("FACESEARCH_STALE_AFTER_S", 30.0),
            max_deliveries=_env_int("FACESEARCH_MAX_DELIVERIES", 5),
            transaction_retention_s=_env_int(
                "FACESEARCH_TRANSACTION_RETENTION_S", cls.transaction_retention_s
            ),
            orphan_upload_grace_s=_env_int("FACESEARCH_ORPHAN_UPLOAD_GRACE_S", cls.orphan_upload_grace_s),
            model_call_timeout_s=_env_float("FACESEARCH_MODEL_CALL_TIMEOUT_S", cls.model_call_timeout_s),
            redis_wait_replicas=(
                _env_int("FACESEARCH_REDIS_WAIT_REPLICAS", 0)
                if os.environ.get("FACESEARCH_REDIS_WAIT_REPLICAS")
                else None
            ),
            redis_wait_timeout_ms=_env_int("FACESEARCH_REDIS_WAIT_TIMEOUT_MS", cls.redis_wait_timeout_ms),
            milvus_flat_max_rows=_env_int("FACESEARCH_MILVUS_FLAT_MAX_ROWS", cls.milvus_flat_max_rows),
            milvus_large_index=os.environ.get("FACESEARCH_MILVUS_LARGE_INDEX", "").upper(),
            milvus_index_params=_env_numbers("FACESEARCH_MILVUS_INDEX_PARAMS"),
            milvus_search_params=_env_numbers("FACESEARCH_MILVUS_SEARCH_PARAMS"),
            key_prefix=os.environ.get("FACESEARCH_KEY_PREFIX", "fs:"),
            blob_dir=Path(os.environ.get("FACESEARCH_BLOB_DIR") or data_dir / "blobs"),
        )


def wait_replicas(settings: Settings) -> int:
    """Replicas a new transaction must reach (see Settings.redis_wait_replicas)."""
    if settings.redis_wait_replicas is not None:
        return settings.redis_wait_replicas
    scheme = (settings.redis_url or "").split("://", 1)[0]
    return 1 if scheme.endswith("+sentinel") else 0


def _development_secret(data_dir: Path) -> str:
    """Outside production, generate a signing key once and keep it in the data dir (mode 0600), so tokens
    and proof URLs stay valid across restarts without anyone configuring a secret."""
    path = data_dir / "secret_key"
    if path.is_file():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(48)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key
