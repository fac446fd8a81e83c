"""One authority and one catalog for admin actions, against real server processes: the admin token
guards the gRPC admin methods as it guards REST writes; a removal or load over gRPC is what REST
lists, what the data directory persists (kill -9) and what /v1/integrity checks; a corpus is
replaced atomically under its name (drafts never see a window without it)."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import CorpusClient, RemoteNgramCorpus
from corpus_service.protocol import arrays
from tests.corpus_service.service_fixtures import TOKEN, ServerProcess, wait_job

C = grpc.StatusCode
V1 = list(range(300, 340))  # two versions of one corpus: a context of either continues differently
V2 = list(range(600, 640))


def md(token):
    return (("authorization", f"Bearer {token}"),) if token else None


def put(http, name, ids, **params):
    return http.put(f"/v1/namespaces/default/corpora/{name}", params={"format": "jsonl", **params},
                    content=json.dumps({"ids": ids}) + "\n")


def listed(http) -> dict:
    return {c["name"]: c for c in http.get("/v1/namespaces/default/corpora").json()}


def continues(target, doc) -> bool:
    """A draft from doc[:6] continues with doc[6:9]."""
    with CorpusClient(target, "default", timeout=10.0) as c:
        c.start_request("probe", doc[:6])
        tokens = c.draft(["probe"], 6).tree(0)[0]
        c.finish("probe")
    return tokens[:3] == doc[6:9]


def test_the_admin_token_guards_the_grpc_admin_methods(server):
    """An admin token and no client tokens: REST writes needed it, gRPC Reset and
    RemoveExternalCorpus did not. Now every admin method needs it; drafting and reads stay open."""
    with server.http() as http:
        assert wait_job(http, put(http, "guarded", V1).json()["id"])["state"] == "done"
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        calls = {
            "Reset": lambda m: stub.Reset(pb.ResetRequest(namespace="default"), metadata=m, timeout=10),
            "RemoveExternalCorpus": lambda m: stub.RemoveExternalCorpus(
                pb.RemoveExternalCorpusRequest(namespace="default", name="guarded"), metadata=m, timeout=10),
            "LoadExternalCorpus": lambda m: stub.LoadExternalCorpus(
                iter([pb.ExternalChunk(namespace="default", name="g2", tokens=arrays.pack([1, 2, 3]))]), metadata=m, timeout=10),
            "CommitExternalCorpus": lambda m: stub.CommitExternalCorpus(
                pb.CommitExternalCorpusRequest(namespace="default", name="g2", expected_tokens=-1), metadata=m, timeout=10),
        }
        for name, call in calls.items():
            for token, code in ((None, C.UNAUTHENTICATED), ("not-the-admin-token-0123", C.UNAUTHENTICATED)):
                with pytest.raises(grpc.RpcError) as e:
                    call(md(token))
                assert e.value.code() == code, (name, token, e.value.details())
        assert continues(server.target, V1)  # nothing was removed or reset
        stub.Stats(pb.StatsRequest(namespace="default"), timeout=10)  # reads need no token
        with CorpusClient(server.target, "default") as c:  # nor does drafting
            c.start_request("r", [1, 2, 3])
            c.draft(["r"], 4)
        stub.RemoveExternalCorpus(pb.RemoveExternalCorpusRequest(namespace="default", name="guarded"),
                                  metadata=md(TOKEN), timeout=10)
        stub.Reset(pb.ResetRequest(namespace="default"), metadata=md(TOKEN), timeout=10)


def test_grpc_removals_and_loads_are_what_rest_lists_persists_and_checks(tmp_path):
    srv = ServerProcess(tmp_path, "--snapshot-interval-s", "0").start()
    try:
        with srv.http() as http:
            assert wait_job(http, put(http, "up", V1).json()["id"])["state"] == "done"
        remote = RemoteNgramCorpus(srv.target, "default", token=TOKEN)
        try:
            remote.remove_external_corpus("up")  # uploaded over REST, removed over gRPC
            assert remote.load_external_corpus_named("rpc", [V2[:20], V2[20:]]) == 40
            remote.commit_external_corpus_load("rpc", 40)
        finally:
            remote.close()
        with srv.http() as http:
            entries = listed(http)
            assert "up" not in entries, entries  # was still listed 'ready' after a gRPC removal
            assert http.get("/v1/namespaces/default/corpora/up").status_code == 404
            assert entries["rpc"]["state"] == "ready" and entries["rpc"]["tokens"] == 40
            assert entries["rpc"]["source"] == "grpc"
            r = http.get("/v1/integrity")
            assert r.status_code == 200 and r.json()["ok"], r.text
        srv.kill()  # no snapshot: only the data directory remembers
        srv.start()
        with srv.http() as http:
            entries = listed(http)
            assert "up" not in entries
            assert entries.get("rpc", {}).get("state") in ("building", "ready", "acknowledged")
            for name, e in entries.items():
                if e["state"] != "ready":
                    wait_job(http, e["job_id"])
            assert listed(http)["rpc"]["tokens"] == 40
            assert http.get("/v1/integrity").json()["ok"]
        assert continues(srv.target, V2) and not continues(srv.target, V1)
        with srv.http() as http:  # a REST delete of a gRPC-loaded corpus: gone for gRPC too
            assert http.delete("/v1/namespaces/default/corpora/rpc").status_code == 204
        with grpc.insecure_channel(srv.target) as ch:
            corpora = pb_grpc.CorpusStub(ch).ListExternalCorpora(pb.ListExternalCorporaRequest(namespace="default"),
                                                                  timeout=10).corpora
        assert "rpc" not in corpora
    finally:
        if srv.alive():
            srv.stop()


def test_a_corpus_is_replaced_atomically_under_its_name(tmp_path):
    srv = ServerProcess(tmp_path, "--snapshot-interval-s", "0").start()
    try:
        with srv.http() as http:
            assert wait_job(http, put(http, "docs", V1).json()["id"])["state"] == "done"
            r = put(http, "docs", V2)  # a taken name: 409 unless replace is asked for
            assert r.status_code == 409 and "replace=true" in r.json()["error"]["message"]
            assert http.post("/v1/snapshot").status_code == 200  # the snapshot holds V1
        # Drafts probed while the replacement builds: every one continues V1 or V2, never neither.
        seen, stop = [], threading.Event()

        def probe() -> None:
            with CorpusClient(srv.target, "default", timeout=10.0) as c:
                i = 0
                while not stop.is_set():
                    i += 1
                    c.start_request(f"p{i}", V1[:6])
                    c.start_request(f"q{i}", V2[:6])
                    batch = c.draft([f"p{i}", f"q{i}"], 6)
                    seen.append((batch.tree(0)[0][:3] == V1[6:9], batch.tree(1)[0][:3] == V2[6:9]))
                    c.finish(f"p{i}")
                    c.finish(f"q{i}")

        worker = threading.Thread(target=probe)
        worker.start()
        try:
            # Many documents, so the build takes a while; the probes run through it.
            body = "".join(json.dumps({"ids": V2}) + "\n" for _ in range(3000))
            with srv.http() as http:
                r = http.put("/v1/namespaces/default/corpora/docs", params={"format": "jsonl", "replace": "true"},
                             content=body)
                assert r.status_code == 202, r.text
                assert wait_job(http, r.json()["id"])["state"] == "done"
        finally:
            stop.set()
            worker.join(30)
        assert seen and all(v1 or v2 for v1, v2 in seen), seen[-5:]
        assert seen[-1] == (False, True)
        with srv.http() as http:
            entries = listed(http)
            assert list(entries) == ["docs"] and entries["docs"]["tokens"] == 3000 * len(V2)
        # kill -9 before any snapshot holds V2: the restart must rebuild V2, not trust the V1 snapshot.
        srv.kill()
        srv.start()
        with srv.http() as http:
            e = listed(http)["docs"]
            if e["state"] != "ready":
                wait_job(http, e["job_id"], timeout=120)
            assert listed(http)["docs"]["tokens"] == 3000 * len(V2)
        assert continues(srv.target, V2) and not continues(srv.target, V1)
    finally:
        if srv.alive():
            srv.stop()
