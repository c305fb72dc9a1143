"""Thresholds from the operator's own labelled photos (`facesearch calibrate`).

The photos are analysed as the worker analyses an upload (the service's decoder and limits, the largest
face, the serving face model) and judged by the same quality gate: a photo is a gallery entry only if it
meets the enrolment bar, a probe only if it meets the search bar (a probe below it is searched by the worker
at a ten times lower false-positive rate, so it is left out here and counted).

Comparisons:
- non-mated: every pair of photos of different people that the service could compare, i.e. both meet the
  search bar and at least one the enrolment bar, each pair once. Their similarities measure the
  per-comparison false-match rate FMR(t);
- mated: each person's first photo that meets the enrolment bar is their gallery entry; each of their other
  photos that meets the search bar is a mated probe, compared with it. FNIR(t) is the share of mated probes
  whose mate scores below t (the rank among other candidates is not modelled: at the low FPIRs chosen in
  practice a non-mate above the threshold is rare).

1:N: a search for someone who is not enrolled is compared with all N gallery faces, so the false-positive
identification rate at a gallery of N is FPIR_N(t) = 1 - (1 - FMR(t))^N, the rule the service's default
threshold follows too (models.calibration). The threshold for a target FPIR is the lowest t whose measured
FMR is at most FMR* = 1 - (1 - FPIR)^(1/N). Its 95 % confidence interval is distribution-free: the k-th
highest non-mated similarity, with k between the 2.5 % and 97.5 % quantiles of Binomial(n, FMR*) (n the
non-mated comparisons), brackets the true FMR* quantile; the FPIR at the chosen threshold gets the
Clopper-Pearson interval of its measured FMR. With fewer than MIN_EXCEEDANCES comparisons expected above
the threshold the photos are too few for the target (a warning says how many would do).

Nothing here knows of the command line or the stores: serve_app.launch.calibrate reads the arguments,
loads the models, prints the report and applies the threshold.
"""

from __future__ import annotations

import asyncio
import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.calibration import FaceScoreCalibration
from models.types import largest_face
from serve_app.domain.errors import ServiceError
from serve_app.imaging.decode import decode_image
from serve_app.pipelines.analysis import FaceAnalysisBackend
from serve_app.pipelines.reindex import ImageLimits

CONFIDENCE = 0.95
# Fewer expected non-mated comparisons above the threshold than this and the threshold is imprecise (the
# relative width of its FMR's interval is about 2 / sqrt(k)): the report warns.
MIN_EXCEEDANCES = 10
# The rows of the report's table, besides the target.
REPORT_FPIRS = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001)


class LabelsError(ValueError):
    """The labels file cannot be used; the message says which line and why."""


@dataclass(frozen=True)
class LabelledPhoto:
    file: str  # relative to the photos folder
    identity: str


def read_labels(path: Path) -> list[LabelledPhoto]:
    """The rows of a labels CSV with a header row naming at least `file` and `identity` (other columns are
    ignored, and so are rows whose identity is empty)."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = [name.strip() for name in reader.fieldnames or []]
            if "file" not in columns or "identity" not in columns:
                raise LabelsError(
                    f"{path}: the first row must be a header naming the columns `file` and `identity`; "
                    f"found {columns}"
                )
            reader.fieldnames = columns
            photos: list[LabelledPhoto] = []
            seen: set[str] = set()
            for line, row in enumerate(reader, start=2):
                identity = (row.get("identity") or "").strip()
                if not identity:
                    continue
                file = (row.get("file") or "").strip()
                if not file:
                    raise LabelsError(f"{path}, line {line}: identity {identity!r} has no file")
                if file in seen:
                    raise LabelsError(f"{path}, line {line}: {file} is listed twice")
                seen.add(file)
                photos.append(LabelledPhoto(file, identity))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise LabelsError(f"cannot read {path}: {error}") from error
    if not photos:
        raise LabelsError(f"{path}: no row has an identity")
    return photos


@dataclass(frozen=True)
class MeasuredPhoto:
    """One photo as the service sees it: its largest face's vector and the quality gate's verdicts."""

    file: str
    identity: str
    embedding: np.ndarray | None  # None: no face found, or the file could not be used (problem)
    enrol_ok: bool = False
    search_ok: bool = False
    problem: str | None = None


async def measure_photos(
    photos: Sequence[LabelledPhoto],
    folder: Path,
    analysis: FaceAnalysisBackend,
    limits: ImageLimits,
    *,
    concurrency: int = 2,
    on_photo: Callable[[], None] = lambda: None,
) -> list[MeasuredPhoto]:
    """Every photo through the service's decoder and face analysis, `concurrency` at a time; in order."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(photo: LabelledPhoto) -> MeasuredPhoto:
        async with gate:
            measured = await _measure(photo, folder, analysis, limits)
        on_photo()
        return measured

    return list(await asyncio.gather(*(one(photo) for photo in photos)))


