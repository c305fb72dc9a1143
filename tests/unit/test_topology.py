"""The topology (serve_app/launch/topology.py) and the deployments it binds, constructed as Serve constructs
them in a replica: the undecorated class behind each Serve deployment (Deployment.func_or_class), given the
bind arguments the topology gives it, with real collaborators (settings from the environment, the stores on
addresses nobody listens on, the registry's models) and small fakes only where a Ray handle would be."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from ray.serve._private.http_util import ASGIAppReplicaWrapper

from models.age_v2 import INPUT_SIZE as AGE_INPUT_SIZE
from models.age_v2 import VIEWS_PER_FACE
from models.analyzer import ModelConfig
from models.chips import CHIP_SIZE as SFACE_CHIP_SIZE
from models.embedder import CHIP_SIZE as DLIB_CHIP_SIZE
from models.embedder import FUSED_DIM
from models.registry import MODELS
from models.runners import DescriptorChips
from serve_app.deployments.analysis import ModelAnalysis, ModelDeployments, OwnModels, SplitAnalysis
from serve_app.deployments.user_config import INGRESS, MODEL_DEPLOYMENTS, USER_CONFIGS, WORKER
from serve_app.launch.topology import DEPLOYMENTS, build_app
from serve_app.settings import Settings
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_support import connect_redis
from tests.unit.fakes import ScriptedAnalysis

CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Settings:
    """Addresses nobody listens on: building stores and graphs connects to nothing."""
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FACESEARCH_SECRET_KEY", "unit-test-secret-0123456789abcdef")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("MILVUS_URI", "http://127.0.0.1:1")
    return Settings.from_env()


@dataclass
class OpenedClients:
    redis_pools: list[Any] = field(default_factory=list)
    milvus_clients: list[Any] = field(default_factory=list)


@pytest.fixture
def opened(backends: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenedClients]:
    """Counts the Redis pools and Milvus clients a constructor opens (serve_app.wiring.stores builds every
    store of a process, so it names both)."""
    clients = OpenedClients()

    def counted_pool(*args: Any, **kwargs: Any) -> Any:
        clients.redis_pools.append(connect_redis(*args, **kwargs))
        return clients.redis_pools[-1]

    def counted_gallery(*args: Any, **kwargs: Any) -> Any:
        clients.milvus_clients.append(MilvusGalleryStore(*args, **kwargs))
        return clients.milvus_clients[-1]

    monkeypatch.setattr("serve_app.wiring.stores.connect_redis", counted_pool)
    monkeypatch.setattr("serve_app.wiring.stores.MilvusGalleryStore", counted_gallery)
    yield clients


def _built(args: dict[str, Any]) -> dict[str, Any]:
    """The deployments Serve would run for these args, by name (built the way serve.run builds them)."""
    from ray.serve._private.build_app import build_app as serve_build_app

    built = serve_build_app(build_app(args), name="facesearch")
    return {deployment.name: deployment for deployment in built.deployments}


def _init_args(deployment: Any) -> tuple[Any, ...]:
    from ray import cloudpickle

    assert not cloudpickle.loads(deployment._replica_config.serialized_init_kwargs)
    init_args: tuple[Any, ...] = cloudpickle.loads(deployment._replica_config.serialized_init_args)
    return init_args


def _as_a_replica_constructs(deployment: Any, *args: Any) -> Any:
    """The deployment's class constructed with the bind arguments, as a Serve replica constructs it. For the
    ingress, the class serve.ingress wraps: Serve's wrapper runs that class' constructor, then asks it for
    its ASGI app (__serve_build_asgi_app__), and its own async __del__ would outlive a test."""
    cls = deployment.func_or_class
    if issubclass(cls, ASGIAppReplicaWrapper):
        (cls,) = (base for base in cls.__bases__ if base is not ASGIAppReplicaWrapper)
    if inspect.iscoroutinefunction(getattr(cls, "__del__", None)):
        # Serve awaits an async __del__ when it stops a replica (the tests do: `await replica.shutdown()`);
        # the garbage collector would call it once more later, unawaited.
        cls = type(cls.__name__, (cls,), {"__del__": lambda self: None, "shutdown": cls.__del__})
    return cls(*args)


# What the topology binds.


@pytest.mark.parametrize("topology", ["in_process", "split"])
def test_each_topology_binds_exactly_its_deployments(backends: Settings, topology: str) -> None:
    assert set(_built({"topology": topology})) == set(DEPLOYMENTS[topology])  # type: ignore[index]


def test_the_deployment_names_come_from_one_table_and_name_the_deployment_classes() -> None:
    from serve_app.deployments.ingress import ApiIngress
    from serve_app.deployments.models import model_deployment
    from serve_app.deployments.worker import TransactionWorker

    assert (ApiIngress.name, TransactionWorker.name) == (INGRESS, WORKER)  # type: ignore[attr-defined]
    assert DEPLOYMENTS["split"] == (INGRESS, WORKER, *MODEL_DEPLOYMENTS) == tuple(USER_CONFIGS)
    assert {model_deployment(name).name for name in MODEL_DEPLOYMENTS} == set(MODEL_DEPLOYMENTS)
    with pytest.raises(ValueError, match="no model deployment 'GenderModel'"):
        model_deployment("GenderModel")


def test_on_one_machine_the_worker_gets_its_own_models_with_the_configs_model_settings(
    backends: Settings,
) -> None:
    model_config = {"intra_op_threads": 1, "allow_spinning": False}
    args = {"topology": "in_process", "model_config": model_config, "concurrent_batches": 2}
    assert _init_args(_built(args)[WORKER]) == (OwnModels(model_config, concurrent_batches=2),)


def test_the_split_topology_binds_each_model_deployment_to_its_registry_stage(backends: Settings) -> None:
    model_config = {"intra_op_threads": 2}
    built = _built({"topology": "split", "model_config": model_config})
    for name, stage in MODEL_DEPLOYMENTS.items():
        assert _init_args(built[name]) == (stage, model_config)
        # On a CPU config no model deployment asks for a GPU.
        assert not built[name].ray_actor_options.get("num_gpus")


def test_a_config_that_requires_cuda_gives_each_model_deployment_its_share_of_a_gpu(
    backends: Settings,
) -> None:
    detector, others = (
        "FaceDetectorModel",
        [name for name in MODEL_DEPLOYMENTS if name != "FaceDetectorModel"],
    )
    args = {
        "topology": "split",
        "model_config": {"provider_preference": CUDA_FIRST},
        # A deployment the config sets ray_actor_options for keeps the config's; the others are not listed.
        "deployment_options": {detector: {"ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5}}},
    }
    built = _built(args)
    assert built[detector].ray_actor_options["num_gpus"] == 0.5
    assert built[detector].ray_actor_options["num_cpus"] == 2
    for name in others:
        entry = MODELS.entry(MODEL_DEPLOYMENTS[name])
        assert built[name].ray_actor_options["num_gpus"] == entry.gpu_share > 0
        assert built[name].ray_actor_options["num_cpus"] == 1  # the deployment's own, kept
    # CUDA preferred but not required (allow_cpu_fallback): no GPU asked, so the replicas can start anywhere.
    fallback = {"provider_preference": CUDA_FIRST, "allow_cpu_fallback": True}
    built = _built({"topology": "split", "model_config": fallback})
    assert not any(built[name].ray_actor_options.get("num_gpus") for name in MODEL_DEPLOYMENTS)


def test_concurrent_batches_belong_to_the_in_process_worker_only(backends: Settings) -> None:
    with pytest.raises(ValueError, match="concurrent_batches is the in_process worker's"):
        build_app({"topology": "split", "concurrent_batches": 2})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        build_app({"concurrent_batches": 0})


def test_the_default_topology_is_the_one_machine_cpu_wiring(backends: Settings) -> None:
    assert set(_built({})) == {INGRESS, WORKER}


def test_the_recipe_builds_the_analysis_runner_in_the_replica() -> None:
    # Built where it runs: the recipe itself carries only the model settings.
    built = OwnModels({"intra_op_threads": 1}).build()
    assert isinstance(built, ModelAnalysis)


# The deployments' classes, constructed as a replica constructs them.


@dataclass
class CountedRecipe:
    """An AnalysisRecipe whose analysis is scripted; counts how often the replica builds it."""

    analysis: ScriptedAnalysis = field(default_factory=ScriptedAnalysis)
    builds: int = 0

    def build(self) -> ScriptedAnalysis:
        self.builds += 1
        return self.analysis


class CheckedAnalysis(ScriptedAnalysis):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def check(self) -> None:
        self.checks += 1


def test_the_worker_replica_builds_its_analysis_once_and_opens_one_redis_pool_and_one_milvus_client(
    opened: OpenedClients,
) -> None:
    recipe = CountedRecipe(CheckedAnalysis())

    async def as_a_replica() -> None:
        worker = _as_a_replica_constructs(_built({})[WORKER], recipe)
        try:
            assert recipe.builds == 1
            # One pool and one client for the queue worker, reconciliation, the archive and the webhooks.
            assert (len(opened.redis_pools), len(opened.milvus_clients)) == (1, 1)
            status = await worker.status()
            assert status["in_flight"] == 0 and status["processed"] == 0 and status["consumer"]
            # It started consuming in its constructor; its health check asks the analysis it built.
            await asyncio.sleep(0.05)
            await worker.check_health()
            assert isinstance(recipe.analysis, CheckedAnalysis) and recipe.analysis.checks == 1
            worker.reconfigure({"concurrency": 3})
            with pytest.raises(ValidationError, match="concurency"):
                worker.reconfigure({"concurency": 3})
        finally:
            await worker.shutdown()  # Serve's graceful shutdown (__del__): every task it started ends
        assert all(task.done() for task in worker._tasks.values())
        for pool in opened.redis_pools:
            await pool.aclose()

    asyncio.run(as_a_replica())


def test_the_worker_replica_is_unhealthy_once_any_of_its_loops_has_ended(opened: OpenedClients) -> None:
    """Every background loop of the registry (serve_app/wiring/worker.py, WorkerLoops) runs as a task of
    the replica, and its health check watches each: a loop that died (here: its task cancelled, as one a
    bug ended) fails the check, naming the loop, so Serve replaces the replica. One replica per loop, each
    with that loop killed; the others keep running meanwhile."""
    names = ["consumer", "webhooks", "metrics", "reconcile", "result-archive", "result-sweep", "index-switch"]
    deployment = _built({})[WORKER]

    async def replicas() -> None:
        started = []
        for _ in names:
            before = asyncio.all_tasks()
            worker = _as_a_replica_constructs(deployment, CountedRecipe(CheckedAnalysis()))
            # The replica's loops, by task name: it starts one-off tasks too (its Redis policy check).
            new_tasks = asyncio.all_tasks() - before
            own_loops = [task for task in new_tasks if task.get_name().startswith("worker loop ")]
            started.append((worker, sorted(own_loops, key=lambda task: task.get_name())))
        try:
            await asyncio.sleep(0.05)
            verdicts = []
            for which, (worker, loops) in enumerate(started):
                assert len(loops) == len(names)  # the defaults run every loop of the registry
                await worker.check_health()  # every loop runs (the stores are unreachable: they retry)
                loops[which].cancel()
                await asyncio.wait({loops[which]})
                try:
                    await worker.check_health()
                    verdicts.append("healthy")
                except RuntimeError as error:
                    verdicts.append(str(error))
            assert "healthy" not in verdicts
            for name in names:
                assert sum(f"worker loop '{name}' stopped: cancelled" in verdict for verdict in verdicts) == 1
        finally:
            await asyncio.gather(*(worker.shutdown() for worker, _ in started))
            for pool in opened.redis_pools:
                await pool.aclose()

    asyncio.run(replicas())


class ModelHandle:
    """Where a Ray handle to a model deployment would be (the split worker only holds it here)."""


def test_the_split_worker_replica_analyses_across_the_model_deployments_handles(
    opened: OpenedClients,
) -> None:
    handles: dict[Any, Any] = {stage: ModelHandle() for stage in MODEL_DEPLOYMENTS.values()}

    async def as_a_replica() -> None:
        split_worker = _built({"topology": "split"})[WORKER]
        worker = _as_a_replica_constructs(split_worker, ModelDeployments(handles, {}))
        try:
            analysis = worker._analysis
            assert isinstance(analysis, SplitAnalysis)
            assert (analysis._detector, analysis._embedder, analysis._age) == (
                handles["detector"],
                handles["embedder"],
                handles["age"],
            )
            await asyncio.sleep(0.05)
            await worker.check_health()  # the model deployments check their own models
        finally:
            await worker.shutdown()
        for pool in opened.redis_pools:
            await pool.aclose()

    asyncio.run(as_a_replica())


def test_the_ingress_replica_serves_the_api_on_one_redis_pool_and_one_milvus_client(
    opened: OpenedClients,
) -> None:
    async def as_a_replica() -> None:
        ingress = _as_a_replica_constructs(_built({})[INGRESS], None)
        app = ingress.__serve_build_asgi_app__()
        assert {"/face-search", "/age-estimation", "/result", "/gallery/faces"} <= set(app.openapi()["paths"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ingress") as http:
            response = await http.get("/healthz")
        assert response.status_code == 200
        # Its stores share one pool; Milvus only for the gallery's removals.
        assert (len(opened.redis_pools), len(opened.milvus_clients)) == (1, 1)
        for pool in opened.redis_pools:
            await pool.aclose()

    asyncio.run(as_a_replica())


def _model_input(stage: str) -> Any:
    if stage == "detector":
        return ModelConfig().letterboxer()(np.full((96, 128, 3), 127, dtype=np.uint8))
    if stage == "embedder":
        return DescriptorChips(
            np.zeros((2, DLIB_CHIP_SIZE, DLIB_CHIP_SIZE, 3), dtype=np.uint8),
            np.zeros((2, SFACE_CHIP_SIZE, SFACE_CHIP_SIZE, 3), dtype=np.uint8),
        )
    return np.zeros((2, VIEWS_PER_FACE, AGE_INPUT_SIZE, AGE_INPUT_SIZE, 3), dtype=np.uint8)


@pytest.mark.parametrize(("name", "stage"), list(MODEL_DEPLOYMENTS.items()))
def test_each_model_deployment_replica_serves_its_registry_model(
    backends: Settings, monkeypatch: pytest.MonkeyPatch, name: str, stage: str
) -> None:
    deployment = _built({"topology": "split"})[name]
    # serve.batch reads its replica's deployment config (its ongoing-request limit) from Serve's replica
    # context when its first batch queue opens: the context of a replica of this deployment.
    replica = SimpleNamespace(
        app_name="facesearch",
        deployment=name,
        replica_tag="unit",
        _deployment_config=deployment._deployment_config,
    )

    async def as_a_replica() -> Any:
        model = _as_a_replica_constructs(deployment, *_init_args(deployment))
        await model.check_health()
        model.reconfigure({"max_batch_size": 2})
        with pytest.raises(ValidationError, match="max_batch_sise"):
            model.reconfigure({"max_batch_sise": 2})
        monkeypatch.setattr("ray.serve.context._INTERNAL_REPLICA_CONTEXT", replica)
        return await model.run(_model_input(stage))

    output = asyncio.run(as_a_replica())
    if stage == "detector":
        assert output == []  # a grey image has no face
    elif stage == "embedder":
        assert output.shape == (2, FUSED_DIM)
    else:
        assert len(output) == 2 and all(0 < estimate.age <= 100 for estimate in output)
