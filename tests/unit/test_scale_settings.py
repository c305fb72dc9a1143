"""Settings of issue 12 (Milvus index policy, Redis replication wait): parsed from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.settings import Settings, wait_replicas
from serve_app.stores.milvus_gallery import IndexPolicy


def test_index_policy_settings_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    defaults = Settings.from_env()
    assert defaults.milvus.flat_max_rows == 200_000
    assert (defaults.milvus.large_index, defaults.milvus.index_params, defaults.milvus.search_params) == (
        "",
        {},
        {},
    )
    monkeypatch.setenv("FACESEARCH_MILVUS_FLAT_MAX_ROWS", "5000")
    monkeypatch.setenv("FACESEARCH_MILVUS_LARGE_INDEX", "hnsw")
    monkeypatch.setenv("FACESEARCH_MILVUS_INDEX_PARAMS", '{"M": 32, "efConstruction": 300}')
    monkeypatch.setenv("FACESEARCH_MILVUS_SEARCH_PARAMS", '{"ef": 256}')
    settings = Settings.from_env()
    assert settings.milvus.flat_max_rows == 5000
    assert settings.milvus.large_index == "HNSW"
    assert settings.milvus.index_params == {"M": 32, "efConstruction": 300}
    assert settings.milvus.search_params == {"ef": 256}


@pytest.mark.parametrize("raw", ["nprobe=4", "[4]", '{"nprobe": "4"}', '{"nprobe": true}'])
def test_malformed_search_params_stop_start_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, raw: str
) -> None:
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FACESEARCH_MILVUS_SEARCH_PARAMS", raw)
    # pydantic-settings' SettingsError (not JSON) and ValidationError (not numbers) are both ValueErrors.
    with pytest.raises(ValueError, match="search_params"):
        Settings.from_env()


def test_index_policy_refuses_unknown_index_and_negative_threshold() -> None:
    with pytest.raises(ValueError, match="large_index"):
        IndexPolicy(flat_max_rows=10, large_index="DISKANN")
    with pytest.raises(ValueError, match="flat_max_rows"):
        IndexPolicy(flat_max_rows=-1)


@pytest.mark.parametrize(
    ("url", "configured", "expected"),
    [
        ("redis://:pw@127.0.0.1:6379/0", None, 0),
        ("redis+sentinel://:pw@127.0.0.1:26379,127.0.0.1:26380/facesearch", None, 1),
        ("rediss+sentinel://:pw@127.0.0.1:26379/facesearch", None, 1),
        ("redis+sentinel://:pw@127.0.0.1:26379/facesearch", "0", 0),  # an explicit choice wins
        ("redis://:pw@127.0.0.1:6379/0", "2", 2),
    ],
)
def test_wait_replicas_default_follows_the_redis_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str, configured: str | None, expected: int
) -> None:
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_URL", url)
    if configured is not None:
        monkeypatch.setenv("FACESEARCH_REDIS_WAIT_REPLICAS", configured)
    assert wait_replicas(Settings.from_env()) == expected