async def _measure(
    photo: LabelledPhoto, folder: Path, analysis: FaceAnalysisBackend, limits: ImageLimits
) -> MeasuredPhoto:
    try:
        data = await asyncio.to_thread((folder / photo.file).read_bytes)
        decoded = await asyncio.to_thread(
            decode_image, data, limits.max_image_pixels, limits.analysis_max_side
        )
    except OSError as error:
        return MeasuredPhoto(photo.file, photo.identity, None, problem=f"unreadable: {error.strerror}")
    except ServiceError as error:
        return MeasuredPhoto(photo.file, photo.identity, None, problem=f"not usable: {error.message}")
    face = largest_face(await analysis.analyze(decoded.pixels, embed=True, estimate_age=False))
    if face is None or face.embedding is None:
        return MeasuredPhoto(photo.file, photo.identity, None, problem="no face found")
    quality = face.quality
    return MeasuredPhoto(
        photo.file,
        photo.identity,
        np.asarray(face.embedding, dtype=np.float32),
        enrol_ok=quality is None or quality.enrol_ok,
        search_ok=quality is None or quality.search_ok,
    )


@dataclass(frozen=True)
class Comparisons:
    """The similarities the service would compute between the photos (see the module's docstring)."""

    nonmated: np.ndarray  # one per pair of photos of different people, highest first
    mated: np.ndarray  # one per mated probe (its similarity to its gallery entry)
    photos: int
    identities: int
    gallery_entries: int  # identities with a photo that meets the enrolment bar
    skipped: dict[str, int] = field(default_factory=dict)  # why photos were left out -> how many
    # The two people of each non-mated comparison (indices into the people compared), in nonmated's order:
    # comparisons that share a person are not independent (look-alikes), so the intervals over people
    # resample people, not comparisons.
    people: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    compared_people: int = 0


def compare(photos: Sequence[MeasuredPhoto]) -> Comparisons:
    skipped = {"no face or unusable file": 0, "below the search bar": 0}
    usable: list[MeasuredPhoto] = []
    for photo in photos:
        if photo.embedding is None:
            skipped["no face or unusable file"] += 1
        elif not photo.search_ok:
            skipped["below the search bar"] += 1
        else:
            usable.append(photo)
    identities = sorted({photo.identity for photo in photos})
    if not usable:
        return Comparisons(np.zeros(0), np.zeros(0), len(photos), len(identities), 0, skipped)
    vectors = np.stack([photo.embedding for photo in usable if photo.embedding is not None]).astype(
        np.float32
    )
    names, person = np.unique([photo.identity for photo in usable], return_inverse=True)
    person = person.astype(np.int32)
    enrol = np.asarray([photo.enrol_ok for photo in usable])
    similarity = vectors @ vectors.T
    first, second = np.triu_indices(len(usable), 1)
    kept = (person[first] != person[second]) & (enrol[first] | enrol[second])
    first, second = first[kept], second[kept]
    nonmated = similarity[first, second]
    order = np.argsort(-nonmated, kind="stable")
    mated: list[float] = []
    entries = 0
    members: dict[int, list[int]] = {}
    for index, who in enumerate(person.tolist()):
        members.setdefault(who, []).append(index)
    for photos_of_one in members.values():
        enrolled = [i for i in photos_of_one if enrol[i]]
        if not enrolled:
            continue
        entries += 1
        mated.extend(float(similarity[enrolled[0], i]) for i in photos_of_one if i != enrolled[0])
    return Comparisons(
        nonmated=nonmated[order].astype(np.float64),
        mated=np.asarray(mated, dtype=np.float64),
        photos=len(photos),
        identities=len(identities),
        gallery_entries=entries,
        skipped=skipped,
        people=(person[first][order], person[second][order]),
        compared_people=len(names),
    )


# ---- binomial statistics -----------------------------------------------------------------------------------


def _log_combinations(n: int, upto: int) -> np.ndarray:
    """log C(n, k) for k = 0..upto."""
    lgamma = np.frompyfunc(math.lgamma, 1, 1)
    k = np.arange(upto + 1, dtype=np.float64)
    return np.asarray(math.lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1), dtype=np.float64)


