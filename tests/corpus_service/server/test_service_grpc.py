"""The gRPC service against a real server process: round trips, sharing between clients, the
SGLang drop-in against the in-process engine, health/reflection, and bad input on every RPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corpus_service import NgramCorpus
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import AsyncCorpusClient, CorpusClient, RemoteNgramCorpus
from corpus_service.protocol import arrays
from corpus_service.protocol.status import (CorpusAlreadyExists, CorpusInvalidArgument, CorpusNotFound, CorpusOutOfRange,
                                            CorpusResourceExhausted)
from tests.corpus_service.service_fixtures import TOKEN

ADMIN = (("authorization", f"Bearer {TOKEN}"),)  # Reset and external corpora need the admin token

SENTENCE = [5, 17, 9, 33, 2, 41, 8, 8, 19, 27, 3, 11]


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield pb_grpc.CorpusStub(ch)


def test_draft_commit_round_trip_matches_in_process_engine(server):
    local = NgramCorpus()
    with CorpusClient(server.target, "default", token=TOKEN) as c:
        c.reset()
        for eng in (c, local):
            eng.start_request("r1", SENTENCE + SENTENCE[:3])
        remote_batch = c.draft(["r1"], 8)
        local_batch = local.draft(["r1"], 8)
        assert remote_batch.tree(0)[:2] == local_batch.tree(0)[:2]
        np.testing.assert_allclose(remote_batch.probs, local_batch.probs, rtol=1e-6)
        assert remote_batch.tree(0)[0][:3] == SENTENCE[3:6]  # copies the continuation from the prompt
        for eng in (c, local):
            eng.extend("r1", SENTENCE[3:6])
        assert c.draft(["r1"], 8).tree(0)[:2] == local.draft(["r1"], 8).tree(0)[:2]
        c.finish("r1")
        c.flush()
        assert not c.has_request("r1")


def test_one_client_drafts_from_what_another_committed(server):
    with CorpusClient(server.target, "default", token=TOKEN) as a, CorpusClient(server.target, "default") as b:
        a.reset()
        story = list(range(200, 260))
        a.start_request("same-id", [1, 2])
        a.extend("same-id", story)
        a.finish("same-id")
        a.synchronize()  # learned-corpus inserts are asynchronous, as in the engine
        b.start_request("same-id", story[:10])  # the same id in another session does not collide
        tokens, parents, _ = b.draft(["same-id"], 6).tree(0)
        assert tokens[:6] == story[10:16] and parents[:6] == [-1, 0, 1, 2, 3, 4]


def _start_two_and_commit(client, local: NgramCorpus) -> None:
    """Requests a and b started on both, one step's commits: extend_many on the client, extend locally."""
    for eng in (client, local):
        eng.start_request("a", SENTENCE)
        eng.start_request("b", SENTENCE[::-1])
    client.extend_many([("a", SENTENCE[:3]), ("b", np.array(SENTENCE[:2]))])
    for r, t in (("a", SENTENCE[:3]), ("b", SENTENCE[:2])):
        local.extend(r, t)


def test_extend_many_is_extend_for_several_requests_all_or_none(server):
    local = NgramCorpus()
    with CorpusClient(server.target, "default", token=TOKEN) as c:
        c.reset()
        _start_two_and_commit(c, local)
        assert c.draft(["a", "b"], 8).tree(1)[:2] == local.draft(["a", "b"], 8).tree(1)[:2]
        with pytest.raises(ValueError, match="unknown request id 'zz'"):
            c.extend_many([("a", [1]), ("zz", [2])])
        with pytest.raises(ValueError, match="token ids"):
            c.extend_many([("a", [1]), ("b", [-3])])
        # Neither refused call changed anything.
        assert c.draft(["a"], 8).tree(0)[:2] == local.draft(["a"], 8).tree(0)[:2]


def test_async_extend_many_is_extend_for_several_requests_all_or_none(server):
    async def run():
        local = NgramCorpus()
        async with AsyncCorpusClient(server.target, "default", token=TOKEN) as c:
            await c.reset()
            for eng in (c, local):
                for rid, prompt in (("a", SENTENCE), ("b", SENTENCE[::-1])):
                    r = eng.start_request(rid, prompt)
                    if eng is c:
                        await r
            await c.extend_many([("a", SENTENCE[:3]), ("b", np.array(SENTENCE[:2]))])
            for r, t in (("a", SENTENCE[:3]), ("b", SENTENCE[:2])):
                local.extend(r, t)
            assert (await c.draft(["a", "b"], 8)).tree(1)[:2] == local.draft(["a", "b"], 8).tree(1)[:2]
            with pytest.raises(ValueError, match="unknown request id 'zz'"):
                await c.extend_many([("a", [1]), ("zz", [2])])
            with pytest.raises(ValueError, match="token ids"):
                await c.extend_many([("a", [1]), ("b", [-3])])
            await c.extend_many([])
            # Neither refused call changed anything.
            assert (await c.draft(["a"], 8)).tree(0)[:2] == local.draft(["a"], 8).tree(0)[:2]

    asyncio.run(run())


