"""A verifier never drafts from the wrong place silently: the namespace follows the model by default,
is checked against a real corpus server at start-up (missing or another model's ids: exit 2 naming
the namespaces served), and a corpus that is down at start-up is checked once it is back; a
mismatch found then turns remote drafting off loudly."""

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.corpus_service.service_fixtures import ServerProcess
from verifier.config import VerifierConfig
from corpus_service.client.health import NamespaceMismatch, check_namespace, model_ids
from verifier.draft.drafter import CorpusEndpoint, DraftConfig, Drafter

REPO = Path(__file__).resolve().parents[3]
SMOLLM2 = "smollm2:vocab=49152,tokenizer=smollm2"


def _other_tokenizer(path: Path) -> str:
    """A tokenizer.json of another model family (word-level): same vocabulary size declared, other ids."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "Hello": 1, "world": 2, "def": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    other = _other_tokenizer(d / "other-tokenizer.json")
    srv = ServerProcess(d, "--namespace", "default", "--namespace", SMOLLM2, "--namespace", "small:vocab=1000",
                        "--namespace", f"other:vocab=49152,tokenizer={other}").start()
    yield srv
    if srv.alive():
        srv.stop()


@pytest.fixture(scope="module")
def ids(smollm2):
    return model_ids(smollm2.codec, smollm2.model.config.vocab_size)


def test_the_namespace_follows_the_model_by_default():
    assert VerifierConfig().corpus_namespace == ""
    assert VerifierConfig(model="smollm2").namespace_for("SmolLM2-135M-Instruct.Q4_1") == "smollm2"
    assert VerifierConfig(model="/m/Llama-3.1-8B").namespace_for("Llama-3.1-8B") == "Llama-3.1-8B"
    assert VerifierConfig(corpus_namespace="docs").namespace_for("x") == "docs"
    with pytest.raises(ValueError, match="set --corpus-namespace"):
        VerifierConfig(model="/m/x").namespace_for("org/model name")
    with pytest.raises(ValueError, match="namespace"):
        VerifierConfig(corpus_namespace="bad name")


def test_check_against_a_real_corpus(server, ids):
    check = functools.partial(check_namespace, server.target, model=ids)
    assert "tokenizer smollm2" in check("smollm2") and "vocabulary 49152" in check("smollm2")
    assert "not checked" in check("default")  # it declares neither: nothing to compare
    with pytest.raises(NamespaceMismatch) as e:
        check("nope")
    msg = str(e.value)
    assert "no namespace 'nope'" in msg and "smollm2 (matches this model)" in msg and "small" in msg, msg
    with pytest.raises(NamespaceMismatch, match="1000 ids, the model's 49152"):
        check("small")
    with pytest.raises(NamespaceMismatch, match="tokenizer .*other-tokenizer.json.* other ids"):
        check("other")


def _serve(target: str, tmp_path: Path, *flags: str) -> subprocess.Popen:
    ports = tmp_path / "ports.json"
    return subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", "smollm2", "--corpus", target,
                             "--device", "cpu", "--port", "0", "--ports-file", str(ports), "--budget", "4",
                             "--max-batch", "2", "--max-len", "512", *flags],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("namespace,needle", [("nope", "no namespace 'nope'"), ("small", "1000 ids")])
def test_serve_refuses_a_namespace_that_does_not_serve_its_model(server, tmp_path, namespace, needle):
    p = _serve(server.target, tmp_path, "--corpus-namespace", namespace)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("ngram-verifier: error: corpus_namespace:") and needle in line, err[-3000:]
    assert "smollm2 (matches this model)" in line and "default" in line


def test_the_readme_command_drafts_from_the_models_namespace(server, tmp_path):
    """The README's serve command, no namespace flag: it drafts from (and feeds) 'smollm2'."""
    p = _serve(server.target, tmp_path)
    try:
        ports = tmp_path / "ports.json"
        deadline = time.monotonic() + 300
        while not ports.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        url = f"http://127.0.0.1:{json.loads(ports.read_text())['http_port']}"
        with httpx.Client(base_url=url, timeout=120) as http:
            prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            corpus = http.get("/healthz").json()["corpus"]
            assert corpus["namespace"] == "smollm2" and corpus["namespace_check"] == "ok", corpus
            assert corpus["remote_drafting"] and corpus["state"] == "reachable" and corpus["outages"] == 0, corpus
            metrics = http.get("/metrics").text
        remote = [ln for ln in metrics.splitlines() if ln.startswith('ngram_verifier_draft_steps_total{source="remote"}')]
        assert remote and float(remote[0].split()[-1]) > 0, metrics
        assert "ngram_verifier_corpus_errors_total 0.0" in metrics
    finally:
        p.terminate()
        p.communicate(timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(drafter: Drafter, rid: str, until, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, drafter.health.snapshot()
        drafter.extend(rid, [7])
        assert len(drafter.draft([rid], 4)) == 1  # drafting goes on, in process if need be
        drafter.dispatch()
        time.sleep(0.02)


@pytest.mark.parametrize("client", ["process", "thread"])
def test_down_at_start_then_checked_then_a_mismatch_turns_remote_off(tmp_path, ids, caplog, client):
    port = _free_port()
    target = f"127.0.0.1:{port}"
    check = functools.partial(check_namespace, target, "smollm2", ids, timeout_s=30.0)
    draft = DraftConfig(corpus_timeout_s=2.0, remote_client=client)
    drafter = Drafter(CorpusEndpoint(target, namespace="smollm2"), draft, vocab_size=49152, check=check)
    first = second = None
    try:
        h = drafter.health
        assert not drafter.remote and h.snapshot()["state"] == "unreachable" and h.outages == 1
        assert h.namespace_state == "unchecked" and not h.remote_drafting
        drafter.start_request("r", [5, 6, 7, 5, 6])
        _steps(drafter, "r", lambda: drafter.stats.fallback_steps >= 3)  # in process, nothing sent
        first = ServerProcess(tmp_path / "a", "--namespace", SMOLLM2)
        (tmp_path / "a").mkdir()
        first.start(grpc_port=port)
        _steps(drafter, "r", lambda: drafter.stats.remote_steps >= 2)  # checked, requests replayed, remote on
        assert h.namespace_state == "ok" and h.remote_drafting and not h.unreachable and h.recoveries == 1
        assert drafter.stats.remote_errors == 0  # the replay gave the corpus the request before any draft
        first.kill()
        # The corpus comes back serving another model's ids under the same name: found after the outage.
        second = ServerProcess(tmp_path / "b", "--namespace", "smollm2:vocab=1000")
        (tmp_path / "b").mkdir()
        _steps(drafter, "r", lambda: h.unreachable)
        second.start(grpc_port=port)
        _steps(drafter, "r", lambda: h.namespace_state == "mismatch")
        assert not drafter.remote and not h.remote_drafting and "1000 ids" in h.namespace_note
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "Remote drafting is OFF" in r.getMessage()]
        assert len(errors) == 1
        steps = drafter.stats.fallback_steps
        _steps(drafter, "r", lambda: drafter.stats.fallback_steps >= steps + 5)  # in process from now on
        drafter.finish("r")
    finally:
        drafter.close()
        for srv in (first, second):
            if srv is not None and srv.alive():
                srv.kill()
