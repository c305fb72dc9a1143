"""The README, the changelog and the documentation pages refer only to files inside the repository.

A reader of this repository has the repository and nothing beside it, so a link (or an inline path in
backticks) that climbs out of it with `../` names a file the reader never has, and a relative link to a
file that is not there is broken. MkDocs --strict checks the links between docs/ pages and their anchors;
this check also covers README.md and CHANGELOG.md, which live outside MkDocs' docs_dir, and paths written in
backticks, which MkDocs never reads as links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
SNIPPET = re.compile(r"^--8<--\s+\"([^\"]+)\"", re.MULTILINE)  # pymdownx.snippets, from the repository root
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (their lines kept blank, so positions stay put)."""
    kept: list[str] = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            kept.append("")
        else:
            kept.append("" if fenced else line)
    return "\n".join(kept)


def problems(text: str, source: Path, root: Path = ROOT) -> list[str]:
    """What in `text` (the contents of the file `source`) points outside `root` or at a missing file."""
    found: list[str] = []
    prose = _prose(text)
    for match in CODE_SPAN.finditer(prose):
        if match.group(2).strip().startswith("../"):
            found.append(f"`{match.group(2).strip()}` names a path outside the repository")
    without_code = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), prose)
    targets = [m.group(1) for m in INLINE_LINK.finditer(without_code)]
    targets += [m.group(1) for m in REFERENCE_LINK.finditer(without_code)]
    for target in targets:
        if not target or target.startswith("#") or SCHEME.match(target) or target.startswith("//"):
            continue  # an anchor on the same page (MkDocs checks those) or another site
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if path.startswith("/"):
            found.append(f"link {target!r} is an absolute path, not a file of the repository")
            continue
        resolved = (source.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            found.append(f"link {target!r} leads outside the repository")
        elif not resolved.exists():
            found.append(f"link {target!r} names a file that does not exist")
    for match in SNIPPET.finditer(text):
        included = (root / match.group(1)).resolve()
        if not included.is_relative_to(root.resolve()) or not included.is_file():
            found.append(f"included file {match.group(1)!r} is not a file of the repository")
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_document_refers_only_to_files_in_the_repository(document: Path) -> None:
    assert problems(document.read_text(encoding="utf-8"), document) == []


def test_the_documents_are_found() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in DOCUMENTS}
    assert {"README.md", "CHANGELOG.md", "docs/index.md", "docs/api.md", "docs/performance.md"} <= names


BAD = [
    ("the interface is in `../shared/INTERFACE.md`", "outside the repository"),
    ("see [the interface](../shared/INTERFACE.md)", "leads outside the repository"),
    ("see [the interface](../../shared/INTERFACE.md#endpoints)", "leads outside the repository"),
    ("a [broken link](docs/no-such-page.md)", "does not exist"),
    ("an [absolute path](/etc/passwd)", "absolute path"),
    ("a [link that wraps\nlines](docs/missing.md#x)", "does not exist"),
    ("[ref]: ../outside.md", "leads outside the repository"),
    ("![a picture](docs/missing.png)", "does not exist"),
    ('--8<-- "NO-SUCH-FILE.md"', "not a file of the repository"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_a_path_outside_or_missing_is_reported(text: str, expected: str) -> None:
    found = problems(text, ROOT / "README.md")
    assert len(found) == 1 and expected in found[0], found


GOOD = [
    "the [API guide](docs/api.md) and [its errors](docs/api.md#errors)",
    "[a section on this page](#topology), [a site](https://www.standardwebhooks.com), <mailto:x@example.com>",
    "a path in the repository: `docs/api.md`, `config/serve.yaml`; a relative one inside it: `./bench`",
    "```\ncd ../shared && ls ../shared/testdata\n```",
    "a code span that looks like a link: `[x](../y.md)`",
    '--8<-- "CHANGELOG.md"',
]


@pytest.mark.parametrize("text", GOOD)
def test_links_inside_the_repository_pass(text: str) -> None:
    assert problems(text, ROOT / "README.md") == []


def test_a_link_resolves_from_its_own_page() -> None:
    """docs/ pages link to each other by name; the same name from the repository root is missing."""
    assert problems("[API](api.md)", ROOT / "docs" / "performance.md") == []
    assert problems("[API](api.md)", ROOT / "README.md") == ["link 'api.md' names a file that does not exist"]
