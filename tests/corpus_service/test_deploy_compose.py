"""docker-compose.yml is valid compose (checked by docker-compose / docker compose where installed;
images are not built here: that needs registry access)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.corpus_service.service_fixtures import REPO


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if r.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_file_is_valid():
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed (apt-get install docker-compose)")
    env = {**os.environ, "NGRAM_CORPUS_ADMIN_TOKEN": "0123456789abcdef0123"}
    r = subprocess.run([*cmd, "-f", str(REPO / "docker-compose.yml"), "config"], cwd=REPO, capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "corpus" in r.stdout and "verifier" in r.stdout and "capabilities" in r.stdout
    # The admin token is required: without it compose refuses (so does the server off loopback).
    env.pop("NGRAM_CORPUS_ADMIN_TOKEN")
    r = subprocess.run([*cmd, "-f", str(REPO / "docker-compose.yml"), "config"], cwd=REPO, capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode != 0 and "NGRAM_CORPUS_ADMIN_TOKEN" in r.stderr


def test_dockerfiles_exist_and_run_the_planned_commands():
    corpus = (REPO / "deploy" / "corpus.Dockerfile").read_text()
    verifier = (REPO / "deploy" / "verifier.Dockerfile").read_text()
    assert 'ENTRYPOINT ["ngram-corpus", "serve"]' in corpus and "HEALTHCHECK" in corpus
    assert 'ENTRYPOINT ["ngram-verifier", "serve"]' in verifier