def test_async_client_batches_and_session_end_finishes_requests(server):
    async def run():
        async with AsyncCorpusClient(server.target, "small") as c:
            for i in range(16):
                await c.start_request(i, [i, i + 1, i + 2, i, i + 1])
            batch = await c.draft(list(range(16)), 4)
            assert batch.tokens.shape == (16, 4) and (batch.counts >= 1).all()
            assert batch.tokens[3, 0] == 5  # request 3 copies "3 4 5" after "3 4"
            return (await c.stats())["live_requests"]

    live_before_close = asyncio.run(run())
    assert live_before_close >= 16
    with CorpusClient(server.target, "small") as c:  # the server notices the closed stream shortly
        deadline = time.monotonic() + 10
        while c.stats()["live_requests"] != live_before_close - 16:
            assert time.monotonic() < deadline, (c.stats()["live_requests"], live_before_close)
            time.sleep(0.01)


def test_remote_ngram_corpus_matches_engine_sglang_api(server):
    local = NgramCorpus(draft_token_num=6)
    remote = RemoteNgramCorpus(server.target, "small", draft_token_num=6, token=TOKEN)
    try:
        remote.reset()
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, 50, 40).tolist() for _ in range(5)]
        for eng in (local, remote):
            eng.batch_put(seqs)
            eng.synchronize()
        windows = [s[5:12] for s in seqs[:3]]
        expect = local.batch_get(["a", "b", "c"], windows, [12, 12, 12])
        got = remote.batch_get(["a", "b", "c"], windows, [12, 12, 12])
        assert got[0].dtype == np.int64 and got[1].dtype == np.int64
        np.testing.assert_array_equal(got[0], expect[0])
        np.testing.assert_array_equal(got[1], expect[1])
        remote.erase_match_state(["a", "b", "c"])
        assert remote.load_external_corpus_named("docs", [[1, 2, 3, 4], [5, 6]]) == 6
        assert "docs" not in remote.list_external_corpora()  # invisible until committed
        remote.commit_external_corpus_load("docs", 6)
        assert remote.list_external_corpora()["docs"] == 6
        with pytest.raises(CorpusAlreadyExists):
            remote.load_external_corpus_named("docs", [[1]])
        remote.remove_external_corpus("docs")
        with pytest.raises(CorpusNotFound):
            remote.remove_external_corpus("docs")
    finally:
        remote.close()


def test_health_and_reflection(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "ngram_corpus.v1.Corpus"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"ngram_corpus.v1.Corpus", "grpc.health.v1.Health"} <= names


def test_bad_session_steps_get_status_codes_and_keep_the_session(server):
    with CorpusClient(server.target, "small") as c:
        c.start_request("ok", [1, 2, 3])
        c.flush()
        cases = [
            (lambda: (c.start_request("bad", [5000]), c.flush()), CorpusInvalidArgument, "outside the vocabulary"),
            (lambda: c.draft(["ok"], 33), CorpusOutOfRange, "budget"),
            (lambda: c.draft(["ok"] * 1, 0), ValueError, "budget"),
            (lambda: c.draft(["nope"], 3), ValueError, "unknown request"),
        ]
        for call, exc, text in cases:
            with pytest.raises(exc, match=text):
                call()
        assert not c.has_request("bad")  # a refused step changed nothing
        with pytest.raises(CorpusResourceExhausted, match="max_live_requests_per_session"):
            for i in range(70):
                c.start_request(f"many{i}", [1])
            c.flush()
        assert c.draft(["ok"], 3).counts.shape == (1,)  # the session survived every error


def test_a_refused_draft_keeps_the_steps_operations_pending(server):
    """Only the draft part of a step is refused (a budget beyond the server's): the step's start
    and extends were valid and nothing was applied, so they go with the next step, not lost."""
    with CorpusClient(server.target, "small") as c:
        c.start_request("k", SENTENCE[:6])
        c.extend("k", SENTENCE[6:8])
        with pytest.raises(CorpusOutOfRange, match="draft.budget"):  # by its code: a smaller budget will do
            c.draft(["k"], 33)
        assert c.has_request("k")
        c.extend("k", SENTENCE[8:9])
        # The server holds k's whole context, the refused step's extend (8, 8) included: repeating
        # 41, 8, 8 drafts the 19 that followed it there.
        c.extend("k", SENTENCE[5:8])
        assert c.draft(["k"], 4).tree(0)[0][:1] == [SENTENCE[8]]
        # A step whose operations are bad is dropped whole, as before.
        c.start_request("bad", [5000])
        with pytest.raises(CorpusInvalidArgument, match="vocabulary"):
            c.draft(["k"], 4)
        assert not c.has_request("bad")


