"""Settings from the environment, the deploy-config models, the shipped configs and the docs' table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from serve_app.deployments.front_door import DIRECT_INGRESS_FLAG, FRONT_DOOR_FLAG
from serve_app.deployments.user_config import USER_CONFIGS, BatchConfig, WorkerConfig, validate_user_config
from serve_app.launch.deploy_config import load_serve_config, parse_serve_config
from serve_app.launch.topology import DEPLOYMENTS, AppArgs
from serve_app.settings import Settings, environment_variables, markdown_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No service variable from the caller's environment leaks into a test."""
    for name, _, _ in environment_variables():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    return monkeypatch


def test_documented_variable_names_keep_working(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {
        "REDIS_URL": "redis://:pw@redis:6379/0",
        "MILVUS_URI": "http://milvus:19530",
        "MILVUS_TOKEN": "root:Milvus",
        "FACESEARCH_KEY_PREFIX": "t1:",
        "FACESEARCH_ACCESS_TOKEN_TTL_S": "60",
        "FACESEARCH_MAX_MATCHES": "3",
        "FACESEARCH_MATCH_MIN_SCORE": "0.42",
        "FACESEARCH_WORKER_CONCURRENCY": "7",
        "FACESEARCH_STALE_AFTER_S": "12.5",
        "FACESEARCH_MAX_DELIVERIES": "2",
        "FACESEARCH_TRUSTED_PROXIES": " 10.0.0.0/8 ,192.168.1.5,",
        "FACESEARCH_PUBLIC_BASE_URL": "https://faces.example/",
        "FACESEARCH_TRANSACTION_RETENTION_S": "0",
        "FACESEARCH_BLOB_DIR": str(tmp_path / "elsewhere"),
    }
    for name, value in values.items():
        clean_env.setenv(name, value)
    settings = Settings.from_env()
    assert (settings.redis.url, settings.redis.key_prefix) == ("redis://:pw@redis:6379/0", "t1:")
    assert (settings.milvus.uri, settings.milvus.token) == ("http://milvus:19530", "root:Milvus")
    assert settings.auth.access_token_ttl_s == 60
    assert (settings.search.max_matches, settings.search.match_min_score) == (3, 0.42)
    assert (settings.worker.concurrency, settings.worker.stale_after_s, settings.worker.max_deliveries) == (
        7,
        12.5,
        2,
    )
    assert settings.http.trusted_proxies == ("10.0.0.0/8", "192.168.1.5/32")
    assert settings.http.public_base_url == "https://faces.example"
    assert settings.retention.transaction_retention_s == 0
    assert settings.blobs == tmp_path / "elsewhere"


def test_knobs_that_used_to_be_literals_are_settable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("FACESEARCH_REDIS_POOL_SIZE", "64")
    clean_env.setenv("FACESEARCH_WORKER_RECONCILE_EVERY_S", "30")
    clean_env.setenv("FACESEARCH_DONE_SIGNAL_TTL_S", "5")
    clean_env.setenv("FACESEARCH_MILVUS_TIMEOUT_S", "3")
    settings = Settings.from_env()
    assert settings.redis.pool_size == 64
    assert settings.worker.reconcile_every_s == 30.0
    assert settings.retention.done_signal_ttl_s == 5
    assert settings.milvus.timeout_s == 3.0


def test_defaults_empty_values_and_the_development_secret(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("FACESEARCH_MATCH_MIN_SCORE", "")  # empty means unset, as it always did
    clean_env.setenv("REDIS_URL", "")
    settings = Settings.from_env()
    assert settings.search.match_min_score is None and settings.redis.url is None
    assert settings.blobs == tmp_path / "blobs"
    assert len(settings.auth.secret_key) >= 32
    assert Settings.from_env().auth.secret_key == settings.auth.secret_key  # kept in the data dir


def test_bad_values_stop_start_up_naming_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("FACESEARCH_TRUSTED_PROXIES", "10.0.0.0/8,not-a-network")
    with pytest.raises(ValidationError, match="not-a-network"):
        Settings.from_env()
    clean_env.delenv("FACESEARCH_TRUSTED_PROXIES")
    clean_env.setenv("FACESEARCH_MATCH_MIN_SCORE", "1.5")
    with pytest.raises(ValidationError, match="match_min_score"):
        Settings.from_env()
    clean_env.delenv("FACESEARCH_MATCH_MIN_SCORE")
    clean_env.setenv("FACESEARCH_ENV", "production")
    with pytest.raises(RuntimeError, match="FACESEARCH_SECRET_KEY"):
        Settings.from_env()


def test_results_archive_settings(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = Settings.from_env()
    assert settings.results == tmp_path / "results"
    retention = settings.retention
    assert (retention.result_hot_window_s, retention.archive_after_s) == (24 * 3600, 24 * 3600)
    assert retention.erasure_memory_s == retention.transaction_retention_s + 24 * 3600
    # A hot window as long as the retention, or none: results stay in Redis until they expire.
    clean_env.setenv("FACESEARCH_RESULT_HOT_WINDOW_S", str(retention.transaction_retention_s))
    assert Settings.from_env().retention.archive_after_s == 0
    clean_env.setenv("FACESEARCH_RESULT_HOT_WINDOW_S", "0")
    assert Settings.from_env().retention.archive_after_s == 0
    clean_env.setenv("FACESEARCH_RESULT_HOT_WINDOW_S", "60")
    clean_env.setenv("FACESEARCH_TRANSACTION_RETENTION_S", "0")  # kept for ever: archived, never swept
    assert Settings.from_env().retention.archive_after_s == 60
    assert Settings.from_env().retention.erasure_memory_s is None
    # The archive may not live inside the blob directory that reconciliation sweeps, nor contain it.
    for results in (tmp_path / "blobs", tmp_path / "blobs" / "results", tmp_path):
        clean_env.setenv("FACESEARCH_RESULTS_DIR", str(results))
        with pytest.raises(ValidationError, match="FACESEARCH_RESULTS_DIR"):
            Settings.from_env()


def test_unrelated_short_variable_names_are_not_read(clean_env: pytest.MonkeyPatch) -> None:
    # Aliases replace the prefixed names: a generic URL / TOKEN in the environment must not leak in.
    clean_env.setenv("URL", "redis://wrong")
    clean_env.setenv("TOKEN", "wrong")
    settings = Settings.from_env()
    assert settings.redis.url is None and settings.milvus.token == ""


def test_a_typo_in_a_user_config_names_the_key() -> None:
    with pytest.raises(ValidationError, match="concurency"):
        WorkerConfig.model_validate({"concurency": 8})
    with pytest.raises(ValueError, match=r"(?s)FaceEmbedderModel\.user_config.*max_batch_sise"):
        validate_user_config("FaceEmbedderModel", {"max_batch_sise": 8})
    with pytest.raises(ValueError, match="anything"):
        validate_user_config("ApiIngress", {"anything": 1})
    assert BatchConfig.model_validate({"max_batch_size": 32}).max_batch_size == 32
    assert WorkerConfig.model_validate({}).concurrency is None


def test_a_typo_in_the_application_args_names_the_key() -> None:
    with pytest.raises(ValidationError, match="topolgy"):
        AppArgs.model_validate({"topolgy": "split"})
    with pytest.raises(ValidationError, match="intra_op_thread"):
        AppArgs.model_validate({"model_config": {"intra_op_thread": 2}})
    with pytest.raises(ValidationError, match="FaceAnalysisModel"):
        AppArgs.model_validate({"topology": "split", "deployment_options": {"FaceAnalysisModel": {}}})
    with pytest.raises(ValidationError, match="FaceDetectorModel"):  # a split deployment, not in this one
        AppArgs.model_validate({"deployment_options": {"FaceDetectorModel": {}}})
    with pytest.raises(ValidationError, match="batch_wait_timeout"):
        AppArgs.model_validate(
            {
                "topology": "split",
                "deployment_options": {"AgeModel": {"user_config": {"batch_wait_timeout": 0.01}}},
            }
        )
    with pytest.raises(ValidationError, match="topology"):
        AppArgs.model_validate({"topology": "fused"})  # removed: the worker owns the models on CPU


def _kuberay_serve_config() -> dict[str, object]:
    manifest = yaml.safe_load((ROOT / "deploy/kuberay-rayservice.yaml").read_text())
    document = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert isinstance(document, dict)
    return document


def test_every_shipped_config_validates() -> None:
    default, http, direct_ingress, _ = load_serve_config(ROOT / "config/serve.yaml")
    assert default.topology == "in_process" and http["host"] == "127.0.0.1" and direct_ingress
    assert default.deployment_options["TransactionWorker"]["user_config"] == {"concurrency": 32}
    gpu = load_serve_config(ROOT / "config/serve-gpu.yaml")
    kuberay = parse_serve_config(_kuberay_serve_config())
    cluster = load_serve_config(ROOT / "config/serve-gpu-cluster.yaml")
    for on_a_cluster in (kuberay, cluster):
        assert not on_a_cluster.direct_ingress  # clusters keep Serve's proxies
        assert on_a_cluster.args.topology == "split"
        assert set(on_a_cluster.args.deployment_options) == set(DEPLOYMENTS["split"])
        assert on_a_cluster.args.models["provider_preference"][0] == "CUDAExecutionProvider"
    # One GPU machine (bench/gpu_service.py): in_process workers that each own CUDA sessions.
    assert gpu.direct_ingress and gpu.args.topology == "in_process"
    assert set(gpu.args.deployment_options) == set(DEPLOYMENTS["in_process"])
    assert gpu.args.deployment_options["TransactionWorker"]["ray_actor_options"]["num_gpus"] > 0
    for args in (gpu.args, kuberay.args):
        assert args.models["provider_preference"][0] == "CUDAExecutionProvider"


def test_a_shipped_config_with_a_typo_is_rejected() -> None:
    document = yaml.safe_load((ROOT / "config/serve-gpu.yaml").read_text())
    document["applications"][0]["deployments"][1]["user_config"]["concurrencyy"] = 8
    with pytest.raises(ValidationError, match="concurrencyy"):
        parse_serve_config(document)


def test_deploy_config_names_match_the_deployments() -> None:
    from serve_app.deployments.ingress import ApiIngress
    from serve_app.deployments.models import model_deployment
    from serve_app.deployments.user_config import MODEL_DEPLOYMENTS
    from serve_app.deployments.worker import TransactionWorker

    # Serve's decorator returns Deployments, which its type hints do not say.
    deployments: tuple[Any, ...] = (ApiIngress, TransactionWorker, *map(model_deployment, MODEL_DEPLOYMENTS))
    names = {d.name for d in deployments}
    assert names == set(USER_CONFIGS) == {name for names in DEPLOYMENTS.values() for name in names}


def test_the_docs_table_is_the_generated_one() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    begin = page.index("<!-- settings-table")
    begin = page.index("\n", begin) + 1
    end = page.index("<!-- /settings-table -->")
    assert page[begin:end] == markdown_table(), "run `python -m serve_app.settings` and paste its table"


def test_the_one_machine_configs_put_several_ingress_replicas_behind_the_front_door() -> None:
    default = load_serve_config(ROOT / "config/serve.yaml")
    gpu = load_serve_config(ROOT / "config/serve-gpu.yaml")
    for shipped in (default, gpu):
        assert shipped.direct_ingress and shipped.env_vars[FRONT_DOOR_FLAG] == "1"
        assert shipped.http_options["host"] == "127.0.0.1"  # the public port stays on loopback
    assert default.args.deployment_options["ApiIngress"]["num_replicas"] == 2
    assert gpu.args.deployment_options["ApiIngress"]["num_replicas"] > 2


def _default_document() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "config/serve.yaml").read_text())
    return document


@pytest.mark.parametrize(
    "ingress",
    [
        {"num_replicas": 1},
        {"num_replicas": 3},
        {"num_replicas": "auto"},
        {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
        {},  # Serve's default: one
    ],
)
def test_behind_the_front_door_any_number_of_ingress_replicas_is_accepted(ingress: dict[str, Any]) -> None:
    document = _default_document()
    entry = next(d for d in document["applications"][0]["deployments"] if d["name"] == "ApiIngress")
    entry.pop("num_replicas")
    entry |= ingress
    assert parse_serve_config(document).direct_ingress


def test_direct_ingress_without_the_front_door_is_refused() -> None:
    """Each replica would serve a port no client knows: the config must ask for HAProxy too."""
    document = _default_document()
    env_vars = document["applications"][0]["runtime_env"]["env_vars"]
    del env_vars[FRONT_DOOR_FLAG]
    env_vars[DIRECT_INGRESS_FLAG] = "1"
    with pytest.raises(ValueError, match=FRONT_DOOR_FLAG):
        parse_serve_config(document)


def test_without_either_switch_serves_proxy_takes_any_number_of_ingress_replicas() -> None:
    document = _default_document()
    del document["applications"][0]["runtime_env"]["env_vars"][FRONT_DOOR_FLAG]
    assert not parse_serve_config(document).direct_ingress


def test_a_typo_in_a_front_door_config_still_fails() -> None:
    document = _default_document()
    entry = next(d for d in document["applications"][0]["deployments"] if d["name"] == "TransactionWorker")
    entry["user_config"]["concurency"] = 8
    with pytest.raises(ValidationError, match="concurency"):
        parse_serve_config(document)


def test_a_configs_serve_switches_are_read_as_strings() -> None:
    document = yaml.safe_load((ROOT / "config/serve.yaml").read_text())
    env_vars = document["applications"][0]["runtime_env"]["env_vars"]
    env_vars["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = 0.25  # YAML reads an unquoted number as a float
    parsed = parse_serve_config(document).env_vars
    assert parsed["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.25"
    assert parsed[FRONT_DOOR_FLAG] == "1"
    assert all(isinstance(value, str) for value in parsed.values())  # what os.environ accepts
