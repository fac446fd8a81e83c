"""Namespace-scoped tokens against a real server process: every RPC and every /v1 route refuses a
missing token (UNAUTHENTICATED / 401), a token of another namespace or a too-small role
(PERMISSION_DENIED / 403), before it looks the namespace up; and no token ever reaches the server's
log, an error message or /metrics."""

from __future__ import annotations

import asyncio
import hashlib
import json

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import AsyncCorpusClient, CorpusClient, RemoteNgramCorpus
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusPermissionDenied, CorpusUnauthenticated
from tests.corpus_service.service_fixtures import TOKEN, ServerProcess, wait_job

TOKENS = {
    "a-read": "tok-a-read-5d1f0c2b9e7a4b63",
    "a-draft": "tok-a-draft-8c3e1a7f0b2d4e95",
    "a-admin": "tok-a-admin-2f9b7d3c1e0a6b48",
    "ops": "tok-ops-all-7a1c4e9f3b2d0c86",
}
WRONG = "tok-a-draft-8c3e1a7f0b2d4e96"  # one character off a real token: must not be echoed either
OK = grpc.StatusCode.OK
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
SEEN_DETAILS: list[str] = []  # every error message the server sent back, checked for tokens at the end


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("secured")
    clients = [{"name": "a-read", "token": TOKENS["a-read"], "namespaces": ["a"], "role": "read"},
               {"name": "a-draft", "token": TOKENS["a-draft"], "namespaces": ["a"], "role": "draft"},
               {"name": "a-admin", "token": TOKENS["a-admin"], "namespaces": ["a"], "role": "admin"},
               # stored as a digest: the file then holds no usable secret
               {"name": "ops", "token_sha256": hashlib.sha256(TOKENS["ops"].encode()).hexdigest(),
                "namespaces": ["*"], "role": "admin"}]
    (d / "tokens.json").write_text(json.dumps({"clients": clients}))
    srv = ServerProcess(d, "--namespace", "a:vocab=1000", "--namespace", "b:vocab=1000",
                        "--client-tokens", str(d / "tokens.json"), "--log-level", "DEBUG")
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()


def md(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def ids(*runs):
    return np.concatenate([np.asarray(r, np.int32) for r in runs])


def rpc(stub: pb_grpc.CorpusStub, method: str, ns: str, token: str | None) -> grpc.StatusCode:
    """Calls ``method`` on namespace ``ns``; the status code (a Session step's in-band error counts)."""
    kw = {"metadata": md(token), "timeout": 10}
    try:
        if method == "Session":
            step = pb.SessionRequest(seq=1, namespace=ns)
            arrays.pack_runs(step.start, ["r"], [ids([1, 2, 3])])
            step.draft.req_ids.append("r")
            step.draft.budget = 4
            resp = next(iter(stub.Session(iter([step]), **kw)))
            if resp.HasField("error"):
                SEEN_DETAILS.append(resp.error.message)
                return grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == resp.error.code))
            return OK
        if method == "BatchGet":
            req = pb.BatchGetRequest(namespace=ns, client_id="c", total_lens=arrays.pack([3], arrays.I64), draft_token_num=4)
            arrays.pack_runs(req.windows, ["r"], [ids([1, 2, 3])])
            stub.BatchGet(req, **kw)
        elif method == "BatchPut":
            stub.BatchPut(pb.BatchPutRequest(namespace=ns, lengths=arrays.pack([3]), tokens=arrays.pack(ids([1, 2, 3]))), **kw)
        elif method == "EraseMatchState":
            stub.EraseMatchState(pb.EraseMatchStateRequest(namespace=ns, client_id="c", req_ids=["r"]), **kw)
        elif method == "LoadExternalCorpus":
            stub.LoadExternalCorpus(iter([pb.ExternalChunk(namespace=ns, name="x", tokens=arrays.pack(ids([4, 5, 6])))]), **kw)
        elif method == "CommitExternalCorpus":
            stub.CommitExternalCorpus(pb.CommitExternalCorpusRequest(namespace=ns, name="x", expected_tokens=-1), **kw)
        elif method == "RemoveExternalCorpus":
            stub.RemoveExternalCorpus(pb.RemoveExternalCorpusRequest(namespace=ns, name="x"), **kw)
        elif method == "ListExternalCorpora":
            stub.ListExternalCorpora(pb.ListExternalCorporaRequest(namespace=ns), **kw)
        elif method == "Stats":
            stub.Stats(pb.StatsRequest(namespace=ns), **kw)
        elif method == "Reset":
            stub.Reset(pb.ResetRequest(namespace=ns), **kw)
        else:
            raise AssertionError(method)
    except grpc.RpcError as e:
        SEEN_DETAILS.append(e.details() or "")
        return e.code()
    return OK


DRAFT_RPCS = ["Session", "BatchGet", "BatchPut", "EraseMatchState"]
READ_RPCS = ["ListExternalCorpora", "Stats"]
ADMIN_RPCS = ["LoadExternalCorpus", "CommitExternalCorpus", "RemoveExternalCorpus", "Reset"]
ALL_RPCS = DRAFT_RPCS + READ_RPCS + ADMIN_RPCS


