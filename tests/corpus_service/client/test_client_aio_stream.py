"""AsyncCorpusClient's Session stream: a step reads its own reply (no reader task), so deadlines,
a server that ends the stream, a closed client and a restarted server must all still surface as the
same CorpusError classes, and the next step must open a new session that replays the live requests."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.client import AsyncCorpusClient, CircuitBreaker, CorpusUnavailable, RetryPolicy
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusDeadlineExceeded, CorpusError

from ..service_fixtures import ServerProcess


class FakeCorpus:
    """A Session handler that answers empty trees, stalls on budget 7 and ends the stream on budget 9."""

    def __init__(self) -> None:
        self.messages: list[pb.SessionRequest] = []
        self.streams = 0

    async def session(self, requests, context):
        self.streams += 1
        async for msg in requests:
            self.messages.append(msg)
            n, budget = len(msg.draft.req_ids), msg.draft.budget
            if budget == 7:
                await asyncio.sleep(5)
            if budget == 9:
                return
            yield pb.SessionResponse(seq=msg.seq, drafts=pb.DraftTrees(budget=budget, counts=arrays.pack([1] * n),
                                                                       tokens=arrays.pack([5] * n), parents=arrays.pack([-1] * n),
                                                                       probs=arrays.pack([0.5] * n, arrays.F32)))

    async def start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(self.session, request_deserializer=pb.SessionRequest.FromString,
                                                        response_serializer=pb.SessionResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ngram_corpus.v1.Corpus", {"Session": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port


def test_deadline_breaks_the_stream_and_the_next_step_replays():
    async def run():
        fake = FakeCorpus()
        server, port = await fake.start()
        try:
            async with AsyncCorpusClient(f"127.0.0.1:{port}", timeout=0.3) as c:
                await c.start_request("r", [1, 2, 3])
                batch = await c.draft(["r"], 3)
                assert batch.tokens.tolist() == [[5, -1, -1]] and batch.counts.tolist() == [1]
                await c.extend("r", [4])
                with pytest.raises(CorpusDeadlineExceeded, match="deadline"):
                    await c.draft(["r"], 7)
                assert c.has_request("r")
                batch = await c.draft(["r"], 3)  # a new session: the request is restored with its context
                assert batch.counts.tolist() == [1]
                last = fake.messages[-1]
                assert fake.streams == 2 and list(last.restore.req_ids) == ["r"]
                assert arrays.unpack(last.restore.tokens, arrays.I32, "t").tolist() == [1, 2, 3]
                assert list(last.extend.req_ids) == ["r"]  # the unacknowledged extend rides again
                assert arrays.unpack(last.extend.tokens, arrays.I32, "t").tolist() == [4]
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_server_ending_the_stream_is_unavailable_then_a_new_session_serves():
    async def run():
        fake = FakeCorpus()
        server, port = await fake.start()
        try:
            async with AsyncCorpusClient(f"127.0.0.1:{port}", timeout=2.0, retry=RetryPolicy(retries=0)) as c:
                await c.start_request("r", [1, 2, 3])
                await c.draft(["r"], 3)
                with pytest.raises(CorpusUnavailable, match="closed the session"):
                    await c.draft(["r"], 9)
                assert (await c.draft(["r"], 3)).counts.tolist() == [1]
                assert fake.streams == 2
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_closing_the_client_during_a_step_is_unavailable_and_cancelling_the_caller_cancels():
    async def run():
        fake = FakeCorpus()
        server, port = await fake.start()
        try:
            c = AsyncCorpusClient(f"127.0.0.1:{port}", timeout=10.0, retry=RetryPolicy(retries=0))
            await c.start_request("r", [1, 2, 3])
            await c.draft(["r"], 3)
            step = asyncio.ensure_future(c.draft(["r"], 7))
            await asyncio.sleep(0.2)
            c._stream.close()
            with pytest.raises(CorpusUnavailable):
                await step
            step = asyncio.ensure_future(c.draft(["r"], 7))
            await asyncio.sleep(0.2)
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            assert (await c.draft(["r"], 3)).counts.tolist() == [1]
            await c.close()
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_async_client_replays_after_a_real_server_restart(tmp_path):
    srv = ServerProcess(tmp_path).start()
    port = srv.grpc_port

    async def run():
        nonlocal srv
        c = AsyncCorpusClient(srv.target, timeout=2.0, retry=RetryPolicy(retries=3, backoff_s=0.02, max_backoff_s=0.1),
                              breaker=CircuitBreaker(failure_threshold=2, cooldown_s=0.1))
        try:
            await c.start_request("r", np.array([7, 8, 9, 10, 11, 7, 8]))
            await c.extend("r", [9])
            before = (await c.draft(["r"], 5)).tree(0)
            assert before[0][:2] == [10, 11]
            srv.kill()
            with pytest.raises(CorpusUnavailable):
                await c.draft(["r"], 5)
            srv = ServerProcess(tmp_path).start(grpc_port=port)
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                try:
                    after = (await c.draft(["r"], 5)).tree(0)
                    break
                except CorpusUnavailable:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.05)
            assert after[0][:2] == before[0][:2]
        finally:
            await c.close()

    try:
        asyncio.run(run())
    finally:
        if srv.alive():
            srv.stop()


def test_a_peer_that_accepts_and_never_answers_costs_each_step_its_deadline_only():
    """A corpus address that accepts TCP connections and never speaks HTTP/2 (a hung host, a proxy
    that lost its upstream): each step fails within about its deadline. Before, the deadline cancelled
    only the call, and grpc.aio's write waited forever for headers a cancelled call never sends:
    the first step hung (2 of 2 runs past 3 s at a 50 ms deadline, 2026-12-06)."""
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)  # never read, never answered

    threading.Thread(target=accept, daemon=True).start()

    async def main():
        client = AsyncCorpusClient(f"127.0.0.1:{listener.getsockname()[1]}", timeout=0.05,
                                   breaker=CircuitBreaker(failure_threshold=1000, cooldown_s=0.01))
        await client.start_request("a", [1, 2, 3])
        waits = []
        for _ in range(5):
            t = time.perf_counter()
            with pytest.raises(CorpusError):  # unavailable, or the deadline
                await asyncio.wait_for(client.draft(["a"], 4), 3.0)
            waits.append(time.perf_counter() - t)
        await client.close()
        return waits

    try:
        waits = asyncio.run(main())
    finally:
        listener.close()
        for c in held:
            c.close()
    assert max(waits) < 1.0, waits
