"""Hostile input against a real server process: names with control characters or a trailing newline
are refused by one rule matched in full (REST, gRPC, the CLI, namespace specs, the token file), and
deeply nested JSON lines in an upload answer 400, not 500."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.names import check_corpus_name, is_valid_name
from corpus_service.protocol import arrays
from corpus_service.security.auth import parse_client_tokens
from corpus_service.server.config import ServiceConfig
from tests.corpus_service.service_fixtures import REPO, TOKEN

HOSTILE = ["evil\n", "nl\n", "a\rb", "tab\t", "nul\x00", "bell\x07", "del\x7f", " lead", "trail ", "é", "a/b",
           ".hidden", "-dash", "x" * 65]
ADMIN = (("authorization", f"Bearer {TOKEN}"),)


def test_one_name_rule_matched_in_full():
    for name in HOSTILE:
        assert not is_valid_name(name), repr(name)
        with pytest.raises(ValueError, match="corpus name: expected"):
            check_corpus_name(name)
    for name in ("a", "docs-v2.1", "A_b", "x" * 64):
        assert is_valid_name(name)
    with pytest.raises(ValueError, match="namespace: expected"):
        ServiceConfig(namespaces=("smollm2\n:vocab=49152",))  # a spec is trimmed; its name is not
    with pytest.raises(ValueError, match="name: expected"):
        parse_client_tokens({"clients": [{"name": "ops\n", "token": "t" * 20, "namespaces": ["*"], "role": "read"}]})


def test_rest_refuses_hostile_corpus_names(server):
    with server.http() as http:
        for raw in ("evil%0A", "evil%0D", "a%09b", "a%07", "%C3%A9"):
            r = http.put(f"/v1/namespaces/default/corpora/{raw}", params={"format": "ids"}, content=b"1 2 3\n")
            assert r.status_code == 400, (raw, r.text)
            assert "corpus name" in r.json()["error"]["message"]
            assert http.delete(f"/v1/namespaces/default/corpora/{raw}").status_code == 400
    files = [p.name for p in (server.data_dir / "uploads").rglob("*")]
    assert not [f for f in files if any(ord(ch) < 32 for ch in f)], files


def test_grpc_refuses_hostile_corpus_names(server):
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        for name in ("nl\n", "evil\n", "a\rb"):
            calls = [
                lambda: stub.LoadExternalCorpus(iter([pb.ExternalChunk(namespace="default", name=name,
                                                                       tokens=arrays.pack([1, 2, 3]))]),
                                                metadata=ADMIN, timeout=10),
                lambda: stub.CommitExternalCorpus(pb.CommitExternalCorpusRequest(namespace="default", name=name,
                                                                                 expected_tokens=-1),
                                                  metadata=ADMIN, timeout=10),
                lambda: stub.RemoveExternalCorpus(pb.RemoveExternalCorpusRequest(namespace="default", name=name),
                                                  metadata=ADMIN, timeout=10),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert "corpus name" in e.value.details()
        corpora = stub.ListExternalCorpora(pb.ListExternalCorporaRequest(namespace="default"), timeout=10).corpora
    assert not [n for n in corpora if not is_valid_name(n)], list(corpora)


def test_the_cli_refuses_a_hostile_name_before_sending_anything(tmp_path):
    path = tmp_path / "docs.ids"
    path.write_text("1 2 3\n")
    env = {**os.environ, "NGRAM_CORPUS_ADMIN_URL": "http://127.0.0.1:9"}  # nothing listens: nothing may be sent
    r = subprocess.run([sys.executable, "-m", "corpus_service", "upload", str(path), "--name", "evil\n"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "corpus name: expected" in r.stderr and "cannot reach" not in r.stderr


def test_deeply_nested_json_lines_answer_400(server):
    with server.http() as http:
        for line in (b"[" * 100_000, b'{"ids": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}",
                     b'{"text": ' + b'{"a": ' * 30_000 + b"1" + b"}" * 30_000 + b"}"):
            r = http.put("/v1/namespaces/default/corpora/deep", params={"format": "jsonl"}, content=line + b"\n")
            assert r.status_code == 400, r.text[:300]
            assert "line 1" in r.json()["error"]["message"]
        assert http.get("/healthz").status_code == 200