@pytest.fixture
def stub(secured):
    with grpc.insecure_channel(secured.target) as ch:
        yield pb_grpc.CorpusStub(ch)


def test_every_rpc_needs_a_known_token_but_health_checks_do_not(stub, secured):
    for method in ALL_RPCS:
        assert rpc(stub, method, "a", None) == UNAUTH, method
        assert rpc(stub, method, "a", WRONG) == UNAUTH, method
    with grpc.insecure_channel(secured.target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_client_scoped_to_a_cannot_touch_b_or_probe_for_namespaces(stub):
    for method in ALL_RPCS:
        for ns in ("b", "nope"):  # 'nope' does not exist: still PERMISSION_DENIED, not NOT_FOUND
            assert rpc(stub, method, ns, TOKENS["a-admin"]) == DENIED, (method, ns)
    # The same token works on its own namespace, and a '*' admin on both.
    for method in ("Session", "BatchGet", "BatchPut", "LoadExternalCorpus", "CommitExternalCorpus",
                   "ListExternalCorpora", "Stats", "RemoveExternalCorpus", "EraseMatchState", "Reset"):
        assert rpc(stub, method, "a", TOKENS["a-admin"]) == OK, method
        assert rpc(stub, method, "b", TOKENS["ops"]) == OK, method
    assert rpc(stub, "Stats", "nope", TOKENS["ops"]) == grpc.StatusCode.NOT_FOUND


def test_other_services_need_admin_on_every_namespace(secured):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(token):
        with grpc.insecure_channel(secured.target) as ch:
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            try:
                resp = next(refl.ServerReflectionInfo(iter([req]), metadata=md(token), timeout=10))
            except grpc.RpcError as e:
                return e.code()
            return sorted(s.name for s in resp.list_services_response.service)

    assert list_services(None) == UNAUTH
    assert list_services(TOKENS["a-admin"]) == DENIED  # admin, but of one namespace: default-deny
    assert "ngram_corpus.v1.Corpus" in list_services(TOKENS["ops"])


def test_cli_admin_commands_use_the_client_token(secured):
    import os
    import subprocess
    import sys

    from tests.corpus_service.service_fixtures import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("NGRAM_CORPUS_")}
    env.update(NGRAM_CORPUS_ADMIN_URL=secured.admin_url, NGRAM_CORPUS_TOKEN=TOKENS["a-read"])

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "corpus_service", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60, env=env)

    r = cli("ls", "--namespace", "a")
    assert r.returncode == 0 and r.stdout.startswith("NAME"), r.stderr
    r = cli("ls", "--namespace", "b")
    assert r.returncode == 1 and "HTTP 403" in r.stderr and "may not use namespace 'b'" in r.stderr
    SEEN_DETAILS.append(r.stderr)


def test_roles_read_draft_admin(stub):
    for method in READ_RPCS:
        assert rpc(stub, method, "a", TOKENS["a-read"]) == OK, method
    for method in DRAFT_RPCS + ADMIN_RPCS:
        assert rpc(stub, method, "a", TOKENS["a-read"]) == DENIED, method
    for method in DRAFT_RPCS + READ_RPCS:
        assert rpc(stub, method, "a", TOKENS["a-draft"]) == OK, method
    for method in ADMIN_RPCS:
        assert rpc(stub, method, "a", TOKENS["a-draft"]) == DENIED, method
    # Stats over every namespace lists only those the caller may read.
    assert set(stub.Stats(pb.StatsRequest(), metadata=md(TOKENS["a-draft"])).namespaces) == {"a"}
    assert set(stub.Stats(pb.StatsRequest(), metadata=md(TOKENS["ops"])).namespaces) == {"a", "b"}
    assert set(stub.Stats(pb.StatsRequest(), metadata=md(TOKEN)).namespaces) == {"a", "b"}  # the admin token


def test_clients_send_their_token(secured, monkeypatch):
    prompt = [7, 8, 9, 10, 7, 8]
    with CorpusClient(secured.target, "a", token=TOKENS["a-draft"]) as c:
        c.start_request("r", prompt)
        assert c.draft(["r"], 4).tree(0)[0][:2] == [9, 10]
    with CorpusClient(secured.target, "b", token=TOKENS["a-draft"]) as c:
        c.start_request("r", prompt)
        with pytest.raises(CorpusPermissionDenied, match="may not use namespace 'b'"):
            c.draft(["r"], 4)
    with CorpusClient(secured.target, "a", token=None) as c:
        c.start_request("r", prompt)
        with pytest.raises(CorpusUnauthenticated, match="missing bearer token"):
            c.draft(["r"], 4)
        with pytest.raises(CorpusUnauthenticated):
            c.stats()
    monkeypatch.setenv("NGRAM_CORPUS_TOKEN", TOKENS["a-draft"])  # what SGLang workers and the verifier read

    async def aio() -> list[int]:
        async with AsyncCorpusClient(secured.target, "a") as ac:
            await ac.start_request("r", prompt)
            return (await ac.draft(["r"], 4)).tree(0)[0]

    assert asyncio.run(aio())[:2] == [9, 10]

    async def aio_without_token() -> None:
        async with AsyncCorpusClient(secured.target, "a", token="") as ac:  # "": none, whatever the environment says
            await ac.start_request("r", prompt)
            await ac.draft(["r"], 4)

    with pytest.raises(CorpusUnauthenticated):
        asyncio.run(aio_without_token())
    remote = RemoteNgramCorpus(secured.target, "a", draft_token_num=4)
    try:
        remote.batch_put([prompt])
        remote.synchronize()
        drafts, _ = remote.batch_get(["q"], [[7, 8]], [2])
        assert drafts.tolist()[:3] == [8, 9, 10]
    finally:
        remote.close()


