"""The operator console at /console, driven in Debian's chromium (installed by `make install`) through
Playwright against the real service. Screenshots go to var/test-artifacts/console/."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from serve_app.api.console import CONSOLE_DIR
from tests.faces_dev import REPO_ROOT, FacesDev, LabelledImage
from tests.integration.api_client import client_for, face_search_multipart, reference_of, wait_result
from tests.service_harness import Client, RunningService

pytestmark = pytest.mark.service

ARTIFACTS = REPO_ROOT / "var" / "test-artifacts" / "console"
CHROMIUM = Path(os.environ.get("FACESEARCH_CHROMIUM", "/usr/bin/chromium"))
# A guard against a hang, not a speed bound: a transaction on a busy 2-core box can take a while.
STEP_TIMEOUT_MS = 180_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} is missing: `make install` installs Debian's chromium (apt-get install chromium)"
        )
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield launched
        launched.close()


@dataclass
class Console:
    page: Page
    origin: str
    requests: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # script errors and CSP violations

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / name), full_page=True)

    def sign_in(self, client_id: str, secret: str) -> None:
        self.page.fill("#client-id", client_id)
        self.page.fill("#client-secret", secret)
        self.page.click("#sign-in")

    def check_no_foreign_requests(self) -> None:
        """Every request the page made went to the service itself (blob: is the in-page photo preview)."""
        assert self.requests, "no request recorded"
        foreign = [
            url
            for url in self.requests
            if not (url.startswith(self.origin + "/") or url.startswith(f"blob:{self.origin}/"))
        ]
        assert not foreign, foreign
        assert not self.problems, self.problems


@pytest.fixture
def console(browser: Browser, service: RunningService) -> Iterator[Console]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(STEP_TIMEOUT_MS)
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(service.base_url))
    opened = Console(page=page, origin=origin)
    page.on("request", lambda request: opened.requests.append(request.url))
    page.on("pageerror", lambda error: opened.problems.append(f"page error: {error}"))

    def on_console(message: Any) -> None:
        if "Content Security Policy" in message.text or "Refused to" in message.text:
            opened.problems.append(f"console: {message.text}")

    page.on("console", on_console)
    response = page.goto(f"{service.base_url}/console/")
    assert response is not None and response.status == 200
    yield opened
    context.close()


def drop_file(page: Page, selector: str, photo: Path) -> None:
    """A real drop event carrying the photo as a File, as a browser makes one from a drag."""
    mime = "image/png" if photo.suffix.lower() == ".png" else "image/jpeg"
    transfer = page.evaluate_handle(
        """([data, name, type]) => {
            const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type }));
            return transfer;
        }""",
        [base64.b64encode(photo.read_bytes()).decode(), photo.name, mime],
    )
    page.dispatch_event(selector, "drop", {"dataTransfer": transfer})


def wait_images_loaded(page: Page, selector: str) -> list[int]:
    """naturalWidth of every image matched, once each has loaded (0 would mean a broken image)."""
    page.wait_for_function(
        """(selector) => {
            const images = [...document.querySelectorAll(selector)];
            return images.length > 0 && images.every((image) => image.complete);
        }""",
        arg=selector,
    )
    widths: list[int] = page.eval_on_selector_all(selector, "(images) => images.map((i) => i.naturalWidth)")
    return widths


def new_client(service: RunningService, name: str) -> Client:
    """RunningService.new_client runs its own event loop; Playwright's sync API keeps one running in this
    thread, so the client is created from another thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(service.new_client, name).result()


def api_result(service: RunningService, token: str, reference_id: str) -> dict[str, Any]:
    with service.http() as http:
        body = wait_result(http, token, reference_id)
    assert body["status"] is True, body
    data: dict[str, Any] = body["result"]["data"]
    return data


def two_photos_of_one_person(faces_dev: FacesDev) -> tuple[str, list[LabelledImage]]:
    return next((name, photos) for name, photos in faces_dev.by_identity().items() if len(photos) >= 2)


def test_console_files_are_served_with_strict_headers(service: RunningService) -> None:
    with service.http() as http:
        redirect = http.get("/console", follow_redirects=False)
        assert redirect.status_code in (307, 308) and redirect.headers["location"].endswith("/console/")
        for path, kind in (
            ("/console/", "text/html"),
            ("/console/app.js", "javascript"),
            ("/console/app.css", "css"),
        ):
            response = http.get(path)
            assert response.status_code == 200, path
            assert kind in response.headers["content-type"], (path, response.headers["content-type"])
            policy = response.headers["content-security-policy"]
            assert "script-src 'self'" in policy and "default-src 'none'" in policy, policy
            assert "unsafe-inline" not in policy and "unsafe-eval" not in policy, policy
            assert response.headers["x-content-type-options"] == "nosniff"
        missing = http.get("/console/no-such-file.js")
        assert missing.status_code == 404
        assert missing.json()["status"] is False  # the service's one error envelope


