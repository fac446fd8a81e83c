"""AsyncCorpusClient is CorpusClient for asyncio: every call is awaitable, and the buffered ones
send the pending step themselves when the sync client would (a restarted id finished in it, too
many buffered tokens), against a real server process."""

from __future__ import annotations

import asyncio
import inspect

from corpus_service.client import CorpusClient
from corpus_service.client.aio import AsyncCorpusClient

PUBLIC = ("start_request", "extend", "extend_many", "finish", "draft", "flush", "synchronize", "stats",
          "describe_namespaces", "reset", "close")


def test_every_call_of_the_async_client_is_awaitable_where_the_sync_one_may_block():
    for name in PUBLIC:
        assert hasattr(CorpusClient, name), name
        assert inspect.iscoroutinefunction(getattr(AsyncCorpusClient, name)), name


def test_buffered_calls_flush_when_they_must(server):
    async def run():
        async with AsyncCorpusClient(server.target, "small", max_pending_tokens=64) as c:
            await c.start_request("r", [1, 2, 3, 1, 2])
            await c.draft(["r"], 4)
            await c.finish("r")
            # Restarting an id finished in the pending step: it sends that step first (the sync
            # client does; this one used to raise and leave it to the caller).
            await c.start_request("r", [7, 8, 9, 7, 8])
            assert (await c.draft(["r"], 4)).tree(0)[0][:1] == [9]
            # More buffered tokens than max_pending_tokens go out without waiting for a draft.
            await c.start_request("long", list(range(10, 110)))
            assert not c._log.has_pending()
            return (await c.stats())["live_requests"]

    assert asyncio.run(run()) >= 2