def _cdf(log_combinations: np.ndarray, n: int, p: float) -> float:
    """P(X <= len(log_combinations) - 1), X ~ Binomial(n, p), 0 < p < 1."""
    k = np.arange(len(log_combinations), dtype=np.float64)
    terms = log_combinations + k * math.log(p) + (n - k) * math.log1p(-p)
    return float(min(1.0, np.exp(terms).sum()))


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    return _cdf(_log_combinations(n, k), n, p)


def binomial_quantile(q: float, n: int, p: float) -> int:
    """The smallest k with P(X <= k) >= q for X ~ Binomial(n, p)."""
    if p <= 0.0 or n == 0:
        return 0
    if p >= 1.0:
        return n
    spread = math.sqrt(n * p * (1.0 - p))
    top = min(n, math.ceil(n * p + 12.0 * spread + 20.0))
    k = np.arange(top + 1, dtype=np.float64)
    terms = _log_combinations(n, top) + k * math.log(p) + (n - k) * math.log1p(-p)
    cumulative = np.cumsum(np.exp(terms))
    return min(top, int(np.searchsorted(cumulative, q, side="left")))


def clopper_pearson(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact two-sided interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    up_to_x = _log_combinations(n, min(successes, n))

    def solve(rising: Callable[[float], float]) -> float:
        # The root of a function rising in p on (0, 1), by bisection in log space (rates span decades).
        low, high = -40.0, 0.0
        for _ in range(100):
            middle = (low + high) / 2
            if rising(10.0**middle) > 0:
                high = middle
            else:
                low = middle
        return float(10.0**high)

    lower = 0.0
    if successes > 0:
        below_x = up_to_x[:-1]  # P(X >= x) = 1 - P(X <= x - 1), rising in p
        lower = solve(lambda p: (1.0 - _cdf(below_x, n, p)) - alpha / 2)
    upper = 1.0
    if successes < n:
        upper = solve(lambda p: alpha / 2 - _cdf(up_to_x, n, p))  # P(X <= x) falls as p grows
    return lower, upper


def fpir_at_gallery(fmr: float, gallery_size: int) -> float:
    """1 - (1 - FMR)^N, exact for small FMR and large N."""
    if fmr >= 1.0:
        return 1.0
    return float(-math.expm1(gallery_size * math.log1p(-fmr)))


def fmr_for_fpir(fpir: float, gallery_size: int) -> float:
    return float(-math.expm1(math.log1p(-fpir) / max(1, gallery_size)))


# ---- the report --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperatingPoint:
    """One threshold of the table, for a target FPIR at the stated gallery size."""

    target_fpir: float
    target_fmr: float  # per comparison
    measurable: bool  # at least one non-mated comparison is expected above it
    cosine: float  # the threshold (similarity); the highest non-mated one seen when not measurable
    score: float | None  # the same threshold on the service's score scale (None: no score table)
    false_matches: int  # non-mated comparisons at or above it
    fmr: float
    fpir: float  # measured FMR carried to the gallery size
    # Clopper-Pearson on the FMR (comparisons taken as independent), carried to the gallery size.
    fpir_interval: tuple[float, float]
    fnir: float  # mated probes below it
    misses: int


@dataclass(frozen=True)
class PeopleInterval:
    """Intervals from resampling the people compared (see people_intervals)."""

    cosine: tuple[float, float]  # of the threshold for the target
    fmr: tuple[float, float]  # of the FMR at the chosen threshold
    fpir: tuple[float, float]  # that FMR carried to the gallery size


@dataclass(frozen=True)
class CalibrationReport:
    model_version: str
    gallery_size: int
    gallery_size_stated: bool  # False: the number of gallery entries among the photos was used
    confidence: float
    comparisons: Comparisons
    target: OperatingPoint
    # The interval of the threshold for the target from the number of non-mated comparisons, as
    # similarities and as scores (None: no score table).
    cosine_interval: tuple[float, float]
    score_interval: tuple[float, float] | None
    # The same from resampling people (wider when look-alike people make many comparisons each); None when
    # the comparisons do not say whose they are.
    people: PeopleInterval | None
    people_score_interval: tuple[float, float] | None
    table: tuple[OperatingPoint, ...]
    warnings: tuple[str, ...]


def operating_point(
    comparisons: Comparisons,
    target_fpir: float,
    gallery_size: int,
    scores: FaceScoreCalibration | None,
    confidence: float = CONFIDENCE,
) -> OperatingPoint:
    nonmated, n = comparisons.nonmated, len(comparisons.nonmated)
    target_fmr = fmr_for_fpir(target_fpir, gallery_size)
    allowed = math.floor(target_fmr * n)
    measurable = target_fmr * n >= 1.0
    if n == 0:
        cosine = 1.0
    elif allowed >= n:
        cosine = float(nonmated[-1])
    else:
        # Just above the (allowed + 1)-th highest: exactly `allowed` comparisons (fewer with ties) reach it.
        cosine = float(np.nextafter(nonmated[allowed], np.inf))
    false_matches = int(np.count_nonzero(nonmated >= cosine))
    fmr = false_matches / n if n else 0.0
    low, high = clopper_pearson(false_matches, n, confidence)
    mated = comparisons.mated
    misses = int(np.count_nonzero(mated < cosine))
    return OperatingPoint(
        target_fpir=target_fpir,
        target_fmr=target_fmr,
        measurable=measurable,
        cosine=cosine,
        score=_score(scores, cosine),
        false_matches=false_matches,
        fmr=fmr,
        fpir=fpir_at_gallery(fmr, gallery_size),
        fpir_interval=(fpir_at_gallery(low, gallery_size), fpir_at_gallery(high, gallery_size)),
        fnir=misses / len(mated) if len(mated) else float("nan"),
        misses=misses,
    )


def _score(scores: FaceScoreCalibration | None, cosine: float) -> float | None:
    """The score the service reports for this similarity, rounded up at the sixth decimal (the bar a
    min_score of that value sets is then never below the similarity)."""
    if scores is None:
        return None
    return min(1.0, math.ceil(scores.score(cosine) * 1e6) / 1e6)


def _just_above(nonmated: np.ndarray, rank: int) -> float:
    """The threshold that the `rank` highest comparisons reach and the next does not."""
    return float(np.nextafter(nonmated[rank], np.inf)) if rank < len(nonmated) else float(nonmated[-1])


def threshold_interval(
    comparisons: Comparisons, target_fmr: float, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """The interval of the similarity whose true FMR is target_fmr, from the number of non-mated
    comparisons (distribution-free: order statistics at the binomial quantiles of the number of
    comparisons above it)."""
    nonmated, n = comparisons.nonmated, len(comparisons.nonmated)
    if n == 0:
        return 1.0, 1.0
    alpha = 1.0 - confidence
    fewest = binomial_quantile(alpha / 2, n, target_fmr)
    most = binomial_quantile(1.0 - alpha / 2, n, target_fmr)
    return _just_above(nonmated, most), _just_above(nonmated, fewest)


# Resampling people: enough resamples for a 95 % interval; a fixed seed, so the same photos give the same
# report every time.
PEOPLE_RESAMPLES = 400
PEOPLE_SEED = 20261129


def people_intervals(
    comparisons: Comparisons,
    target_fmr: float,
    threshold: float,
    gallery_size: int,
    confidence: float = CONFIDENCE,
) -> PeopleInterval | None:
    """Intervals that count people, not comparisons: the comparisons of one look-alike pair of people rise
    and fall together, so the binomial interval (which takes every comparison as independent) is too
    narrow when the photos hold few people. The people compared are drawn again with replacement
    (PEOPLE_RESAMPLES times); a comparison of people a and b then counts count(a) * count(b) times. Each
    draw gives a threshold for the target and an FMR at the chosen threshold; the interval is their
    central `confidence` share (with 400 draws, a confidence above 0.995 reads the extremes). None when the
    comparisons do not say whose they are."""
    nonmated, n = comparisons.nonmated, len(comparisons.nonmated)
    if n == 0 or comparisons.compared_people < 2 or len(comparisons.people[0]) != n:
        return None
    first, second = comparisons.people
    rng = np.random.default_rng(PEOPLE_SEED)
    people = comparisons.compared_people
    above = int(np.count_nonzero(nonmated >= threshold))  # the highest `above` comparisons (sorted)
    thresholds, fmrs = [], []
    for _ in range(PEOPLE_RESAMPLES):
        drawn = rng.multinomial(people, np.full(people, 1.0 / people)).astype(np.float64)
        weight = drawn[first] * drawn[second]
        cumulative = np.cumsum(weight)
        total = float(cumulative[-1])
        if total <= 0.0:
            continue
        allowed = int(np.searchsorted(cumulative, target_fmr * total, side="right"))
        thresholds.append(_just_above(nonmated, allowed))
        fmrs.append(float(cumulative[above - 1]) / total if above else 0.0)
    alpha = 1.0 - confidence
    quantiles = [alpha / 2, 1.0 - alpha / 2]
    low, high = (float(v) for v in np.quantile(fmrs, quantiles))
    cosine_low, cosine_high = (float(v) for v in np.quantile(thresholds, quantiles))
    return PeopleInterval(
        cosine=(cosine_low, cosine_high),
        fmr=(low, high),
        fpir=(fpir_at_gallery(low, gallery_size), fpir_at_gallery(high, gallery_size)),
    )


def calibrate(
    comparisons: Comparisons,
    target_fpir: float,
    gallery_size: int | None,
    model_version: str,
    scores: FaceScoreCalibration | None,
    confidence: float = CONFIDENCE,
) -> CalibrationReport:
    if not 0.0 < target_fpir < 1.0:
        raise ValueError(f"the target FPIR must lie in (0, 1), got {target_fpir}")
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"the confidence must lie in [0.5, 1), got {confidence}")
    stated = gallery_size is not None
    size = gallery_size if gallery_size is not None else max(1, comparisons.gallery_entries)
    if size < 1:
        raise ValueError(f"the gallery size must be at least 1, got {size}")
    target = operating_point(comparisons, target_fpir, size, scores, confidence)
    low, high = threshold_interval(comparisons, target.target_fmr, confidence)
    people = people_intervals(comparisons, target.target_fmr, target.cosine, size, confidence)
    table = tuple(
        operating_point(comparisons, fpir, size, scores, confidence)
        for fpir in sorted({*REPORT_FPIRS, target_fpir}, reverse=True)
    )
    return CalibrationReport(
        model_version=model_version,
        gallery_size=size,
        gallery_size_stated=stated,
        confidence=confidence,
        comparisons=comparisons,
        target=target,
        cosine_interval=(low, high),
        score_interval=_scores(scores, (low, high)),
        people=people,
        people_score_interval=_scores(scores, people.cosine) if people is not None else None,
        table=table,
        warnings=tuple(_warnings(comparisons, target, size, people)),
    )


def _scores(scores: FaceScoreCalibration | None, cosines: tuple[float, float]) -> tuple[float, float] | None:
    if scores is None:
        return None
    return (_score(scores, cosines[0]) or 0.0, _score(scores, cosines[1]) or 0.0)


def photos_for(comparisons_needed: float) -> int:
    """Photos of different people whose pairs number at least comparisons_needed."""
    return math.ceil((1.0 + math.sqrt(1.0 + 8.0 * comparisons_needed)) / 2.0)


def _warnings(
    comparisons: Comparisons, target: OperatingPoint, gallery_size: int, people: PeopleInterval | None
) -> list[str]:
    notes: list[str] = []
    n = len(comparisons.nonmated)
    expected = target.target_fmr * n
    needed = MIN_EXCEEDANCES / target.target_fmr
    if expected < 1.0:
        notes.append(
            f"too few photos for the target: FPIR {target.target_fpir:g} at a gallery of {gallery_size:,} "
            f"needs a per-comparison false-match rate of {target.target_fmr:.2g}, and {n:,} comparisons of "
            f"different people cannot measure it. The threshold given is the highest such comparison seen; "
            f"with 95 % confidence it holds FPIR <= {target.fpir_interval[1]:.2g}. Measuring the target "
            f"needs about {needed:,.0f} comparisons (for instance {photos_for(needed):,} photos of "
            f"different people), or state a smaller gallery or a larger FPIR."
        )
    elif expected < MIN_EXCEEDANCES:
        notes.append(
            f"few photos for the target: about {expected:.1f} comparisons of different people are expected "
            f"above the threshold ({n:,} in all), so it is imprecise (see its interval); about "
            f"{needed:,.0f} comparisons (for instance {photos_for(needed):,} photos of different people) "
            f"would measure it to within a factor of about 1.6."
        )
    elif people is not None and people.fmr[1] > 2.0 * target.target_fmr:
        notes.append(
            f"few people for the target: the comparisons above the threshold come from few pairs of "
            f"people, so over people the FMR at it could be up to {people.fmr[1]:.2g} (FPIR "
            f"{people.fpir[1]:.2g}); photos of more people narrow it"
        )
    if len(comparisons.mated) < 30:
        notes.append(
            f"only {len(comparisons.mated)} mated probes (second photos of enrolled people): the FNIR is "
            "a rough figure"
        )
    return notes
