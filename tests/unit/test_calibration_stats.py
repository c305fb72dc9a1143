"""The statistics behind `facesearch calibrate` (serve_app/pipelines/calibration.py), on labels and
similarities made here: which comparisons the quality gate admits, the threshold for a target FPIR at a
gallery size, its confidence interval, and the warnings when the photos are too few."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from models.calibration import FaceScoreCalibration
from serve_app.pipelines.calibration import (
    Comparisons,
    LabelsError,
    MeasuredPhoto,
    binomial_cdf,
    binomial_quantile,
    calibrate,
    clopper_pearson,
    compare,
    fmr_for_fpir,
    fpir_at_gallery,
    read_labels,
    threshold_interval,
)


def test_labels_need_file_and_identity_and_skip_rows_without_an_identity(tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text(
        "file,identity,age,notes\n"
        "a1.jpg,Alice,30,x\n"
        "b1.jpg,Bob,,\n"
        "age_1.jpg,,12,an age photo without an identity\n"
        "a2.jpg, Alice ,,\n"
    )
    assert [(p.file, p.identity) for p in read_labels(labels)] == [
        ("a1.jpg", "Alice"),
        ("b1.jpg", "Bob"),
        ("a2.jpg", "Alice"),
    ]
    headerless = tmp_path / "headerless.csv"
    headerless.write_text("a1.jpg,Alice\nb1.jpg,Bob\n")
    with pytest.raises(LabelsError, match="header naming the columns `file` and `identity`"):
        read_labels(headerless)
    twice = tmp_path / "twice.csv"
    twice.write_text("file,identity\na1.jpg,Alice\na1.jpg,Bob\n")
    with pytest.raises(LabelsError, match=r"line 3: a1\.jpg is listed twice"):
        read_labels(twice)
    no_file = tmp_path / "no_file.csv"
    no_file.write_text("file,identity\n,Alice\n")
    with pytest.raises(LabelsError, match="line 2"):
        read_labels(no_file)
    empty = tmp_path / "empty.csv"
    empty.write_text("file,identity\nx.jpg,\n")
    with pytest.raises(LabelsError, match="no row has an identity"):
        read_labels(empty)


def _unit(*values: float) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_the_quality_gate_decides_which_pairs_count() -> None:
    """Non-mated: pairs of different people that both meet the search bar, one at least the enrolment bar,
    each once. Mated: each person's first enrolable photo is their entry, their other searchable photos are
    probes."""
    photos = [
        MeasuredPhoto("a1", "A", _unit(1, 0, 0), enrol_ok=False, search_ok=True),  # searchable only
        MeasuredPhoto("a2", "A", _unit(1, 0.1, 0), enrol_ok=True, search_ok=True),  # A's entry
        MeasuredPhoto("a3", "A", _unit(1, 0.2, 0), enrol_ok=True, search_ok=True),
        MeasuredPhoto("b1", "B", _unit(0, 1, 0), enrol_ok=True, search_ok=True),  # B's entry
        MeasuredPhoto("b2", "B", _unit(0, 1, 0.1), enrol_ok=False, search_ok=False),  # below the search bar
        MeasuredPhoto("c1", "C", _unit(0, 0, 1), enrol_ok=False, search_ok=True),  # C cannot be enrolled
        MeasuredPhoto("d1", "D", None, problem="no face found"),
    ]
    found = compare(photos)
    assert (found.photos, found.identities, found.gallery_entries) == (7, 4, 2)
    assert found.skipped == {"no face or unusable file": 1, "below the search bar": 1}
    # a1-b1, a2-b1, a3-b1, a2-c1, a3-c1, b1-c1; a1-c1 is not (neither could be enrolled).
    assert len(found.nonmated) == 6
    assert list(found.nonmated) == sorted(found.nonmated, reverse=True)
    # A's entry is a2: probes a1 and a3. B's only other photo is below the search bar; C has no entry.
    expected = sorted([float(_unit(1, 0.1, 0) @ _unit(1, 0, 0)), float(_unit(1, 0.1, 0) @ _unit(1, 0.2, 0))])
    assert sorted(found.mated) == pytest.approx(expected)


def test_binomial_helpers_agree_with_known_values() -> None:
    assert binomial_cdf(3, 10, 0.5) == pytest.approx(176 / 1024)
    assert binomial_cdf(10, 10, 0.3) == 1.0 and binomial_cdf(-1, 10, 0.3) == 0.0
    # Clopper-Pearson: no success in 100 gives the upper bound 1 - 0.025^(1/100); 5 in 100 as tabulated.
    none_low, none_high = clopper_pearson(0, 100)
    assert none_low == 0.0 and none_high == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-6)
    low, high = clopper_pearson(5, 100)
    assert low == pytest.approx(0.01643, abs=1e-5) and high == pytest.approx(0.11284, abs=1e-5)
    # Quantiles bracket the mean of a Poisson-like count.
    assert binomial_quantile(0.5, 1_000_000, 1e-5) == 10
    assert binomial_quantile(0.025, 1_000_000, 1e-5) < 10 < binomial_quantile(0.975, 1_000_000, 1e-5)
    # The 1:N rule and its inverse.
    fmr = fmr_for_fpir(0.01, 1000)
    assert fpir_at_gallery(fmr, 1000) == pytest.approx(0.01, rel=1e-9)
    assert fmr == pytest.approx(1.005e-5, rel=1e-3)


def _comparisons(nonmated: np.ndarray, mated: np.ndarray, entries: int = 100) -> Comparisons:
    return Comparisons(np.sort(nonmated)[::-1], mated, photos=0, identities=entries, gallery_entries=entries)


def test_the_threshold_meets_the_target_with_an_interval_that_holds_the_true_one() -> None:
    """Similarities drawn from a known law, so the threshold that truly gives the target is known: for
    non-mated similarities uniform on [0, 1], FMR(t) = 1 - t."""
    rng = np.random.default_rng(7)
    nonmated = rng.uniform(0.0, 1.0, 200_000)
    mated = rng.uniform(0.9, 1.0, 500)
    report = calibrate(_comparisons(nonmated, mated), 0.01, 100, "test", None)
    target = report.target
    true_threshold = 1.0 - fmr_for_fpir(0.01, 100)
    assert target.target_fmr == pytest.approx(fmr_for_fpir(0.01, 100))
    assert target.measurable and target.false_matches <= math.floor(target.target_fmr * len(nonmated))
    low, high = report.cosine_interval
    assert low <= true_threshold <= high
    assert low < target.cosine < high
    assert target.fpir <= 0.01 + 1e-12
    assert target.fpir_interval[0] <= 0.01 <= target.fpir_interval[1]
    assert target.fnir == pytest.approx(np.mean(mated < target.cosine))
    assert report.warnings == ()
    # The table runs from loose to strict thresholds and includes the target.
    assert [point.target_fpir for point in report.table] == sorted(
        {0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001}, reverse=True
    )
    assert [point.cosine for point in report.table] == sorted(point.cosine for point in report.table)


def test_the_interval_covers_the_true_threshold_as_often_as_it_says() -> None:
    """95 % intervals over 200 independent samples: coverage near 95 % (a binomial check at a generous
    margin, so the fixed seed can only fail if the interval is wrong)."""
    rng = np.random.default_rng(11)
    fpir, gallery = 0.05, 20
    truth = 1.0 - fmr_for_fpir(fpir, gallery)
    covered = 0
    for _ in range(200):
        comparisons = _comparisons(rng.uniform(0, 1, 5_000), np.ones(50))
        low, high = threshold_interval(comparisons, fmr_for_fpir(fpir, gallery))
        covered += low <= truth <= high
    assert binomial_quantile(0.0005, 200, 0.95) <= covered <= 200


def test_too_few_photos_for_the_target_are_said_and_the_threshold_is_the_highest_seen() -> None:
    rng = np.random.default_rng(3)
    nonmated = rng.uniform(0, 1, 400)
    report = calibrate(_comparisons(nonmated, np.ones(40)), 0.01, 10_000, "t", None)
    assert not report.target.measurable
    assert report.target.cosine == pytest.approx(float(np.nextafter(nonmated.max(), np.inf)))
    assert report.target.false_matches == 0
    assert any("too few photos for the target" in warning for warning in report.warnings)
    # The upper bound it states is the Clopper-Pearson bound of no false match in 400, at the gallery size.
    assert report.target.fpir_interval[1] == pytest.approx(
        fpir_at_gallery(clopper_pearson(0, 400)[1], 10_000)
    )

    imprecise = calibrate(_comparisons(rng.uniform(0, 1, 2_000), np.ones(40)), 0.01, 10, "t", None)
    assert imprecise.target.measurable
    assert any("few photos for the target" in warning for warning in imprecise.warnings)
    few_mates = calibrate(_comparisons(rng.uniform(0, 1, 100_000), np.ones(5)), 0.01, 10, "t", None)
    assert [w for w in few_mates.warnings if "mated probes" in w]


def test_thresholds_are_given_on_the_services_score_scale() -> None:
    """With a score table, the threshold is the score the service reports for that similarity, rounded up:
    a min_score of that value never admits a lower similarity."""
    table = FaceScoreCalibration.load()
    rng = np.random.default_rng(5)
    nonmated = rng.normal(0.3, 0.12, 100_000)
    report = calibrate(_comparisons(nonmated, rng.normal(0.85, 0.05, 300)), 0.01, 50, "t", table)
    target = report.target
    assert target.score is not None and report.score_interval is not None
    assert target.score == pytest.approx(table.score(target.cosine), abs=1e-6)
    assert table.cosine_for_score(target.score) >= target.cosine - 1e-9
    low, high = report.score_interval
    assert low <= target.score <= high
    with pytest.raises(ValueError, match="target FPIR"):
        calibrate(_comparisons(nonmated, np.ones(3)), 1.5, 50, "t", table)


def _people(photos_per_person: int, people: int, look_alike_pairs: int, seed: int) -> list[MeasuredPhoto]:
    """Random unit vectors per person (photos close to their person's centre); the first look_alike_pairs
    pairs of people share most of their centre, so all their cross comparisons score high together."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(people, 64))
    for pair in range(look_alike_pairs):
        centres[2 * pair + 1] = centres[2 * pair] + 0.35 * rng.normal(size=64)
    photos = []
    for person in range(people):
        for photo in range(photos_per_person):
            vector = centres[person] + 0.3 * rng.normal(size=64)
            photos.append(
                MeasuredPhoto(
                    f"p{person}-{photo}", f"person-{person}", _unit(*vector), enrol_ok=True, search_ok=True
                )
            )
    return photos


def test_the_interval_over_people_widens_when_comparisons_share_people() -> None:
    """Six photos a person and a few look-alike pairs: the comparisons above the threshold come from few
    pairs of people, and the interval over people says so, far wider than the binomial one (which takes
    the 36 comparisons of one pair of people as 36 independent ones); with one photo a person and no
    look-alikes the two are much closer."""

    def widening(photos: list[MeasuredPhoto]) -> float:
        report = calibrate(compare(photos), 0.2, 10, "t", None)
        assert report.people is not None
        assert report.people.cosine[0] <= report.target.cosine <= report.people.cosine[1]
        assert report.people.fmr[0] <= report.target.fmr <= report.people.fmr[1]
        low, high = report.cosine_interval
        return (report.people.cosine[1] - report.people.cosine[0]) / (high - low)

    clustered = widening(_people(photos_per_person=6, people=60, look_alike_pairs=5, seed=1))
    alone = widening(_people(photos_per_person=1, people=400, look_alike_pairs=0, seed=2))
    assert clustered > 2 * alone
