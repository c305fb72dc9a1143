"""A recognition model the operator brings, end to end on the real stores (embedded redis-server and
milvus-lite) and through the API: the ingress app in-process (ASGI) and the worker's queue consumer on the
same event loop, both built from Settings by the same wiring the deployments use (no Ray: the model path,
the stores and the API are under test, not Serve).

The model is real: the service's own SFace behind an ArcFace-convention input (tests/wrapped_sface.py).

1. faces-dev's people are enrolled (their first photo) with face model v2;
2. the operator declares the model (FACESEARCH_FACE_MODEL_*) and runs `facesearch calibrate --write-scores
   FILE --apply CLIENT_ID`: its score table, fitted on faces-dev, and the tenant's threshold;
3. `facesearch reindex --tenant` moves the gallery onto the model's own version (its own collection);
4. each person's other photos, searched through the API with the operator's model, find their face first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from facesearch_client import AsyncFaceSearchClient
from models.analyzer import load_face_analyzer
from models.embedder import MODEL_VERSION
from serve_app.api.app import create_app
from serve_app.launch.cli import main
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.analysis import LocalAnalysis
from serve_app.settings import Settings
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.wiring.api import build_api_services
from serve_app.wiring.models import model_config, serving_face_model
from serve_app.wiring.stores import redis_stores
from serve_app.wiring.worker import WorkerStores, build_worker
from tests.faces_dev import FacesDev
from tests.wrapped_sface import write_wrapped_sface


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("operator-model-stores"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


@contextlib.asynccontextmanager
async def api(settings: Settings, client_id: str, secret: str) -> AsyncIterator[AsyncFaceSearchClient]:
    """The ingress and a worker of these settings, and a client of the API."""
    analyzer = await asyncio.to_thread(load_face_analyzer, model_config(None, settings))
    stores = WorkerStores.build(settings)
    worker, _ = build_worker(settings, LocalAnalysis(analyzer), "test-worker", stores=stores)
    stop = asyncio.Event()
    consuming = asyncio.create_task(worker.run(stop))
    transport = httpx.ASGITransport(app=create_app(build_api_services(settings)), client=("127.0.0.1", 40000))
    http = httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=120)
    try:
        yield AsyncFaceSearchClient(client_id=client_id, client_secret=secret, http=http)
    finally:
        stop.set()
        await consuming
        await http.aclose()
        await stores.gallery.close()


def test_an_operator_model_is_calibrated_reindexed_onto_and_finds_the_enrolled_faces(
    servers: EmbeddedServices,
    faces_dev: FacesDev,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_url, milvus_uri = servers.redis_url, servers.milvus_uri
    assert redis_url is not None and milvus_uri is not None
    for name, value in {
        "FACESEARCH_DATA_DIR": str(tmp_path / "data"),
        "REDIS_URL": redis_url,
        "MILVUS_URI": milvus_uri,
        "FACESEARCH_SECRET_KEY": secrets.token_urlsafe(32),
        "FACESEARCH_KEY_PREFIX": "operator-model:",
    }.items():
        monkeypatch.setenv(name, value)
    people = faces_dev.by_identity()
    model_path, sha256 = write_wrapped_sface(tmp_path)
    scores = tmp_path / "scores.json"

    async def enrol_with_face_model_v2() -> tuple[str, str]:
        settings = Settings.from_env()
        assert serving_face_model(settings).version == MODEL_VERSION
        info, secret = await redis_stores(settings).clients.create("operator-model")
        async with api(settings, info.client_id, secret) as client:
            for identity, photos in people.items():
                await client.search(photos[0].path, client_reference=identity, enroll_face=True)
        return info.client_id, secret

    client_id, secret = asyncio.run(enrol_with_face_model_v2())

    # The operator declares the model; the commands and the service read the same settings.
    monkeypatch.setenv("FACESEARCH_FACE_MODEL_PATH", str(model_path))
    monkeypatch.setenv("FACESEARCH_FACE_MODEL_SHA256", sha256)
    monkeypatch.setenv("FACESEARCH_FACE_MODEL_DIM", "128")
    monkeypatch.setenv("FACESEARCH_FACE_MODEL_SCORES", str(scores))
    labels = faces_dev.root / "labels.csv"
    status = main(
        [
            "calibrate", str(labels), "--photos", str(faces_dev.root), "--target-fpir", "0.05",
            "--gallery-size", str(len(people)), "--write-scores", str(scores), "--apply", client_id,
            "--json", "--no-progress",
        ]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert status == 0, printed.err
    report = json.loads(printed.out)
    settings = Settings.from_env()
    version = serving_face_model(settings).version
    assert report["model_version"] == version == f"arcface_{sha256[:16]}"
    assert json.loads(scores.read_text())["model_version"] == version
    threshold = report["target"]["score"]
    assert threshold is not None and 0.0 < threshold < 1.0

    assert main(["reindex", "--tenant", client_id, "--state", str(tmp_path / "state.json")]) == 0
    reindexed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (reindexed["faces"], reindexed["reindexed"], reindexed["unusable"]) == (
        len(people),
        len(people),
        {},
    )

    async def search_with_the_operator_model() -> None:
        stores = redis_stores(settings)
        info = await stores.clients.get(client_id)
        assert info is not None and info.min_score == threshold  # --apply CLIENT_ID
        records, _ = await stores.records.page(client_id, None, 100)
        assert {record.model_version for record in records} == {version}
        async with api(settings, client_id, secret) as client:
            for identity, photos in people.items():
                for photo in photos[1:]:
                    found = await client.search(photo.path, enroll_face=False)
                    assert found.matches, (identity, photo.path.name)
                    assert found.matches[0].client_reference == identity
                    assert all(match.score >= threshold for match in found.matches)
        # The gallery moved: the new version's collection holds the faces; v2's vectors stay in v2's own.
        for served, dimension in ((version, 128), (MODEL_VERSION, 256)):
            gallery = MilvusGalleryStore(milvus_uri, model_version=served, dimension=dimension)
            try:
                ids, _ = await gallery.page_ids(client_id, None, 100)
                assert len(ids) == len(people), served
            finally:
                await gallery.close()

    asyncio.run(search_with_the_operator_model())
