"""``GET /v1/replication``: where this replica stands (applied sequence, lag, buffered and dropped
commits, gaps); ``?digest=true`` adds the replica digest (equal on replicas that applied the same log),
``?lags=N`` the newest N commit-to-visible samples in ms (benchmarks)."""

import asyncio

from fastapi import APIRouter, Query


def replication_router(replica) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/replication")
    async def replication(digest: bool = False, lags: int = Query(0, ge=0, le=65536)) -> dict:
        out = await asyncio.to_thread(replica.status, True) if digest else replica.status()
        if lags:
            out["lags_ms"] = replica.recent_lags(lags)
        return out

    return router
