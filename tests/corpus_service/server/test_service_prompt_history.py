"""Prompt keys, policy versions and the prompt history over every surface of a real server process
(127.0.0.1, ephemeral ports): gRPC Session start/restore and BatchGet, AnnouncePolicyVersion (admin
role, FAILED_PRECONDITION for an older version, INVALID_ARGUMENT for bad fields), the REST admin's
POST /v1/namespaces/{ns}/policy-version, the sync, asyncio and SGLang drop-in clients, the CLI, and
the history surviving a restart (snapshot)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import AsyncCorpusClient, CorpusClient
from corpus_service.client.request_log import RequestLog
from corpus_service.client.sglang import RemoteNgramCorpus
from corpus_service.engine.prompt_keys import default_prompt_key
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusError, CorpusFailedPrecondition
from tests.corpus_service.service_fixtures import REPO, TOKEN, ServerProcess

PROMPT = [5, 17, 9, 33, 2, 41, 8]
OUTPUT = [300, 301, 302, 303, 304, 305]
# Namespaces whose learned corpus does not draft (weight 0, min_prob leaves its nodes out): a draft
# of a finished rollout comes from the prompt history alone.
HISTORY_ONLY = "learned_weight=0,min_prob=0.01,history_max_age=2"


@pytest.fixture(scope="module")
def hist_server(tmp_path_factory):
    data = tmp_path_factory.mktemp("history")
    srv = ServerProcess(data, *(a for i in range(6) for a in ("--namespace", f"h{i}:{HISTORY_ONLY}")),
                        "--namespace", "off:learned_weight=0,min_prob=0.01,history_max_bytes=0")
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()


def rollout(c: CorpusClient, rid: str, output=OUTPUT, prompt=PROMPT, **kw) -> None:
    c.start_request(rid, prompt, **kw)
    c.extend(rid, output)
    c.finish(rid)
    c.flush()


def chain(batch, row: int = 0) -> list[int]:
    toks, parents, _ = batch.tree(row)
    out, node = [], -1
    for i, (t, p) in enumerate(zip(toks, parents)):
        if p == node:
            out.append(t)
            node = i
    return out


# ------------------------------------------------------------------ gRPC Session: start, restore


def test_session_start_carries_key_and_version_across_sessions(hist_server):
    with CorpusClient(hist_server.target, "h0") as a, CorpusClient(hist_server.target, "h0") as b:
        rollout(a, "s0", prompt_key="task/1", policy_version=1)
        stats = a.stats()
        assert stats["history_rollouts"] == 1 and stats["history_keys"] == 1
        # A small key costs its fixed tables: the bound holds per charged token (at least 256 a key).
        assert 0 < stats["history_bytes"] <= 48 * stats["history_charged_tokens"]
        assert stats["history_bytes_per_charged_token"] <= 48
        b.start_request("s1", PROMPT, prompt_key="task/1", policy_version=1)  # another session, same key
        b.start_request("x", PROMPT, prompt_key="task/2")
        batch = b.draft(["s1", "x"], 8)
        assert chain(batch, 0) == OUTPUT and batch.tree(1)[0] == []
        # The request's version is 3: the rollout of version 1 is max_age (2) apart.
        b.start_request("far", PROMPT, prompt_key="task/1", policy_version=3)
        assert b.draft(["far"], 8).tree(0)[0] == []


def test_default_key_over_grpc_is_the_prompt_hash(hist_server):
    with CorpusClient(hist_server.target, "h1") as c:
        rollout(c, "a", prompt_key=None)
        c.start_request("b", PROMPT, prompt_key=default_prompt_key(PROMPT))  # the same key, named
        assert chain(c.draft(["b"], 8)) == OUTPUT


def test_abandoned_requests_add_no_rollout(hist_server):
    with CorpusClient(hist_server.target, "h2") as c:
        c.start_request("a", PROMPT, prompt_key="k")
        c.extend("a", OUTPUT)
        c.finish("a", rollout=False)  # sent as 'abandon'
        c.flush()
        assert c.stats()["history_rollouts"] == 0


def test_restore_carries_keys_and_versions():
    # After a lost stream the client re-creates its requests in one restore message: with their keys.
    log = RequestLog()
    log.start("a", np.array(PROMPT, np.int32), "", ("k", 4))
    log.start("x", np.array(PROMPT, np.int32))
    first = log.build(1, "default", [], 0, replay=True)
    assert list(first.start.prompt_keys) == ["k", ""] and list(first.start.policy_versions) == [4, -1]
    log.commit()
    replay = log.build(2, "default", [], 0, replay=True)
    assert list(replay.restore.req_ids) == ["a", "x"]
    assert list(replay.restore.prompt_keys) == ["k", ""] and list(replay.restore.policy_versions) == [4, -1]


def test_restored_request_drafts_from_its_keys_history_and_adds_its_rollout(hist_server):
    with CorpusClient(hist_server.target, "h3") as c:
        rollout(c, "s0", prompt_key="restored", policy_version=0)
    with grpc.insecure_channel(hist_server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        restore = pb.TokenRuns(req_ids=["r"], lengths=arrays.pack([len(PROMPT) + 2]),
                               tokens=arrays.pack(PROMPT + OUTPUT[:2]), prompt_keys=["restored"], policy_versions=[0])
        step1 = pb.SessionRequest(seq=1, namespace="h3", restore=restore, draft=pb.DraftRequest(req_ids=["r"], budget=4))
        step2 = pb.SessionRequest(seq=2, namespace="h3", extend=pb.TokenRuns(req_ids=["r"], lengths=arrays.pack([1]),
                                                                             tokens=arrays.pack([999])), finish=["r"])
        first, second = list(stub.Session(iter([step1, step2]), timeout=10))
        assert not first.HasField("error") and not second.HasField("error"), (first.error, second.error)
        assert arrays.unpack_drafts(first.drafts, 1).tree(0)[0] == OUTPUT[2:6]
    with CorpusClient(hist_server.target, "h3") as c:
        assert c.stats()["history_rollouts"] == 2


@pytest.mark.parametrize("keys, versions, message", [
    (["a\nb"], [], "prompt_keys: expected 1-256 characters"),
    (["x" * 257], [], "prompt_keys: expected 1-256 characters"),
    (["k", "k"], [], "one key per request id"),
    ([], [-2], "policy_versions: expected -1"),
    ([], [1, 2], "one version per request id"),
])
def test_bad_session_history_fields_are_invalid_argument(hist_server, keys, versions, message):
    with grpc.insecure_channel(hist_server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        start = pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([2]), tokens=arrays.pack([1, 2]),
                             prompt_keys=keys, policy_versions=versions)
        ok = pb.SessionRequest(seq=2, namespace="h4", start=pb.TokenRuns(req_ids=["a"], lengths=arrays.pack([1]),
                                                                         tokens=arrays.pack([1])))
        bad, after = list(stub.Session(iter([pb.SessionRequest(seq=1, namespace="h4", start=start), ok]), timeout=5))
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in bad.error.message
        assert not after.HasField("error")  # nothing of the refused step was applied


def test_clients_refuse_bad_keys_and_versions_before_sending(hist_server):
    with CorpusClient(hist_server.target, "h4") as c:
        with pytest.raises(ValueError, match="prompt_key"):
            c.start_request("a", PROMPT, prompt_key="")
        with pytest.raises(TypeError, match="prompt_key"):
            c.start_request("a", PROMPT, prompt_key=7)
        with pytest.raises(ValueError, match="policy_version"):
            c.start_request("a", PROMPT, policy_version=-1)
        with pytest.raises(ValueError, match="version"):
            c.announce_policy_version(-3)
        assert not c.has_request("a")


# ------------------------------------------------------------------ AnnouncePolicyVersion


def test_announce_needs_the_admin_token_and_moves_forward_only(hist_server):
    with CorpusClient(hist_server.target, "h5") as anon:
        with pytest.raises(CorpusError) as e:
            anon.announce_policy_version(1)
        assert e.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    with CorpusClient(hist_server.target, "h5", token=TOKEN) as c:
        assert c.announce_policy_version(3) == 3
        assert c.announce_policy_version(3) == 3
        with pytest.raises(CorpusFailedPrecondition, match="older"):
            c.announce_policy_version(2)
        assert c.stats()["policy_version"] == 3
        # A request without a version is sampled by the namespace's: its rollout says 3.
        rollout(c, "a", prompt_key="k")
        assert c.stats()["history_rollouts"] == 1
        assert c.announce_policy_version(5) == 5  # version 3 is now max_age (2) old: dropped
        assert c.stats()["history_rollouts"] == 0
    with grpc.insecure_channel(hist_server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        meta = (("authorization", f"Bearer {TOKEN}"),)
        with pytest.raises(grpc.RpcError) as e:
            stub.AnnouncePolicyVersion(pb.AnnouncePolicyVersionRequest(namespace="h5", version=4), metadata=meta, timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            stub.AnnouncePolicyVersion(pb.AnnouncePolicyVersionRequest(namespace="h5", version=-1), metadata=meta, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            stub.AnnouncePolicyVersion(pb.AnnouncePolicyVersionRequest(namespace="nope", version=9), metadata=meta, timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


# ------------------------------------------------------------------ BatchGet / RemoteNgramCorpus


def test_sglang_drop_in_carries_keys_and_adds_the_rollout_when_erased(hist_server):
    with CorpusClient(hist_server.target, "h0", token=TOKEN) as admin:
        base = admin.stats()["history_rollouts"]
    remote = RemoteNgramCorpus(hist_server.target, "h0", draft_token_num=8, token=TOKEN)
    try:
        window = PROMPT
        remote.batch_get(["w0"], [window], [len(window)], prompt_keys=["sglang/1"], policy_versions=[2])
        full = PROMPT + OUTPUT
        remote.batch_get(["w0"], [full[-8:]], [len(full)])
        remote.erase_match_state(["w0"])  # the request ends: its output joins the key's history
        drafts, _ = remote.batch_get(["w1"], [PROMPT], [len(PROMPT)], prompt_keys=["sglang/1"], policy_versions=[2])
        assert drafts.tolist()[:7] == [PROMPT[-1]] + OUTPUT  # row 0: the last token, then the history's continuation
        assert remote.announce_policy_version(2) == 2
        with pytest.raises(ValueError, match="prompt_key"):
            remote.batch_get(["w2"], [PROMPT], [len(PROMPT)], prompt_keys=[""])
        remote.erase_match_state(["w1"])
    finally:
        remote.close()
    with CorpusClient(hist_server.target, "h0") as c:
        assert c.stats()["history_rollouts"] == base + 1  # w1 had no output to add
    with grpc.insecure_channel(hist_server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        req = pb.BatchGetRequest(namespace="h0", client_id="raw", total_lens=arrays.pack([2], arrays.I64),
                                 draft_token_num=4, prompt_keys=["bad\x01key"])
        arrays.pack_runs(req.windows, ["a"], [[1, 2]])
        with pytest.raises(grpc.RpcError) as e:
            stub.BatchGet(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_keys" in e.value.details()


# ------------------------------------------------------------------ asyncio client


def test_async_client_keys_versions_and_announce(hist_server):
    async def run():
        async with AsyncCorpusClient(hist_server.target, "h1", token=TOKEN) as c:
            assert await c.announce_policy_version(1) == 1
            await c.start_request("a", PROMPT, prompt_key="async/1")
            await c.extend("a", OUTPUT)
            await c.finish("a")
            await c.flush()
            await c.start_request("b", PROMPT, prompt_key="async/1", policy_version=1)
            tree = chain(await c.draft(["b"], 8))
            with pytest.raises(CorpusFailedPrecondition):
                await c.announce_policy_version(0)
            with pytest.raises(ValueError, match="prompt_key"):
                await c.start_request("z", PROMPT, prompt_key="\t")
            return tree, (await c.stats())["policy_version"]

    tree, version = asyncio.run(run())
    assert tree == OUTPUT and version == 1


# ------------------------------------------------------------------ REST admin and CLI


def test_rest_policy_version(hist_server):
    with hist_server.http() as http:
        r = http.post("/v1/namespaces/h2/policy-version", json={"version": 4})
        assert r.status_code == 200 and r.json() == {"namespace": "h2", "policy_version": 4}
        assert http.post("/v1/namespaces/h2/policy-version", json={"version": 4}).json()["policy_version"] == 4
        r = http.post("/v1/namespaces/h2/policy-version", json={"version": 3})
        assert r.status_code == 409 and "older" in r.text
        for body in ({"version": -1}, {"version": "x"}, {}, {"version": 1 << 62}):
            r = http.post("/v1/namespaces/h2/policy-version", json=body)
            assert 400 <= r.status_code < 500 and r.status_code != 409 and "version" in r.text, (body, r.text)
        assert http.post("/v1/namespaces/missing/policy-version", json={"version": 1}).status_code == 404
    with hist_server.http(token=None) as anon:
        assert anon.post("/v1/namespaces/h2/policy-version", json={"version": 9}).status_code == 401
    with hist_server.http(token="wrong-token-wrong-token") as bad:
        assert bad.post("/v1/namespaces/h2/policy-version", json={"version": 9}).status_code in (401, 403)
    with CorpusClient(hist_server.target, "h2") as c:
        assert c.stats()["policy_version"] == 4


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "corpus_service", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_cli_policy_version(hist_server):
    env = {"NGRAM_CORPUS_ADMIN_URL": hist_server.admin_url, "NGRAM_CORPUS_ADMIN_TOKEN": TOKEN}
    r = cli("policy-version", "7", "--namespace", "h3", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"namespace": "h3", "policy_version": 7}
    r = cli("policy-version", "6", "--namespace", "h3", env=env)
    assert r.returncode == 1 and "409" in r.stderr and "older" in r.stderr
    r = cli("policy-version", "-1", "--namespace", "h3", env=env)
    assert r.returncode == 2 and "expected an int in [0, 2**62)" in r.stderr
    r = cli("policy-version", "8", "--namespace", "bad name!", env=env)
    assert r.returncode == 2 and "policy-version" in r.stderr
    r = cli("policy-version", "8", "--namespace", "h3", "--token", "wrong-token-wrong-token", env=env)
    assert r.returncode == 1 and "HTTP 403" in r.stderr


# ------------------------------------------------------------------ persistence: a restart keeps the history


def test_history_and_version_survive_a_restart(tmp_path):
    srv = ServerProcess(tmp_path, "--namespace", f"p:{HISTORY_ONLY}")
    srv.start()
    try:
        with CorpusClient(srv.target, "p", token=TOKEN) as c:
            c.announce_policy_version(2)
            rollout(c, "a", prompt_key="persist/1")
            before = c.stats()
        assert srv.stop() == 0  # SIGTERM: drain and snapshot
        srv.start()
        with CorpusClient(srv.target, "p") as c:
            after = c.stats()
            assert after["policy_version"] == 2
            assert (after["history_rollouts"], after["history_tokens"]) == (before["history_rollouts"], before["history_tokens"]) == (1, len(PROMPT + OUTPUT))
            c.start_request("b", PROMPT, prompt_key="persist/1")
            assert chain(c.draft(["b"], 8)) == OUTPUT
    finally:
        if srv.alive():
            srv.stop()


def test_history_off_namespace_keeps_nothing(hist_server):
    with CorpusClient(hist_server.target, "off") as c:
        rollout(c, "a", prompt_key="k")
        s = c.stats()
        assert s["history_rollouts"] == 0 and s["history_max_charged_tokens"] == 0
        c.start_request("b", PROMPT, prompt_key="k")
        assert c.draft(["b"], 8).tree(0)[0] == []

