"""``ngram-corpus`` commands: serve's config checks, upload (progress bar) / ls / rm / stats
against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from corpus_service.cli import _config_from, build_parser
from tests.corpus_service.service_fixtures import REPO, TOKEN


def cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "corpus_service", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_serve_refuses_to_bind_beyond_loopback_without_a_token():
    r = cli("serve", "--host", "0.0.0.0", "--grpc-port", "0", "--admin-port", "0", timeout=30)
    assert r.returncode == 2
    assert "admin_token: required when binding beyond loopback" in r.stderr


def test_flags_mirror_config_fields_and_read_environment(monkeypatch):
    monkeypatch.setenv("NGRAM_CORPUS_GRPC_PORT", "4321")
    monkeypatch.setenv("NGRAM_CORPUS_MAX_BATCH", "77")
    monkeypatch.setenv("NGRAM_CORPUS_NAMESPACES", "a:vocab=10;b:mode=prob")
    cfg = _config_from(build_parser().parse_args(["serve", "--max-batch", "99"]))
    assert cfg.grpc_port == 4321 and cfg.max_batch == 99  # a flag beats its environment variable
    assert [s.name for s in cfg.parsed_namespaces] == ["a", "b"] and cfg.parsed_namespaces[0].corpus.vocab_size == 10
    cfg = _config_from(build_parser().parse_args(["serve", "--namespace", "c"]))
    assert [s.name for s in cfg.parsed_namespaces] == ["c"]
    with pytest.raises(ValueError, match="max_batch"):
        _config_from(build_parser().parse_args(["serve", "--max-batch", "0"]))


def test_upload_ls_rm_stats(server, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"ids": list(range(i, i + 30))}) for i in range(0, 300, 30)) + "\n")
    env = {"NGRAM_CORPUS_ADMIN_URL": server.admin_url, "NGRAM_CORPUS_ADMIN_TOKEN": TOKEN}
    r = cli("upload", str(path), "--name", "cli-docs", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["state"] == "done"
    assert "upload cli-docs" in r.stderr and "100%" in r.stderr  # tqdm's bars
    r = cli("ls", env=env)
    assert r.returncode == 0 and "cli-docs" in r.stdout and "300" in r.stdout
    r = cli("stats", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["default"]["external_tokens"] >= 300
    r = cli("rm", "cli-docs", "--token", "wrong-token-wrong-token", env=env)
    assert r.returncode == 1 and "HTTP 403" in r.stderr
    assert cli("rm", "cli-docs", env=env).returncode == 0
    r = cli("rm", "cli-docs", env=env)
    assert r.returncode == 1 and "no corpus" in r.stderr
    r = cli("ls", "--admin-url", "http://127.0.0.1:9", env=env)
    assert r.returncode == 1 and "cannot reach" in r.stderr
