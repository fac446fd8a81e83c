"""Request groups over the gRPC service (a real server process): the group field round trip with the
sync and asyncio clients, session scoping, replay after a lost stream, and bad group fields."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import AsyncCorpusClient, CorpusClient
from corpus_service.client.request_log import RequestLog
from corpus_service.protocol import arrays
from tests.corpus_service.service_fixtures import TOKEN

PROMPT = [5, 17, 9, 33, 2, 41, 8]
STORY = [100, 101, 102, 103, 104, 105]


def test_group_field_round_trip(server):
    with CorpusClient(server.target, "default", token=TOKEN) as c, CorpusClient(server.target, "default") as other:
        c.reset()
        c.start_request("a", PROMPT, group="req-1")
        c.start_request("b", PROMPT, group="req-1")
        c.start_request("x", PROMPT)  # no group: an old-style start
        other.start_request("o", PROMPT, group="req-1")  # same key, another session: another group
        c.extend("a", STORY)
        for rid in ("b", "x"):
            c.extend(rid, STORY[:1])
        other.extend("o", STORY[:1])
        batch = c.draft(["b", "x"], 6)
        assert batch.tree(0)[0][:5] == STORY[1:] and batch.tree(1)[0] == []
        assert other.draft(["o"], 6).tree(0)[0] == []
        assert c.stats()["live_groups"] == 2
        for rid in ("a", "b", "x"):
            c.finish(rid)
        c.flush()
        assert c.stats()["live_groups"] == 1  # the other session's group lives on


def test_async_client_starts_groups(server):
    async def run():
        async with AsyncCorpusClient(server.target, "small") as c:
            await c.start_request("a", PROMPT, group="g")
            await c.start_request("b", PROMPT, group="g")
            await c.extend("a", [200, 201, 202])
            await c.extend("b", [200])
            return (await c.draft(["b"], 4)).tree(0)[0]

    assert asyncio.run(run()) == [201, 202]


def test_replay_carries_the_groups():
    # After a lost stream the client re-creates its requests in one restore message: with their groups.
    log = RequestLog()
    log.start("a", np.array(PROMPT, np.int32), "g")
    log.start("x", np.array(PROMPT, np.int32))
    first = log.build(1, "default", [], 0, replay=True)
    assert list(first.start.req_ids) == ["a", "x"] and list(first.start.groups) == ["g", ""]
    log.commit()
    log.start("y", np.array(PROMPT, np.int32))
    replay = log.build(2, "default", [], 0, replay=True)
    assert list(replay.restore.req_ids) == ["a", "x"] and list(replay.restore.groups) == ["g", ""]
    assert list(replay.start.groups) == []  # no group among the new starts: the field stays empty


def test_restored_requests_draft_from_each_other(server):
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        restore = pb.TokenRuns(req_ids=["a", "b"], lengths=arrays.pack([len(PROMPT) + 4, len(PROMPT) + 1]),
                               tokens=arrays.pack(PROMPT + [300, 301, 302, 303] + PROMPT + [300]), groups=["g", "g"])
        msg = pb.SessionRequest(seq=1, namespace="small", restore=restore,
                                draft=pb.DraftRequest(req_ids=["b"], budget=4))
        (resp,) = list(stub.Session(iter([msg]), timeout=5))
        assert not resp.HasField("error"), resp.error
        assert arrays.unpack_drafts(resp.drafts, 1).tree(0)[0] == [301, 302, 303]


@pytest.mark.parametrize(
    "groups, message",
    [(["g"], "one group key per request id"), (["g", "x" * 257], "at most 256 characters")],
)
def test_bad_group_fields_are_invalid_argument(server, groups, message):
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        start = pb.TokenRuns(req_ids=["a", "b"], lengths=arrays.pack([1, 1]), tokens=arrays.pack([1, 2]), groups=groups)
        ok = pb.SessionRequest(seq=2, namespace="default", start=pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([1]),
                                                                              tokens=arrays.pack([1])))
        bad, after = list(stub.Session(iter([pb.SessionRequest(seq=1, namespace="default", start=start), ok]), timeout=5))
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in bad.error.message
        assert not after.HasField("error")  # nothing of the refused step was applied: "a" starts fine


def test_client_refuses_bad_group_keys(server):
    with CorpusClient(server.target, "default") as c:
        with pytest.raises(ValueError, match="group: expected 1-256"):
            c.start_request("a", PROMPT, group="")
        with pytest.raises(TypeError, match="group: expected str or None"):
            c.start_request("a", PROMPT, group=3)
        assert not c.has_request("a")
