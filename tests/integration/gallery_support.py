"""What a gallery test reads from Milvus behind the store's back: every row of a collection, duplicates
included (a store has no listing of its own: the service never needs one)."""

from __future__ import annotations

import asyncio

from serve_app.stores.milvus_gallery import milvus_string


def _rows(uri: str, collection: str, tenant_id: str | None) -> list[tuple[str, str]]:
    from pymilvus import MilvusClient

    expression = 'face_id != ""' if tenant_id is None else f"tenant_id == {milvus_string(tenant_id)}"
    client = MilvusClient(uri=uri, timeout=60)
    try:
        iterator = client.query_iterator(
            collection, batch_size=1000, filter=expression, output_fields=["tenant_id"], timeout=60
        )
        rows: list[tuple[str, str]] = []
        try:
            while batch := iterator.next():
                rows.extend((str(row["tenant_id"]), str(row["face_id"])) for row in batch)
        finally:
            iterator.close()
        return rows
    finally:
        client.close()


async def gallery_rows(uri: str, collection: str, tenant_id: str | None = None) -> list[tuple[str, str]]:
    """(tenant_id, face_id) of every row the collection (or alias) `collection` serves, in a Strong read."""
    return await asyncio.to_thread(_rows, uri, collection, tenant_id)


async def gallery_faces(uri: str, collection: str, tenant_id: str | None = None) -> set[tuple[str, str]]:
    return set(await gallery_rows(uri, collection, tenant_id))