def test_rest_routes_are_scoped_too(secured):
    def http(name):
        return secured.http(TOKENS[name] if name in TOKENS else name)

    with secured.http(None) as h:
        for path in ("/v1/namespaces", "/v1/namespaces/a", "/v1/namespaces/a/corpora", "/v1/stats"):
            r = h.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", path
        assert h.put("/v1/namespaces/a/corpora/x", content=b'{"ids": [1]}\n').status_code == 401
        assert h.get("/healthz").status_code == 200  # probes need no token
        assert h.get("/metrics").status_code == 401  # its series name every namespace
    with secured.http(WRONG) as h:
        r = h.get("/v1/namespaces")
        assert r.status_code == 403
        SEEN_DETAILS.append(r.text)
    with http("a-read") as h:
        r = h.get("/metrics")  # a client scoped to 'a' must not enumerate 'b' through the metrics
        assert r.status_code == 403 and "every namespace" in r.json()["error"]["message"]
        assert [n["name"] for n in h.get("/v1/namespaces").json()] == ["a"]
        assert set(h.get("/v1/stats").json()) == {"a"}
        for path in ("/v1/namespaces/b", "/v1/namespaces/b/corpora", "/v1/namespaces/b/corpora/x",
                     "/v1/namespaces/nope", "/v1/namespaces/nope/corpora"):
            r = h.get(path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", path
            SEEN_DETAILS.append(r.text)
        assert h.get("/v1/namespaces/a/corpora").status_code == 200
        assert h.put("/v1/namespaces/a/corpora/x", content=b'{"ids": [1]}\n').status_code == 403  # read role
    with http("a-admin") as h:
        r = h.put("/v1/namespaces/a/corpora/docs", content=b'{"ids": [1, 2, 3]}\n')
        assert r.status_code == 202, r.text
        job_a = r.json()["id"]
        assert wait_job(h, job_a)["state"] == "done"
        for r in (h.put("/v1/namespaces/b/corpora/docs", content=b'{"ids": [1]}\n'),
                  h.delete("/v1/namespaces/b/corpora/docs"), h.post("/v1/snapshot")):
            assert r.status_code == 403, r.text
    with http("ops") as h:
        r = h.put("/v1/namespaces/b/corpora/docs", content=b'{"ids": [4, 5, 6]}\n')
        assert r.status_code == 202, r.text
        job_b = r.json()["id"]
        assert wait_job(h, job_b)["state"] == "done"
        assert h.post("/v1/snapshot").status_code == 200
    with http("a-read") as h:
        assert h.get(f"/v1/jobs/{job_a}").status_code == 200
        assert h.get(f"/v1/jobs/{job_b}").status_code == 403
        assert h.get("/v1/namespaces/a/corpora/docs").json()["tokens"] == 3
    with http("a-admin") as h:
        assert h.delete("/v1/namespaces/a/corpora/docs").status_code == 204


def test_no_token_in_logs_error_messages_or_metrics(secured, stub):
    # Exercise the refusal paths once more (this test must also pass on its own).
    for token in (None, WRONG, TOKENS["a-read"], TOKENS["a-admin"]):
        rpc(stub, "Reset", "b", token)
        rpc(stub, "Session", "b", token)
    with secured.http(WRONG) as h:
        SEEN_DETAILS.append(h.delete("/v1/namespaces/a/corpora/x").text)
    with secured.http(TOKENS["ops"]) as h:  # a scraper's token: read on every namespace
        metrics = h.get("/metrics").text
    assert 'ngram_corpus_auth_refused_total{code="UNAUTHENTICATED",surface="grpc"}' in metrics
    assert 'ngram_corpus_auth_refused_total{code="PERMISSION_DENIED",surface="grpc"}' in metrics
    log = secured.log_path.read_text(errors="replace")
    assert "refused /ngram_corpus.v1.Corpus/Reset" in log  # the DEBUG log did record the refusals
    assert SEEN_DETAILS
    secrets = [*TOKENS.values(), WRONG, TOKEN, hashlib.sha256(TOKENS["ops"].encode()).hexdigest()]
    for where, text in [("log", log), ("metrics", metrics), *(("error", d) for d in SEEN_DETAILS)]:
        for secret in secrets:
            assert secret not in text, f"a token leaked into the {where}"
