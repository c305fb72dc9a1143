"""`facesearch reindex --tenant`: faces enrolled under an older face model version are re-embedded from
their stored proof images with the current model, on real Redis and milvus-lite or a Milvus server (the
`gallery_backend` fixture) with the real models and real photos; an interrupted run resumes where it
stopped."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from models.analyzer import ModelConfig, largest_face, load_face_analyzer
from models.embedder import FUSED_DIM, MODEL_VERSION
from models.types import AnalyzedFace
from serve_app.domain.faces import FaceRecord
from serve_app.imaging.decode import decode_image
from serve_app.launch.cli import main as cli_main
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.analysis import LocalAnalysis
from serve_app.pipelines.reindex import ImageLimits, ReindexState, reindex_tenant
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from tests.faces_dev import load_faces_dev
from tests.integration.conftest import GalleryBackend
from tests.unit.fakes import TEST_LOCK

OLD_VERSION = "face_v0_retired"
_DEFAULTS = Settings()
LIMITS = ImageLimits(_DEFAULTS.limits.max_image_pixels, _DEFAULTS.models.analysis_max_side)


class Interrupted(Exception):
    """Stands for a Ctrl-C or a crash in the middle of a run."""


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("reindex"), milvus=False)
    services.start()
    try:
        yield services
    finally:
        services.stop()


class CountingAnalysis(LocalAnalysis):
    calls = 0

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        self.calls += 1
        return await super().analyze(image, embed=embed, estimate_age=estimate_age)


def test_reindex_reembeds_from_proofs_and_resumes(
    backends: EmbeddedServices,
    gallery_backend: GalleryBackend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_url, milvus_uri = backends.redis_url, gallery_backend.uri
    assert redis_url is not None
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    blob_dir = tmp_path / "blobs"
    state_path = tmp_path / "state.json"
    dev = load_faces_dev()
    photos = [group[0].path for group in dev.by_identity().values()][:5]
    no_face = dev.of_kind("negative")[0].path
    analyzer = load_face_analyzer(ModelConfig(intra_op_threads=1))
    usable = [f"a{i}" for i in range(len(photos))]

    def record(face_id: str, tenant: str, proof_key: str) -> FaceRecord:
        return FaceRecord(face_id, tenant, f"ref-{face_id}", proof_key, OLD_VERSION, time.time(), face_id)

    async def with_stores(
        body: Callable[[RedisFaceRecordStore, LocalBlobStore, MilvusGalleryStore], Awaitable[None]],
    ) -> None:
        redis = connect_redis(redis_url)
        # The service's own collection name and version (no other test uses that collection).
        gallery = MilvusGalleryStore(milvus_uri, model_version=MODEL_VERSION, dimension=FUSED_DIM)
        try:
            await body(RedisFaceRecordStore(redis, prefix=prefix), LocalBlobStore(blob_dir), gallery)
        finally:
            await gallery.close()
            await redis.aclose()

    async def enrol_and_interrupt(
        records: RedisFaceRecordStore, blobs: LocalBlobStore, gallery: MilvusGalleryStore
    ) -> None:
        # tenant-a: five faces enrolled under a retired model, one whose proof is gone, one whose proof
        # holds no face; tenant-b: one face that must stay as it is.
        for face_id, path in zip(usable, photos, strict=True):
            await blobs.put(f"proof-{face_id}", path.read_bytes(), "image/jpeg")
            await records.put(record(face_id, "tenant-a", f"proof-{face_id}"))
        await records.put(record("a-missing", "tenant-a", "proof-never-stored"))
        await blobs.put("proof-a-noface", no_face.read_bytes(), "image/jpeg")
        await records.put(record("a-noface", "tenant-a", "proof-a-noface"))
        await blobs.put("proof-b0", photos[0].read_bytes(), "image/jpeg")
        await records.put(record("b0", "tenant-b", "proof-b0"))

        ticks = 0

        def interrupt_after_three() -> None:
            nonlocal ticks
            ticks += 1
            if ticks == 3:
                raise Interrupted

        # Faces go in face_id order: a-missing, a-noface, a0 | a1 ... a4.
        with pytest.raises(Interrupted):
            await reindex_tenant(
                "tenant-a", records=records, gallery=gallery, blobs=blobs, analysis=LocalAnalysis(analyzer),
                model_version=MODEL_VERSION, limits=LIMITS, state=ReindexState.load(state_path),
                lock=TEST_LOCK, on_face=interrupt_after_three,
            )  # fmt: skip
        versions = {face_id: (await records.get("tenant-a", face_id)) for face_id in usable}
        assert [r.model_version if r else None for r in versions.values()] == [MODEL_VERSION] + [
            OLD_VERSION
        ] * 4
        assert await gallery.page_ids("tenant-a", None, 100) == (["a0"], None)
        assert set(json.loads(state_path.read_text())["unusable"]) == {"a-missing", "a-noface"}

    asyncio.run(with_stores(enrol_and_interrupt))

    # Second run: the command line resumes (a0 is current; the two unusable faces are listed).
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("MILVUS_URI", milvus_uri)
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FACESEARCH_BLOB_DIR", str(blob_dir))
    monkeypatch.setenv("FACESEARCH_KEY_PREFIX", prefix)
    # As an operator points the command at a running service: its backends and its key.
    monkeypatch.setenv("FACESEARCH_SECRET_KEY", "reindex-test-secret-0123456789abcdef")
    assert cli_main(["reindex", "--tenant", "tenant-a", "--state", str(state_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert (report["faces"], report["reindexed"], report["already_current"]) == (7, 4, 1)
    assert report["unusable"] == {
        "a-missing": "proof image missing",
        "a-noface": "no face found by the current model",
    }
    assert "7/7" in captured.err  # the progress bar reached the end

    async def check(
        records: RedisFaceRecordStore, blobs: LocalBlobStore, gallery: MilvusGalleryStore
    ) -> None:
        assert await gallery.page_ids("tenant-a", None, 100) == (sorted(usable), None)
        for face_id, path in zip(usable, photos, strict=True):
            current = await records.get("tenant-a", face_id)
            assert current is not None and current.model_version == MODEL_VERSION
            # Everything but the version is kept.
            assert (current.client_reference, current.proof_key, current.reference_id) == (
                f"ref-{face_id}", f"proof-{face_id}", face_id,
            )  # fmt: skip
            # A search with the photo itself finds its face first, at cosine ~1.
            pixels = decode_image(path.read_bytes(), LIMITS.max_image_pixels, LIMITS.analysis_max_side).pixels
            probe = largest_face(analyzer.analyze([pixels], True, False)[0])
            assert probe is not None and probe.embedding is not None
            matches = await gallery.search("tenant-a", probe.embedding, 3, -1.0)
            assert matches[0].face_id == face_id
            assert matches[0].similarity == pytest.approx(1.0, abs=1e-3)
        untouched = await records.get("tenant-b", "b0")
        assert untouched is not None and untouched.model_version == OLD_VERSION
        assert probe is not None and probe.embedding is not None
        assert await gallery.search("tenant-b", probe.embedding, 3, -1.0) == []

        # A third run has nothing left to analyse.
        counting = CountingAnalysis(analyzer)
        again = await reindex_tenant(
            "tenant-a", records=records, gallery=gallery, blobs=blobs, analysis=counting,
            model_version=MODEL_VERSION, limits=LIMITS, state=ReindexState.load(state_path), lock=TEST_LOCK,
        )  # fmt: skip
        assert (again.reindexed, again.already_current, counting.calls) == (0, 5, 0)

    asyncio.run(with_stores(check))
