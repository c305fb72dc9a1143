"""A worker replica that starts the gallery's index switch and hangs after its first copied page, until the
test kills it (tests/integration/test_gallery_scale.py): the real job, stores and lease, in a process of its
own, so that its death is a real one: its lease is never given back, its renewals just stop.

    python -m tests.integration.switch_holder MILVUS_URI REDIS_URL COLLECTION

Prints "holding" once it hangs, its first page copied and its cursor written.
"""

from __future__ import annotations

import asyncio
import sys

from redis.asyncio import Redis

from serve_app.pipelines.index_switch import IndexSwitch, SwitchPolicy, lease_name
from serve_app.stores.interfaces import CopiedPage
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_support import connect_redis

DIM = 32
POLICY = IndexPolicy(
    flat_max_rows=300, large_index="IVF_FLAT", build_params={"nlist": 8}, search_params={"nprobe": 8}
)
PAGE_ROWS = 100
LEASE_S = 3.0  # seconds here; a minute by default (FACESEARCH_MILVUS_INDEX_SWITCH_LEASE_S)
WRITE_WINDOW_S = 0.5  # one writer at a time in the test: no write of another replica to wait out


def store(
    uri: str, collection: str, kind: type[MilvusGalleryStore] = MilvusGalleryStore
) -> MilvusGalleryStore:
    """A replica's gallery store, as the test's replicas and this holder open it."""
    return kind(
        uri, collection=collection, model_version="v1", dimension=DIM, index_policy=POLICY,
        write_window_s=WRITE_WINDOW_S,
    )  # fmt: skip


def job(gallery: MilvusGalleryStore, redis: Redis) -> IndexSwitch:
    """The index-switch job as a worker's loop builds it (looking at the size at every pass)."""
    lease = RedisLease(redis, lease_name(gallery), prefix=f"{gallery.collection}:")
    return IndexSwitch(
        gallery, lease, SwitchPolicy(lease_s=LEASE_S, every_s=0, page_rows=PAGE_ROWS, poll_s=0.2)
    )


class HangsAtItsSecondPage(MilvusGalleryStore):
    pages = 0

    async def copy_page(self, target: str, after: str | None, limit: int) -> CopiedPage:
        self.pages += 1
        if self.pages == 2:
            print("holding", flush=True)
            await asyncio.Event().wait()  # hung: alive (renewing its lease) until killed
        return await super().copy_page(target, after, limit)


async def main(uri: str, redis_url: str, collection: str) -> None:
    gallery = store(uri, collection, HangsAtItsSecondPage)
    await job(gallery, connect_redis(redis_url)).run_once("replica-a")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
