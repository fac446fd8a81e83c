"""The images compose and Kubernetes run: what each Dockerfile installs (torch as tested), the user
they run as and the volumes it owns, the data dir they agree on, and healthchecks that probe real
servers. Images are not built here (no Docker engine in CI)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.corpus_service import compose_tools as ct
from tests.corpus_service.compose_tools import env_file, v2  # noqa: F401 (fixtures)
from tests.corpus_service.dockerfiles import final_stage, instructions
from tests.corpus_service.service_fixtures import REPO, ServerProcess


def test_kubernetes_and_the_image_set_the_same_explicit_data_dir_on_a_volume():
    """Compose, the Kubernetes manifests and the corpus image agree: the data dir is set, never the
    server's per-user default, and a volume is mounted there."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "base" / "corpus.yaml").read_text()))
    config = next(d for d in docs if d and d["kind"] == "ConfigMap")
    data_dir = config["data"]["NGRAM_CORPUS_DATA_DIR"]
    pod = next(d for d in docs if d and d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (corpus,) = [c for c in pod["containers"] if c["name"] == "corpus"]
    mounted = {m["mountPath"]: m["name"] for m in corpus["volumeMounts"]}
    assert data_dir == "/data" and data_dir in mounted
    assert any(v["name"] == mounted[data_dir] for v in pod["volumes"])
    env = " ".join(a for op, a in final_stage(REPO / "deploy" / "corpus.Dockerfile") if op == "ENV")
    assert f"NGRAM_CORPUS_DATA_DIR={data_dir}" in env


def test_images_run_as_10001_and_own_the_volume_mount_points(v2, env_file):
    corpus = final_stage(REPO / "deploy" / "corpus.Dockerfile")
    runs = " ".join(arg for op, arg in corpus if op == "RUN")
    owned = set()
    for m in re.finditer(r"mkdir -p ((?:/\S+ ?)+)&& chown 10001:10001 ((?:/\S+ ?)+)", runs):
        owned |= set(m.group(1).split()) & set(m.group(2).split())
    users = [arg for op, arg in corpus if op == "USER"]
    assert users == ["10001:10001"], users
    mounts = set()
    for profile in ("cpu", "replicated"):
        for name, svc in ct.config(*v2, env_file, profile=profile)["services"].items():
            if svc.get("image", "").startswith("ngram-corpus"):
                mounts |= {v["target"] for v in svc.get("volumes", []) if v["type"] == "volume" and not v.get("read_only")}
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


def test_cpu_verifier_image_has_cis_torch_and_drops_root():
    path = REPO / "deploy" / "verifier-cpu.Dockerfile"
    froms = [arg for op, arg in instructions(path) if op == "FROM"]
    assert all(f.startswith("python:3.11-slim") for f in froms) and len(froms) == 2, froms  # no CUDA image
    final = final_stage(path)
    args = dict(a.split("=", 1) for op, a in final if op == "ARG" and "=" in a)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    (install,) = [a for op, a in final if op == "RUN" and "torch==${TORCH_VERSION}" in a]
    pin = re.search(r"^torch==(\S+)$", (REPO / "requirements" / "ci.txt").read_text(), re.M).group(1)
    # The version is read from CI's pin, and the build refuses another torch.
    version = subprocess.run(["sed", "-n", "s/^torch==//p", str(REPO / "requirements" / "ci.txt")],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert "sed -n 's/^torch==//p' /tmp/ci.txt" in install and version == pin
    assert "'${TORCH_VERSION}+cpu'" in install
    env = " ".join(a for op, a in final if op == "ENV")
    assert "NGRAM_VERIFIER_DEVICE=cpu" in env and "NGRAM_VERIFIER_DTYPE=float32" in env
    users = [a for op, a in final if op == "USER"]
    assert users == ["10001:10001"] and ('ENTRYPOINT', '["ngram-verifier", "serve"]') in final


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
    verifiers = ct.verifiers(ct.config(*v2, env_file, profile=["cpu", "gpu"]))
    tests = [v["healthcheck"]["test"] for v in verifiers.values()]
    for dockerfile in ("verifier.Dockerfile", "verifier-cpu.Dockerfile"):
        tests.append(["CMD", *json.loads(next(a for op, a in final_stage(REPO / "deploy" / dockerfile)
                                              if op == "HEALTHCHECK").split(" CMD ", 1)[1])])
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
        for test in tests:
            assert _healthcheck(test, {"NGRAM_VERIFIER_PORT": port}) == 0
    finally:
        proc.terminate()
        proc.wait(60)
    for test in tests:
        assert _healthcheck(test, {"NGRAM_VERIFIER_PORT": port}) != 0
