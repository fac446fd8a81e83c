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


def test_every_serve_flag_explains_itself_and_its_values():
    import dataclasses

    from corpus_service.cli import flag_help
    from corpus_service.server.config import ServiceConfig

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    helps = {a.dest: a.help for a in serve._actions if a.dest != "help"}
    for f in dataclasses.fields(ServiceConfig):
        if not f.init:
            continue
        text = flag_help(f)
        assert text and text != f.name.replace("_", " "), f"--{f.name.replace('_', '-')} has no help"
        assert text in helps[f.name] and "env NGRAM_CORPUS_" in helps[f.name]
        if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):  # says which values it takes
            assert any(w in text for w in ("int", "number", "in [", "in (", "seconds", ">=")), (f.name, text)
    r = cli("serve", "--help", timeout=30)
    assert r.returncode == 0 and "--client-tokens" in r.stdout


def _upload_bytes(server) -> float:
    with server.http() as http:
        line = next(ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("ngram_corpus_upload_bytes_total"))
    return float(line.split()[-1])


def test_upload_checks_token_namespace_and_name_before_it_streams(server, tmp_path):
    path = tmp_path / "big.ids"
    path.write_text("1 2 3 4 5 6 7 8\n" * 100_000)  # 1.6 MB: beyond the fixture's limit
    env = {"NGRAM_CORPUS_ADMIN_URL": server.admin_url, "NGRAM_CORPUS_ADMIN_TOKEN": TOKEN}
    with server.http() as http:
        r = http.put("/v1/namespaces/default/corpora/cli-taken", params={"format": "ids"}, content=b"1 2 3\n")
        assert r.status_code == 202
    before = _upload_bytes(server)
    small = tmp_path / "small.ids"
    small.write_text("1 2 3 4 5 6 7 8\n" * 50_000)  # 0.8 MB, within the fixture's 1 MB limit
    for args, status in ((["--token", "wrong-token-wrong-token"], "HTTP 403"), (["--namespace", "nope"], "HTTP 404"),
                         ([], "HTTP 413"), (["--name", "cli-taken"], "HTTP 409")):
        name = [] if "--name" in args else ["--name", "cli-big"]
        r = cli("upload", str(path if status == "HTTP 413" else small), *name, *args, env=env)
        assert r.returncode == 1 and status in r.stderr, (args, r.stderr)
        assert "upload cli-" not in r.stderr, r.stderr  # refused before the upload's progress bar began
    assert "replace" in r.stderr  # a taken name says how to replace it
    assert _upload_bytes(server) == before  # nothing was stored
    r = cli("upload", str(small), "--name", "cli-taken", "--replace", "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["tokens"] == 400_000
    assert cli("rm", "cli-taken", env=env).returncode == 0


def test_ls_without_namespace_lists_every_namespace_and_stats_are_integers(server, tmp_path):
    env = {"NGRAM_CORPUS_ADMIN_URL": server.admin_url, "NGRAM_CORPUS_ADMIN_TOKEN": TOKEN}
    env = {**{k: v for k, v in os.environ.items() if k != "NGRAM_CORPUS_NAMESPACE"}, **env}
    path = tmp_path / "s.ids"
    path.write_text("1 2 3 4\n")
    assert cli("upload", str(path), "--name", "in-small", "--namespace", "small", "--quiet", env=env).returncode == 0
    r = cli("ls", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAMESPACE", "NAME"]
    rows = [ln.split() for ln in lines[1:]]
    assert {row[0] for row in rows} == {"default", "small", "smollm2"}  # namespaces without corpora too
    assert ["small", "in-small", "ready", "4", "upload"] in rows
    r = cli("ls", "--namespace", "small", env=env)
    assert r.returncode == 0 and r.stdout.startswith("NAME") and "in-small" in r.stdout
    r = cli("stats", env=env)
    stats = json.loads(r.stdout)
    assert type(stats["small"]["external_tokens"]) is int and stats["small"]["external_tokens"] >= 4
    r = cli("stats", "--namespace", "small", env=env)
    assert set(json.loads(r.stdout)) == {"small"}
    assert cli("rm", "in-small", "--namespace", "small", env=env).returncode == 0


def test_rm_without_namespace_finds_the_one_namespace_or_names_them(server, tmp_path):
    env = {"NGRAM_CORPUS_ADMIN_URL": server.admin_url, "NGRAM_CORPUS_ADMIN_TOKEN": TOKEN}
    env = {**{k: v for k, v in os.environ.items() if k != "NGRAM_CORPUS_NAMESPACE"}, **env}
    path = tmp_path / "twice.ids"
    path.write_text("1 2 3 4\n")
    for ns in ("default", "small"):
        assert cli("upload", str(path), "--name", "twice", "--namespace", ns, "--quiet", env=env).returncode == 0
    r = cli("rm", "twice", env=env)  # held by two namespaces: refused, naming them
    assert r.returncode == 1 and "corpus 'twice' is in namespaces default, small: say which with --namespace" \
        in r.stderr, r.stderr
    assert "twice" in cli("ls", "--namespace", "small", env=env).stdout  # nothing was removed
    r = cli("rm", "twice", "--namespace", "small", env=env)
    assert r.returncode == 0 and r.stdout.strip() == "removed small/twice", r.stderr
    r = cli("rm", "twice", env=env)  # now one namespace holds it
    assert r.returncode == 0 and r.stdout.strip() == "removed default/twice", r.stderr
    r = cli("rm", "twice", env=env)
    assert r.returncode == 1 and "no corpus 'twice' in any namespace (default, small, smollm2)" in r.stderr, r.stderr
    r = cli("rm", "../x", env=env)
    assert r.returncode == 2 and "corpus name" in r.stderr, r.stderr