def test_console_files_need_nothing_but_the_service() -> None:
    """No inline script, no inline style, no event-handler attributes, no absolute URL to anywhere."""
    files = {path.name: path.read_text() for path in CONSOLE_DIR.iterdir() if path.is_file()}
    assert {"index.html", "app.js", "app.css"} <= set(files)
    html = files["index.html"]
    assert all(re.search(r'\bsrc="[^"/:]+"', tag) for tag in re.findall(r"<script\b[^>]*>", html)), html
    assert not re.search(r"<script\b[^>]*>\s*[^<\s]", html), "inline script"
    assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=", html), "inline style or handler"
    for name, text in files.items():
        # An SVG's xmlns names a namespace; nothing is fetched from it.
        fetchable = re.sub(r'xmlns="[^"]*"', "", text)
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", fetchable, re.IGNORECASE), name
        assert "@import" not in text, name
        # The token stays in memory: nothing is written to storage or cookies.
        assert not re.search(r"\b(?:localStorage|sessionStorage)\s*\.|document\.cookie", text), name


def test_bad_credentials_show_the_api_message(console: Console, service: RunningService) -> None:
    client = new_client(service, "console-bad-credentials")
    with service.http() as http:
        expected = http.post(
            "/request-access-token", json={"client_id": client.client_id, "client_secret": "wrong-secret"}
        )
    assert expected.status_code == 401
    console.sign_in(client.client_id, "wrong-secret")
    error = console.page.locator("#sign-in-error")
    error.wait_for(state="visible")
    assert error.text_content() == expected.json()["message"]
    assert console.page.locator("#workspace").is_hidden()
    console.screenshot("01a-bad-secret.png")

    # A malformed client id: the message and the field the envelope names.
    console.sign_in("not-a-client-id", "whatever")
    console.page.wait_for_function(
        "() => document.getElementById('sign-in-error').textContent.includes('client_id:')"
    )
    shown = error.text_content() or ""
    assert shown.startswith("client_id is not a valid client id."), shown
    console.screenshot("01b-malformed-client-id.png")
    console.check_no_foreign_requests()


def run_photo(console: Console) -> None:
    page = console.page
    page.wait_for_selector("#run:not([disabled])")
    page.click("#run")
    page.wait_for_function("() => ['Done.', ''].includes(document.getElementById('run-status').textContent)")
    assert page.locator("#run-error").is_hidden(), page.text_content("#run-error")
    page.wait_for_selector("#result:not([hidden])")


def test_face_search_and_age_estimation(
    console: Console, service: RunningService, faces_dev: FacesDev
) -> None:
    client = new_client(service, "console-search")
    token = service.token_for(client)
    page = console.page
    console.sign_in(client.client_id, client.client_secret)
    page.wait_for_selector("#workspace:not([hidden])")
    assert page.input_value("#client-secret") == ""  # the secret is not kept

    # Enrol one photo of a person under a reference (chosen with the file input).
    identity, photos = two_photos_of_one_person(faces_dev)
    reference = f"console-{identity}"
    page.set_input_files("#photo", str(photos[0].path))
    page.fill("#client-reference", reference)
    page.check("#enroll")
    run_photo(console)
    enrolled = api_result(service, token, page.text_content("#result-reference") or "")
    assert enrolled["client_reference"] == reference
    assert page.locator("#no-matches").is_visible()  # a new tenant's gallery was empty

    # Search with another photo of the same person (dropped), without enrolling it.
    drop_file(page, "#drop-zone", photos[1].path)
    page.fill("#client-reference", "")
    page.uncheck("#enroll")
    run_photo(console)
    rows = page.locator("#matches tbody tr")
    rows.first.wait_for()
    widths = wait_images_loaded(page, "#matches img.proof")
    assert widths and all(width > 0 for width in widths), widths
    data = api_result(service, token, page.text_content("#result-reference") or "")
    matches = data["face_search_response"]["result"]["matched_faces"]
    assert matches, data
    best = rows.first
    assert best.get_attribute("data-face-id") == matches[0][0]
    assert float(best.locator(".score").get_attribute("data-score") or "nan") == matches[0][1]
    assert (best.locator(".score").text_content() or "") == f"{matches[0][1]:.3f}"
    assert best.locator(".reference").text_content() == reference == matches[0][3]
    assert rows.count() == len(matches)
    console.screenshot("02-face-search-match.png")

    # Age estimation of an age crop.
    page.check("input[name=mode][value=age_estimation]")
    age_photo = faces_dev.of_kind("age")[0]
    page.set_input_files("#photo", str(age_photo.path))
    run_photo(console)
    page.wait_for_selector("#age-result:not([hidden])")
    age = api_result(service, token, page.text_content("#result-reference") or "")
    assert isinstance(age["age"], int)
    assert page.text_content("#age") == str(age["age"])
    assert page.text_content("#under-18") == str(age["under_18"])
    assert page.text_content("#under-21") == str(age["under_21"])
    console.screenshot("03-age-estimation.png")
    console.check_no_foreign_requests()


def enrol(service: RunningService, token: str, photo: Path, reference: str) -> None:
    with service.http() as http:
        reference_id = reference_of(face_search_multipart(http, token, photo, client_reference=reference))
        data = wait_result(http, token, reference_id)["result"]["data"]
    assert data["face_search_response"]["result"]["is_face_found"] is True