def test_bad_raw_messages_on_every_rpc(server, stub):
    def session(*msgs):
        return [r for r in stub.Session(iter(msgs), timeout=5)]

    bad_steps = {
        "unknown namespace": (pb.SessionRequest(seq=1, namespace="nope"), grpc.StatusCode.NOT_FOUND),
        "ragged arrays": (pb.SessionRequest(seq=2, namespace="default", start=pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([3]), tokens=b"\x01\x00")),
                          grpc.StatusCode.INVALID_ARGUMENT),
        "length mismatch": (pb.SessionRequest(seq=3, namespace="default", start=pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([3]), tokens=arrays.pack([1]))),
                            grpc.StatusCode.INVALID_ARGUMENT),
        "negative token": (pb.SessionRequest(seq=4, namespace="default", start=pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([1]), tokens=arrays.pack([-4]))),
                           grpc.StatusCode.INVALID_ARGUMENT),
        "extend unknown": (pb.SessionRequest(seq=5, namespace="default", extend=pb.TokenRuns(req_ids=["zz"], lengths=arrays.pack([1]), tokens=arrays.pack([4]))),
                           grpc.StatusCode.NOT_FOUND),
        "empty id": (pb.SessionRequest(seq=6, namespace="default", finish=[""]), grpc.StatusCode.INVALID_ARGUMENT),
        "duplicate ids": (pb.SessionRequest(seq=7, namespace="default", draft=pb.DraftRequest(req_ids=["a", "a"], budget=2)),
                          grpc.StatusCode.INVALID_ARGUMENT),
        "too large batch": (pb.SessionRequest(seq=8, namespace="default", finish=[str(i) for i in range(200)]),
                            grpc.StatusCode.RESOURCE_EXHAUSTED),
    }
    responses = session(*[m for m, _ in bad_steps.values()])
    for (what, (_, code)), resp in zip(bad_steps.items(), responses):
        assert resp.HasField("error"), what
        assert resp.error.code == code.value[0], (what, resp.error)
        assert resp.error.message, what

    def expect(code, fn, *args, **kw):
        with pytest.raises(grpc.RpcError) as e:
            fn(*args, timeout=5, **kw)
        assert e.value.code() == code, e.value.details()
        assert e.value.details()

    C = grpc.StatusCode
    expect(C.NOT_FOUND, stub.BatchGet, pb.BatchGetRequest(namespace="nope", draft_token_num=4))
    expect(C.INVALID_ARGUMENT, stub.BatchGet, pb.BatchGetRequest(namespace="default", draft_token_num=1))
    expect(C.INVALID_ARGUMENT, stub.BatchGet, pb.BatchGetRequest(
        namespace="default", draft_token_num=4, windows=pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([1]), tokens=arrays.pack([1])),
        total_lens=b"\x01"))
    expect(C.INVALID_ARGUMENT, stub.BatchGet, pb.BatchGetRequest(namespace="default", client_id="a/b", draft_token_num=4))
    expect(C.INVALID_ARGUMENT, stub.BatchPut, pb.BatchPutRequest(namespace="small", lengths=arrays.pack([1]), tokens=arrays.pack([1000])))
    expect(C.INVALID_ARGUMENT, stub.BatchPut, pb.BatchPutRequest(namespace="small", lengths=arrays.pack([-1])))
    expect(C.NOT_FOUND, stub.Stats, pb.StatsRequest(namespace="nope"))
    expect(C.NOT_FOUND, stub.Reset, pb.ResetRequest(namespace="nope"), metadata=ADMIN)
    expect(C.INVALID_ARGUMENT, stub.EraseMatchState, pb.EraseMatchStateRequest(namespace="default", req_ids=[""]))
    expect(C.INVALID_ARGUMENT, stub.CommitExternalCorpus, pb.CommitExternalCorpusRequest(namespace="default", name="../etc"), metadata=ADMIN)
    expect(C.NOT_FOUND, stub.CommitExternalCorpus, pb.CommitExternalCorpusRequest(namespace="default", name="never"), metadata=ADMIN)
    expect(C.NOT_FOUND, stub.RemoveExternalCorpus, pb.RemoveExternalCorpusRequest(namespace="default", name="never"), metadata=ADMIN)
    expect(C.NOT_FOUND, stub.ListExternalCorpora, pb.ListExternalCorporaRequest(namespace="nope"))
    expect(C.INVALID_ARGUMENT, stub.LoadExternalCorpus, iter([]), metadata=ADMIN)
    expect(C.INVALID_ARGUMENT, stub.LoadExternalCorpus, iter([pb.ExternalChunk(namespace="small", name="x", tokens=arrays.pack([1, 2000]))]), metadata=ADMIN)
    assert "x" not in stub.ListExternalCorpora(pb.ListExternalCorporaRequest(namespace="small")).corpora
    expect(C.RESOURCE_EXHAUSTED, stub.BatchPut, pb.BatchPutRequest(namespace="default", tokens=b"\0" * (65 << 20)))

    # A session whose client stalls past its deadline ends with DEADLINE_EXCEEDED and the
    # server drops its state; the server must stay healthy afterwards.
    def stalled():
        yield pb.SessionRequest(seq=1, namespace="default", start=pb.TokenRuns(req_ids=["s"], lengths=arrays.pack([2]), tokens=arrays.pack([1, 2])))
        time.sleep(1.0)

    with pytest.raises(grpc.RpcError) as e:
        list(stub.Session(stalled(), timeout=0.3))
    assert e.value.code() == C.DEADLINE_EXCEEDED
    assert stub.Stats(pb.StatsRequest(), timeout=5).namespaces["default"].values["learned_bytes"] > 0  # alive
