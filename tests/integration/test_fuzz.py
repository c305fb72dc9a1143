"""Fuzzing the running application.

1. Schemathesis generates requests from the service's own /openapi.json (positive and negative data for
   every documented operation) and checks the answers against the same document.
2. A hypothesis fuzzer sends what schemathesis cannot make: real photos, truncated and bit-flipped images,
   images claiming huge dimensions or carrying broken EXIF, odd data-URI subtypes and file names, odd flag
   values, and forged proof tokens.

Every generated request carries a real client's bearer token. Whatever the input, the service must never
answer 5xx, and every 4xx body must be the common envelope {"status": false, "message", "errors"}.

Requests come from a second loopback address (127.0.0.2 where it can be bound), so the failed logins that
fuzzing /request-access-token produces throttle that address only, never the 127.0.0.1 the rest of the
session logs in from; the counters are reset afterwards either way.

FACESEARCH_FUZZ_EXAMPLES (default 40) sets the examples per operation and mode,
FACESEARCH_FUZZ_REALISTIC_EXAMPLES (default 40) those of the realistic fuzzer. The seed is fixed (see
tests/integration/fuzz_seed.py): `make fuzz-random` draws a new one, and FACESEARCH_FUZZ_SEED=<seed>
replays a run (the seed is printed with each test's summary, and named in every failure).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from PIL import Image
from requests.adapters import HTTPAdapter
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serve_app.api.tokens import TokenSigner
from tests.faces_dev import FacesDev
from tests.integration.fuzz_seed import fuzz_seed
from tests.service_harness import RunningService

pytestmark = pytest.mark.service

EXAMPLES = int(os.environ.get("FACESEARCH_FUZZ_EXAMPLES", "40"))
SEED = fuzz_seed()
FUZZ_SOURCE_ADDRESS = "127.0.0.2"
REQUEST_TIMEOUT_S = 30.0

# Every operation the document must describe; a new one fails test_openapi_schema_is_valid until it is
# added here, so nothing escapes the fuzzer unnoticed.
OPERATIONS: tuple[tuple[str, str], ...] = (
    ("POST", "/request-access-token"),
    ("POST", "/face-search"),
    ("POST", "/age-estimation"),
    ("POST", "/result"),
    ("GET", "/get-proof/{proof_token}"),
    # The gallery management extension (serve_app/api/routes/gallery.py).
    ("GET", "/gallery/faces"),
    ("DELETE", "/gallery/faces/{face_id}"),
    ("POST", "/gallery/erasures"),
    ("GET", "/gallery/stats"),
    ("GET", "/gallery/audit"),
    # The webhook extension (serve_app/api/routes/webhooks.py).
    ("GET", "/webhook"),
    ("PUT", "/webhook"),
    ("DELETE", "/webhook"),
    ("POST", "/webhook/secret"),
    ("GET", "/webhook/deliveries"),
    ("POST", "/webhook/events/{event_id}/redeliver"),
)
# Operations with no input at all: one request is all there is, and no negative data exists.
NO_INPUT = {
    ("GET", "/gallery/stats"),
    ("GET", "/webhook"),
    ("DELETE", "/webhook"),
    ("POST", "/webhook/secret"),
}
WEBHOOK = {"/webhook", "/webhook/secret", "/webhook/deliveries", "/webhook/events/{event_id}/redeliver"}
GALLERY = {
    "/gallery/faces",
    "/gallery/faces/{face_id}",
    "/gallery/erasures",
    "/gallery/stats",
    "/gallery/audit",
}
# With a valid bearer token these can answer neither 401 nor 429 (6000 requests/minute per client).
AUTHENTICATED = {"/face-search", "/age-estimation", "/result", *GALLERY, *WEBHOOK}

# positive_data_acceptance is left out on purpose: schema-valid requests are refused by rules JSON Schema
# cannot state (the bytes must decode as a JPEG/PNG, an upload needs a .jpg/.jpeg/.png name, an unknown
# reference_id is 422 by the interface). Every other response check schemathesis has for single requests
# runs; the stateful ones (use_after_free, ignored_auth, ...) need links or security schemes.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# Multipart fields carry no types: schemathesis' negative values often serialize to the same parts as valid
# ones (integer 0 and string "0" are both the part "0"; an empty array sends no part, i.e. "absent"), so
# negative_data_rejection would flag accepted requests that were in fact valid. Multipart negative cases
# keep every other check; test_realistic_bodies asserts the multipart rules (e.g. repeated fields -> 422).
MULTIPART_CHECKS = [check for check in CHECKS if check is not negative_data_rejection]


def fuzz_settings(examples: int = EXAMPLES) -> Callable[[Any], Any]:
    """Bounded, no shrinking (each example is a request to a live service), no example database."""

    def apply(test: Any) -> Any:
        configured = settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(test)
        return seed(SEED)(configured)

    return apply


def fuzz_source_address() -> str:
    try:
        with socket.socket() as probe:
            probe.bind((FUZZ_SOURCE_ADDRESS, 0))
    except OSError:
        return "127.0.0.1"
    return FUZZ_SOURCE_ADDRESS


class SourceAddressAdapter(HTTPAdapter):
    def __init__(self, source_address: str) -> None:
        self._source_address = source_address
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = (self._source_address, 0)
        super().init_poolmanager(*args, **kwargs)


def error_envelope_problem(body: object) -> str | None:
    """None when body is {"status": false, "message": non-empty str, "errors": {str: str}}."""
    if not isinstance(body, dict) or set(body) != {"status", "message", "errors"}:
        return f"not the error envelope: {body!r:.300}"
    if body["status"] is not False:
        return "status is not false"
    if not isinstance(body["message"], str) or not body["message"]:
        return "message is not a non-empty string"
    errors = body["errors"]
    if not isinstance(errors, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in errors.items()
    ):
        return f"errors is not an object of strings: {errors!r:.300}"
    return None


@dataclass
class FuzzLog:
    """Status codes seen and distinct problems found; asserted once all examples ran."""

    label: str
    statuses: Counter[int] = field(default_factory=Counter)
    messages: Counter[str] = field(default_factory=Counter)
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def problem(self, key: str, detail: str) -> None:
        self.problems.setdefault(key, detail)

    def check_status_and_body(self, path: str, status: int, content_type: str, text: str) -> None:
        self.statuses[status] += 1
        if status >= 500:
            self.problem(f"{status}", text[:300])
        if path in AUTHENTICATED and status in (401, 429):
            self.problem(f"{status} with a valid token", text[:300])
        if 400 <= status < 500:
            if not content_type.startswith("application/json"):
                self.problem(f"{status} content-type {content_type}", text[:300])
                return
            try:
                body = json.loads(text)
            except ValueError:
                self.problem(f"{status} body is not JSON", text[:300])
                return
            if (issue := error_envelope_problem(body)) is not None:
                self.problem(f"{status} {issue}", text[:300])
            else:
                self.messages[f"{status} {body['message']}"] += 1

    def assert_clean(self, minimum_requests: int) -> None:
        statuses = dict(sorted(self.statuses.items()))
        print(f"{self.label} (seed {SEED}): {self.requests} requests, statuses {statuses}")
        for message, count in self.messages.most_common(4):
            print(f"    {count:3d} x {message[:100]}")
        details = "\n".join(f"- {key}: {detail}" for key, detail in self.problems.items())
        assert not self.problems, f"{self.label} (seed {SEED}):\n{details}"
        assert self.requests >= minimum_requests, f"{self.label}: only {self.requests} requests were sent"


@dataclass(frozen=True)
class FuzzTarget:
    base_url: str
    token: str
    source_address: str
    signer: TokenSigner
    tenant_id: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def target(service: RunningService) -> Iterator[FuzzTarget]:
    client = service.new_client("fuzz")
    source = fuzz_source_address()
    settings_ = service.settings
    yield FuzzTarget(
        base_url=service.base_url,
        token=service.token_for(client),
        source_address=source,
        signer=TokenSigner(
            settings_.auth.key_ring(), settings_.auth.access_token_ttl_s, settings_.auth.proof_ttl_s
        ),
        tenant_id=client.client_id,
    )
    from serve_app.pipelines.auth import unauthenticated_key
    from serve_app.wiring.stores import redis_stores

    async def forget_failed_logins() -> None:
        await redis_stores(settings_).limiter.reset(unauthenticated_key(source))

    asyncio.run(forget_failed_logins())


@pytest.fixture(scope="module")
def session(target: FuzzTarget) -> Iterator[requests.Session]:
    with requests.Session() as http:
        http.mount("http://", SourceAddressAdapter(target.source_address))
        yield http


@pytest.fixture(scope="module")
def http(target: FuzzTarget) -> Iterator[httpx.Client]:
    transport = httpx.HTTPTransport(local_address=target.source_address)
    with httpx.Client(base_url=target.base_url, transport=transport, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def api_schema(target: FuzzTarget) -> Any:
    return schemathesis.openapi.from_url(f"{target.base_url}/openapi.json", timeout=REQUEST_TIMEOUT_S)


def test_openapi_schema_is_valid(api_schema: Any) -> None:
    api_schema.validate()  # raises on a document that breaks the OpenAPI 3.1 meta-schema
    assert api_schema.iter_schema_warnings() == []
    labels = set()
    for result in api_schema.get_all_operations():
        labels.add(result.ok().label)  # ok() raises on an operation schemathesis cannot use
    assert labels == {f"{method} {path}" for method, path in OPERATIONS}


def run_case(case: Any, session: requests.Session, target: FuzzTarget, log: FuzzLog) -> None:
    response = case.call(
        base_url=target.base_url, session=session, headers=target.auth, timeout=REQUEST_TIMEOUT_S
    )
    content_type = ",".join(response.headers.get("content-type", []))  # schemathesis: name -> [values]
    log.check_status_and_body(case.operation.path, response.status_code, content_type, response.text)
    try:
        checks = MULTIPART_CHECKS if case.media_type == "multipart/form-data" else CHECKS
        case.validate_response(response, checks=checks, headers=target.auth)
    except BaseExceptionGroup as group:  # schemathesis' FailureGroup, one exception per failed check
        curl = case.as_curl_command(headers={"Authorization": "Bearer <token>"}, base_url=target.base_url)
        for failure in group.exceptions:
            # The message names the check and what broke (e.g. the violated schema keyword): one entry
            # per distinct message, with a curl command reproducing its first occurrence.
            log.problem(f"{response.status_code} {failure}", curl)


FUZZ_CASES = [
    (method, path, mode)
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if not ((method, path) in NO_INPUT and mode is GenerationMode.NEGATIVE)
]


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    FUZZ_CASES,
    ids=[f"{method} {path}-{mode.value}" for method, path, mode in FUZZ_CASES],
)
def test_schemathesis(
    api_schema: Any,
    session: requests.Session,
    target: FuzzTarget,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    operation = api_schema[path][method]
    log = FuzzLog(f"{operation.label} [{mode.value}]")
    if path == "/get-proof/{proof_token}" and mode is GenerationMode.NEGATIVE:
        # Any string is a schema-valid path segment, so schemathesis has no negative data here (hypothesis
        # says Unsatisfiable); forged proof tokens take their place.
        strategy = forged_proof_tokens(target).map(
            lambda token: operation.Case(path_parameters={"proof_token": token})
        )
    else:
        strategy = operation.as_strategy(generation_mode=mode)

    @fuzz_settings()
    @given(case=strategy)
    def fuzz(case: Any) -> None:
        run_case(case, session, target, log)

    fuzz()
    log.assert_clean(minimum_requests=1 if (method, path) in NO_INPUT else min(10, EXAMPLES))
    if path == "/get-proof/{proof_token}":
        # Random strings and forged tokens never open a proof: 404, or 410 for a genuine expired token.
        assert set(log.statuses) <= {404, 410}, log.statuses


def forged_proof_tokens(target: FuzzTarget) -> st.SearchStrategy[str]:
    signer, tenant = target.signer, target.tenant_id
    past = time.time() - 2 * signer.proof_ttl_s
    unknown_face = signer.issue_proof(tenant, "0" * 32)
    signed_with_other_key = TokenSigner("not-the-service-secret", 60, 60).issue_proof(tenant, "0" * 32)
    unsigned = jwt.encode(
        {"typ": "proof", "ten": tenant, "fid": "0" * 32, "exp": 2**40}, key="", algorithm="none"
    )
    genuine = st.sampled_from(
        [
            unknown_face,
            signer.issue_proof(tenant, "0" * 32, now=past),
            target.token,
            signed_with_other_key,
            unsigned,
        ]
    )

    @st.composite
    def tampered(draw: st.DrawFn) -> str:
        token = draw(genuine)
        index = draw(st.integers(0, len(token) - 1))
        replacement = draw(st.sampled_from("AZaz09-_.~%/"))
        return token[:index] + replacement + token[index + 1 :]

    return st.one_of(genuine, tampered(), st.text(min_size=1, max_size=400))


# --- realistic bodies ------------------------------------------------------------------------------------

REALISTIC_EXAMPLES = int(os.environ.get("FACESEARCH_FUZZ_REALISTIC_EXAMPLES", "40"))
FINAL_WITHIN_S = 60.0


def mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """valid about three times in four, so most requests get past validation and reach the pipeline.
    Hypothesis favours the smallest draws, so the small picks are the valid ones."""
    return st.integers(0, 99).flatmap(lambda pick: valid if pick < 75 else odd)


def encode(image: Image.Image, fmt: str, **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose data is one tiny IDAT: the pixel limit must
    refuse it (413) from the header, before anything is allocated."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


@st.composite
def synthetic_images(draw: st.DrawFn) -> bytes:
    width, height = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    fmt = draw(st.sampled_from(["PNG", "JPEG"]))
    modes = ["L", "RGB", "CMYK"] if fmt == "JPEG" else ["1", "L", "P", "RGB", "RGBA", "LA", "I;16"]
    image = Image.new(draw(st.sampled_from(modes)), (width, height))
    if fmt == "JPEG" and draw(st.booleans()):
        exif = Image.Exif()
        exif[0x0112] = draw(st.integers(0, 2**16 - 1))  # Orientation, valid or not
        return encode(image.convert("RGB"), fmt, exif=exif.tobytes())
    return encode(image, fmt)


@st.composite
def mutated(draw: st.DrawFn, photo: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "flip-header", "flip-anywhere", "junk-prefix"]))
    if how == "truncate":
        return photo[: draw(st.integers(0, len(photo) - 1))]
    if how == "junk-prefix":
        return draw(st.binary(min_size=1, max_size=64)) + photo
    data = bytearray(photo)
    span = min(len(data), 2048) if how == "flip-header" else len(data)
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, span - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def image_bytes(photos: list[bytes]) -> st.SearchStrategy[bytes]:
    real = st.sampled_from(photos)
    decodable = st.one_of(real, synthetic_images())
    damaged = st.one_of(
        real.flatmap(mutated),
        st.builds(png_claiming, st.integers(6325, 2**31 - 1), st.integers(6325, 2**31 - 1)),
        st.binary(max_size=1024),
        st.sampled_from([b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a"]).flatmap(
            lambda magic: st.binary(max_size=512).map(lambda tail: magic + tail)
        ),
    )
    return mostly(decodable, damaged)


# None: the field is left out.
FLAGS = mostly(
    st.sampled_from([None, 0, 1, "0", "1", "true", "false", True, False, "", " 1 "]),
    st.sampled_from([2, -1, "yes", 1.0, "TRUE ", [], {}]),
)
CLIENT_REFERENCES = mostly(
    st.one_of(st.none(), st.from_regex(r"fuzz-[a-z0-9]{1,12}", fullmatch=True)), st.text(max_size=300)
)


def present(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


@dataclass(frozen=True)
class Sent:
    path: str
    kwargs: dict[str, Any]
    expected_status: int | None = None  # when the request alone decides the answer


def as_form(fields: dict[str, Any]) -> dict[str, str]:
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in fields.items()}


@st.composite
def data_uris(draw: st.DrawFn, image: bytes) -> str:
    payload = base64.b64encode(image).decode()
    valid_prefix = st.sampled_from(["jpeg", "jpg", "png", "pjpeg", "JPEG"]).map(
        lambda subtype: f"data:image/{subtype};base64,"
    )
    prefix = draw(mostly(valid_prefix, st.sampled_from(["", "data:image/gif;base64,", "data:;base64,"])))
    damage = draw(mostly(st.just("none"), st.sampled_from(["bad-char", "whitespace", "cut"])))
    if damage == "bad-char":
        payload = payload[:-1] + "*"
    elif damage == "whitespace":
        payload = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    elif damage == "cut":
        payload = payload[: len(payload) // 2 + 1]
    return prefix + payload


@st.composite
def face_search_requests(draw: st.DrawFn, photos: list[bytes]) -> Sent:
    fields = present(
        {
            "type": draw(
                mostly(st.just("face_search"), st.sampled_from([None, "age_estimation", "", "FACE"]))
            ),
            "client_reference": draw(CLIENT_REFERENCES),
            "allow_override": draw(FLAGS),
            "enroll_face": draw(FLAGS),
        }
    )
    image = draw(image_bytes(photos))
    if draw(st.booleans()):
        return Sent("/face-search", {"json": {**fields, "file": draw(data_uris(image))}})
    name = draw(
        mostly(st.sampled_from(["face.jpg", "face.JPEG", "face.png"]), st.sampled_from(["f.gif", "f", ""]))
    )
    form: dict[str, str | list[str]] = dict(as_form(fields))
    repeated = draw(mostly(st.none(), st.sampled_from(["type", "client_reference", "enroll_face"])))
    if repeated is not None:
        # A repeated field is refused (even with equal values) before anything else is looked at.
        form[repeated] = ["1", "1"]
        return Sent("/face-search", {"data": form, "files": {"file": (name, image)}}, expected_status=422)
    return Sent("/face-search", {"data": form, "files": {"file": (name, image)}})


@st.composite
def age_estimation_requests(draw: st.DrawFn, photos: list[bytes]) -> Sent:
    fields = present(
        {
            "type": draw(mostly(st.just("age_estimation"), st.sampled_from([None, "face_search", ""]))),
            "enroll_face": draw(FLAGS),
            "wait_for_result": draw(
                mostly(st.sampled_from([None, "0", "1", ""]), st.sampled_from(["true", "2"]))
            ),
        }
    )
    name = draw(
        mostly(st.sampled_from(["age.jpg", "age.jpeg", "age.PNG"]), st.sampled_from(["age.bmp", "age"]))
    )
    image = draw(image_bytes(photos))
    return Sent("/age-estimation", {"data": as_form(fields), "files": {"file": (name, image)}})


@pytest.fixture(scope="module")
def photos(faces_dev: FacesDev) -> list[bytes]:
    """A few real photos of each kind (JPEG and PNG among them) for the mutating strategies."""
    chosen: list[Path] = []
    for kind in ("identity", "age", "negative", "group"):
        chosen.extend(image.path for image in faces_dev.of_kind(kind)[:2])
    chosen.extend(image.path for image in faces_dev.of_kind("identity") if image.path.suffix == ".png")
    return [path.read_bytes() for path in chosen[:10]]


def send(http: httpx.Client, target: FuzzTarget, sent: Sent, log: FuzzLog) -> httpx.Response:
    response = http.post(sent.path, headers=target.auth, **sent.kwargs)
    log.check_status_and_body(
        sent.path, response.status_code, response.headers.get("content-type", ""), response.text
    )
    if sent.expected_status is not None and response.status_code != sent.expected_status:
        log.problem(f"expected {sent.expected_status}, got {response.status_code}", response.text[:300])
    return response


def check_success(response: httpx.Response, log: FuzzLog) -> dict[str, Any]:
    """The data of a 2xx success envelope. The ingress decodes every image before accepting it, so an
    accepted transaction must never end `failed` (status false)."""
    body = response.json()
    data = body.get("result", {}).get("data") if isinstance(body, dict) else None
    if not isinstance(data, dict) or body.get("status") is not True:
        log.problem(f"{response.status_code} is not a success envelope", response.text[:300])
        return {}
    return data


def check_accepted(response: httpx.Response, log: FuzzLog, accepted: list[str]) -> None:
    if response.status_code not in (200, 202):
        return
    reference_id = check_success(response, log).get("reference_id")
    if not isinstance(reference_id, str):
        log.problem(f"{response.status_code} without reference_id", response.text[:300])
        return
    accepted.append(reference_id)


def test_realistic_bodies(http: httpx.Client, target: FuzzTarget, photos: list[bytes]) -> None:
    """Real and damaged images with odd fields; every accepted transaction must then become final."""
    log = FuzzLog("realistic bodies")
    accepted: list[str] = []

    @fuzz_settings(REALISTIC_EXAMPLES)
    @given(sent=st.one_of(face_search_requests(photos), age_estimation_requests(photos)))
    def fuzz(sent: Sent) -> None:
        check_accepted(send(http, target, sent, log), log, accepted)

    fuzz()

    @fuzz_settings(REALISTIC_EXAMPLES)
    @given(
        reference_id=st.one_of(st.sampled_from(accepted or ["none"]), st.text(max_size=80)),
        as_json=st.booleans(),
    )
    def results(reference_id: str, as_json: bool) -> None:
        body = (
            {"json": {"reference_id": reference_id}} if as_json else {"data": {"reference_id": reference_id}}
        )
        send(http, target, Sent("/result", body), log)

    results()
    log.assert_clean(minimum_requests=REALISTIC_EXAMPLES)
    assert accepted, "no fuzzed request was accepted: the strategies never reach the pipeline"
    pending = set(accepted)
    deadline = time.monotonic() + FINAL_WITHIN_S
    while pending and time.monotonic() < deadline:
        for reference_id in sorted(pending):
            response = send(http, target, Sent("/result", {"json": {"reference_id": reference_id}}), log)
            if response.status_code == 200:
                check_success(response, log)
                pending.discard(reference_id)
        time.sleep(0.5)
    assert not log.problems, log.problems
    assert not pending, f"accepted transactions not final after {FINAL_WITHIN_S}s: {sorted(pending)}"
    print(f"realistic bodies: {len(accepted)} accepted, all final")
