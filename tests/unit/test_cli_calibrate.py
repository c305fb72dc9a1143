"""`facesearch calibrate`'s refusals, which come before any photo is analysed (the command's runs on real
photos and a running service are tests/integration/test_calibrate_service.py and
test_operator_face_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.launch.cli import main


@pytest.fixture
def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.csv"
    path.write_text("file,identity\na.jpg,A\n")
    return path


@pytest.fixture
def no_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDIS_URL", "MILVUS_URI", "FACESEARCH_SECRET_KEY", "FACESEARCH_SECRET_KEYS"):
        monkeypatch.delenv(name, raising=False)
    for name in ("PATH", "SHA256", "DIM", "SCORES"):
        monkeypatch.delenv(f"FACESEARCH_FACE_MODEL_{name}", raising=False)
    monkeypatch.setenv("FACESEARCH_DATA_DIR", str(tmp_path / "no-service-here"))


@pytest.mark.usefixtures("no_service")
def test_apply_without_a_running_service_stops_before_the_analysis(
    labels: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", str(labels), "--photos", str(tmp_path), "--apply", "default"]) == 2
    err = capsys.readouterr().err
    assert "facesearch calibrate: no running facesearch service found" in err
    assert "calibrate:" in err and err.count("facesearch calibrate:") == 1


@pytest.mark.usefixtures("no_service")
def test_bad_arguments_are_refused_by_name(
    labels: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photos = ["--photos", str(tmp_path)]
    assert main(["calibrate", str(labels), *photos, "--target-fpir", "1.5"]) == 2
    assert "--target-fpir must lie in (0, 1)" in capsys.readouterr().err
    assert main(["calibrate", str(labels), *photos, "--gallery-size", "0"]) == 2
    assert "--gallery-size must be at least 1" in capsys.readouterr().err
    assert main(["calibrate", str(labels), *photos, "--write-scores", str(tmp_path / "t.json")]) == 2
    assert "--write-scores is for a face model you bring" in capsys.readouterr().err
    headerless = tmp_path / "headerless.csv"
    headerless.write_text("a.jpg,A\n")
    assert main(["calibrate", str(headerless), *photos]) == 2
    assert "`file` and `identity`" in capsys.readouterr().err
