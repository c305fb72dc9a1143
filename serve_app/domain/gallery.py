"""Gallery management (an extension beyond the vendor interface): statistics and the audit trail."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# The page size of the listings (faces, audit trail, a webhook's delivery log): the one statement of the
# rule, read by the pipeline that enforces it, the API whose schema states it, the CLI and the Python
# client (which keeps its own copy, held equal by tests/unit/test_client_contract.py).
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200


class AuditAction(StrEnum):
    ERASE_REFERENCE = "erase_reference"
    DELETE_FACE = "delete_face"


@dataclass(frozen=True)
class AuditEntry:
    """One operator action on a gallery. `subject` is a keyed hash of the client_reference or face id:
    the trail proves what was done, when and by whom without keeping the erased value itself."""

    at: float  # unix time
    actor: str  # the client id that asked
    action: AuditAction
    faces: int  # how many faces the action removed
    subject: str


@dataclass(frozen=True)
class GalleryCounts:
    faces: int
    client_references: int
    oldest_enrolment: float | None
    newest_enrolment: float | None
