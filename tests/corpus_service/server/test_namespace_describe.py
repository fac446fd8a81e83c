"""What a client learns about the namespaces it may use: vocabulary, tokenizer and its probe ids,
and statistics whose counters are integers (Stats over gRPC, /v1/stats over REST, the clients)."""

from __future__ import annotations

import asyncio

from corpus_service.client import CorpusClient
from corpus_service.client.aio import AsyncCorpusClient
from corpus_service.engine.tokenizer import PROBE_TEXT, load_tokenizer


def test_describe_namespaces_names_vocab_tokenizer_and_probe(server):
    want = load_tokenizer("smollm2").encode(PROBE_TEXT, add_special_tokens=False).ids
    with CorpusClient(server.target, "default") as c:
        info = c.describe_namespaces()
    assert sorted(info) == ["default", "small", "smollm2"]
    assert info["smollm2"] == {"vocab_size": 49152, "tokenizer": "smollm2", "tokenizer_probe": want,
                               "tokenizer_error": ""}
    assert info["small"] == {"vocab_size": 1000, "tokenizer": "", "tokenizer_probe": [], "tokenizer_error": ""}

    async def run():
        async with AsyncCorpusClient(server.target, "smollm2") as ac:
            return await ac.describe_namespaces()

    assert asyncio.run(run()) == info


def test_counters_are_integers_over_grpc_rest_and_the_async_client(server):
    with CorpusClient(server.target, "small") as c:
        c.start_request("r", [1, 2, 3, 1, 2])
        c.draft(["r"], 4)
        stats = c.stats()
    assert type(stats["learned_tokens"]) is int and type(stats["live_requests"]) is int
    assert type(stats["drafts"]) is int and stats["drafts"] >= 1
    assert type(stats["draft_seconds"]) is float  # seconds stay fractional

    async def run():
        async with AsyncCorpusClient(server.target, "small") as ac:
            return await ac.stats()

    assert type(asyncio.run(run())["external_tokens"]) is int
    with server.http() as http:
        rest = http.get("/v1/stats").json()["small"]
        ns = http.get("/v1/namespaces/small").json()["stats"]
    assert type(rest["drafts"]) is int and type(ns["learned_bytes"]) is int
    assert type(rest["draft_seconds"]) is float


def test_a_tokenizer_that_cannot_be_loaded_is_reported_not_hidden(tmp_path):
    from tests.corpus_service.service_fixtures import ServerProcess

    missing = tmp_path / "nowhere" / "tokenizer.json"
    srv = ServerProcess(tmp_path, "--namespace", f"broken:vocab=100,tokenizer={missing}").start()
    try:
        with CorpusClient(srv.target, "broken") as c:
            info = c.describe_namespaces()["broken"]
        assert info["tokenizer"] == "tokenizer.json" and info["tokenizer_probe"] == []
        assert "cannot be loaded" in info["tokenizer_error"] and str(tmp_path) not in info["tokenizer_error"]
        with srv.http() as http:
            ns = http.get("/v1/namespaces/broken").json()
            assert ns["tokenizer"] == "tokenizer.json" and ns["tokenizer_error"] == info["tokenizer_error"]
            assert 'ngram_corpus_tokenizer_errors_total{namespace="broken"} 1.0' in http.get("/metrics").text
        assert srv.log().count("cannot be loaded") == 1  # logged once, not per Stats call
    finally:
        srv.stop()
