"""The stored form of a transaction: the fields of its Redis hash, which its archived copy keeps too
(stores/result_archive.py), so a result reads the same from either."""

from __future__ import annotations

from collections.abc import Mapping

from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, upload_key
from serve_app.stores.outcome_codec import outcome_fields, outcome_from_fields


def encode_transaction(tx: Transaction) -> dict[str, str]:
    """The hash fields of a transaction. Compact: what a field's absence can say is left out (defaults,
    the reference id the key names, an upload key the tenant and reference id give), so that with short
    values Redis keeps the hash in its compact encoding (see outcome_codec)."""
    fields: dict[str, str] = {
        "tenant_id": tx.tenant_id,
        "kind": tx.kind.value,
        "state": tx.state.value,
        "created_at": repr(float(tx.created_at)),
        "updated_at": repr(float(tx.updated_at)),
    }
    if tx.image_key != upload_key(tx.tenant_id, tx.reference_id):
        fields["image_key"] = tx.image_key
    if tx.enroll_face:
        fields["enroll_face"] = "1"
    if tx.allow_override:
        fields["allow_override"] = "1"
    if tx.attempts:
        fields["attempts"] = str(tx.attempts)
    # Absent fields stand for None.
    if tx.client_reference is not None:
        fields["client_reference"] = tx.client_reference
    if tx.result is not None:
        fields.update(outcome_fields(tx.result))
    if tx.error is not None:
        fields["error"] = tx.error
    return fields


def decode_transaction(reference_id: str, fields: Mapping[str, str]) -> Transaction:
    """The transaction from its hash fields (also those an earlier version wrote, with every field)."""
    kind = TransactionKind(fields["kind"])
    tenant_id = fields["tenant_id"]
    return Transaction(
        reference_id=reference_id,
        tenant_id=tenant_id,
        kind=kind,
        state=TransactionState(fields["state"]),
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        image_key=fields.get("image_key") or upload_key(tenant_id, reference_id),
        enroll_face=fields.get("enroll_face") == "1",
        allow_override=fields.get("allow_override") == "1",
        client_reference=fields.get("client_reference"),
        attempts=int(fields.get("attempts", "0")),
        result=outcome_from_fields(kind, fields),
        error=fields.get("error"),
    )
