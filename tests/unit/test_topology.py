"""The topology object (serve_app/launch/topology.py): what each topology binds and what the worker gets to
analyse with; and the worker process' stores, built once (serve_app/wiring/worker.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from serve_app.deployments.analysis import ModelAnalysis, OwnModels
from serve_app.launch.topology import DEPLOYMENTS, build_app
from serve_app.settings import Settings
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_support import connect_redis
from serve_app.wiring.worker import WorkerStores, build_reconciler, build_worker
from tests.unit.fakes import ScriptedAnalysis


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Settings:
    """Addresses nobody listens on: building stores and graphs connects to nothing."""
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FACESEARCH_SECRET_KEY", "unit-test-secret-0123456789abcdef")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("MILVUS_URI", "http://127.0.0.1:1")
    return Settings.from_env()


def _built(args: dict[str, Any]) -> dict[str, Any]:
    """The deployments Serve would run for these args, by name (built the way serve.run builds them)."""
    from ray.serve._private.build_app import build_app as serve_build_app

    built = serve_build_app(build_app(args), name="facesearch")
    return {deployment.name: deployment for deployment in built.deployments}


@pytest.mark.parametrize("topology", ["in_process", "split"])
def test_each_topology_binds_exactly_its_deployments(backends: Settings, topology: str) -> None:
    assert set(_built({"topology": topology})) == set(DEPLOYMENTS[topology])  # type: ignore[index]


def test_on_one_machine_the_worker_gets_its_own_models_with_the_configs_model_settings(
    backends: Settings,
) -> None:
    from ray import cloudpickle

    model_config = {"intra_op_threads": 1, "allow_spinning": False}
    args = {"topology": "in_process", "model_config": model_config, "concurrent_batches": 2}
    worker = _built(args)["TransactionWorker"]
    init_args = cloudpickle.loads(worker._replica_config.serialized_init_args)
    assert init_args == (OwnModels(model_config, concurrent_batches=2),)
    assert not cloudpickle.loads(worker._replica_config.serialized_init_kwargs)


def test_concurrent_batches_belong_to_the_in_process_worker_only(backends: Settings) -> None:
    with pytest.raises(ValueError, match="concurrent_batches is the in_process worker's"):
        build_app({"topology": "split", "concurrent_batches": 2})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        build_app({"concurrent_batches": 0})


def test_the_default_topology_is_the_one_machine_cpu_wiring(backends: Settings) -> None:
    assert set(_built({})) == {"ApiIngress", "TransactionWorker"}


def test_the_recipe_builds_the_analysis_runner_in_the_replica() -> None:
    # Built where it runs: the recipe itself carries only the model settings.
    built = OwnModels({"intra_op_threads": 1}).build()
    assert isinstance(built, ModelAnalysis)


def test_a_worker_process_opens_one_redis_pool_and_one_milvus_client(
    backends: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools: list[object] = []
    galleries: list[object] = []

    def counted_pool(*args: Any, **kwargs: Any) -> Any:
        pools.append(connect_redis(*args, **kwargs))
        return pools[-1]

    def counted_gallery(*args: Any, **kwargs: Any) -> Any:
        galleries.append(MilvusGalleryStore(*args, **kwargs))
        return galleries[-1]

    # Every store of the process is built by serve_app.wiring.stores, which names both.
    monkeypatch.setattr("serve_app.wiring.stores.connect_redis", counted_pool)
    monkeypatch.setattr("serve_app.wiring.stores.MilvusGalleryStore", counted_gallery)

    async def as_the_worker_replica_builds_it() -> None:
        # What TransactionWorker.__init__ builds: the stores once, the queue worker and reconciler on them.
        stores = WorkerStores.build(backends)
        build_worker(backends, ScriptedAnalysis(), "consumer", stores=stores)
        build_reconciler(backends, "consumer", stores)
        for pool in pools:
            await pool.aclose()  # type: ignore[attr-defined]

    asyncio.run(as_the_worker_replica_builds_it())
    assert len(pools) == 1 and len(galleries) == 1