def gallery_face_ids(service: RunningService, token: str, reference: str) -> list[str]:
    with service.http() as http:
        page = client_for(http, token).list_faces(client_reference=reference)
    return [face.face_id for face in page.faces]


def test_gallery_browse_delete_and_erase(
    console: Console, service: RunningService, faces_dev: FacesDev
) -> None:
    client: Client = new_client(service, "console-gallery")
    token = service.token_for(client)
    people = [photos for photos in faces_dev.by_identity().values() if len(photos) >= 3]
    # The kept reference holds markup: the console must show it as text.
    erased, kept = "console-erase-me", '<b class="x">keep</b> me'
    for photo in people[0][:3]:
        enrol(service, token, photo.path, erased)
    enrol(service, token, people[1][0].path, kept)
    assert len(gallery_face_ids(service, token, erased)) == 3
    page = console.page
    console.sign_in(client.client_id, client.client_secret)
    page.click(".tab[data-tab=gallery]")

    # Stats and the whole gallery on one page.
    page.wait_for_function("() => document.querySelectorAll('#faces tbody tr').length === 4")
    page.wait_for_selector("#stats dd")
    assert page.text_content("#stats dt") == "Faces" and page.text_content("#stats dd") == "4"

    # Filtered and paged two at a time.
    page.fill("#filter-reference", erased)
    page.select_option("#page-size", "2")
    page.click("#gallery-load")
    page.wait_for_function(
        "() => document.querySelectorAll('#faces tbody tr').length === 2"
        " && !document.getElementById('next-page').disabled"
    )
    first_page = page.eval_on_selector_all("#faces tbody tr", "(rows) => rows.map((r) => r.dataset.faceId)")
    widths = wait_images_loaded(page, "#faces img.proof")
    assert widths and all(width > 0 for width in widths), widths
    assert set(
        page.eval_on_selector_all("#faces .reference", "(cells) => cells.map((c) => c.textContent)")
    ) == {erased}
    console.screenshot("04-gallery-page-1.png")
    page.click("#next-page")
    page.wait_for_function("() => document.getElementById('next-page').disabled")
    second_page = page.eval_on_selector_all("#faces tbody tr", "(rows) => rows.map((r) => r.dataset.faceId)")
    assert len(second_page) == 1 and not set(second_page) & set(first_page)
    assert set(first_page + second_page) == set(gallery_face_ids(service, token, erased))

    # Delete one face (two clicks: arm, confirm).
    doomed = second_page[0]
    button = page.locator(f"#faces tr[data-face-id='{doomed}'] button.delete")
    button.click()
    assert button.text_content() == "Confirm delete"
    button.click()
    page.wait_for_function(
        "(id) => !document.querySelector(`#faces tr[data-face-id='${id}']`)"
        " && document.getElementById('gallery-status').textContent.startsWith('Deleted')",
        arg=doomed,
    )
    assert doomed not in gallery_face_ids(service, token, erased)

    # Erase the reference: confirm, then the count the API answered.
    page.fill("#erase-reference", erased)
    page.click("#erase")
    page.wait_for_selector("#erase-confirm:not([hidden])")
    assert page.text_content("#erase-target") == erased
    page.click("#erase-yes")
    page.wait_for_function("() => document.getElementById('erase-status').textContent.startsWith('Erased')")
    assert (page.text_content("#erase-status") or "").startswith(f"Erased 2 faces of {erased} at ")
    page.wait_for_function(
        "() => document.getElementById('gallery-status').textContent.startsWith('No enrolled faces')"
    )
    assert gallery_face_ids(service, token, erased) == []
    assert len(gallery_face_ids(service, token, kept)) == 1
    # The audit log shows both, newest first, with the numbers of faces.
    page.wait_for_function("() => document.querySelectorAll('#audit tbody tr').length === 2")
    actions = page.eval_on_selector_all(
        "#audit tbody tr",
        "(rows) => rows.map((r) => [r.querySelector('.action').textContent,"
        " r.querySelector('.faces').textContent])",
    )
    assert actions == [["erase_reference", "2"], ["delete_face", "1"]], actions
    assert erased not in (page.text_content("#audit") or "")  # a keyed hash, not the reference
    console.screenshot("05-after-erase.png")
    # A reference holding markup is shown as text.
    page.fill("#filter-reference", kept)
    page.click("#gallery-load")
    page.wait_for_function("() => document.querySelectorAll('#faces tbody tr').length === 1")
    assert page.text_content("#faces .reference") == kept
    assert page.locator("#faces b").count() == 0
    console.check_no_foreign_requests()


def test_the_browser_enforces_the_policy(console: Console) -> None:
    """The policy header is in force in the page: an inline script added at run time does not run, and
    the browser reports the violation."""
    with console.page.expect_console_message(lambda message: "Content Security Policy" in message.text):
        ran = console.page.evaluate(
            """() => {
                const script = document.createElement("script");
                script.textContent = "window.inlineRan = true;";
                document.head.append(script);
                return window.inlineRan === true;
            }"""
        )
    assert ran is False
