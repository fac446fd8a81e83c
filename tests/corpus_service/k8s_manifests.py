"""deploy/k8s rendered as `kubectl apply -k` renders it (kubectl's kustomize), the secrets that
deploy/k8s/secrets.sh makes, and the Kubernetes manifests' NATS configuration run as a real 3-server
JetStream cluster on 127.0.0.1, for the deploy tests."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.corpus_service.replication_fixtures import NATS_SERVER, free_port
from tests.corpus_service.service_fixtures import REPO

K8S = REPO / "deploy" / "k8s"
# The Kubernetes versions the manifests support: each is validated strictly.
K8S_VERSIONS = ("1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")


def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed: the manifests cannot be rendered")
    return exe


def render(directory: Path) -> list[dict]:
    r = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def secret_refs(docs: list[dict]) -> set[tuple[str, str]]:
    """(secret, key) pairs the workloads read: env secretKeyRef and secret volumes' items."""
    refs = set()
    for template in pod_specs(docs).values():
        spec = template["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
            assert not any("secretRef" in f for f in c.get("envFrom", [])), "name the keys (items) of secrets read"
        for v in spec.get("volumes", []):
            if "secret" in v:
                items = v["secret"].get("items")
                assert items, f"volume {v['name']}: name the secret's keys (items)"
                refs |= {(v["secret"]["secretName"], i["key"]) for i in items}
    return refs


def make_secrets(out: Path, namespace: str) -> dict[str, dict]:
    r = subprocess.run(["bash", str(K8S / "secrets.sh"), "--namespace", namespace, "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))]
    return {d["metadata"]["name"]: d for d in docs}


def secret_value(secret: dict, key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


class NatsCluster:
    """The manifests' nats.conf, run three times on 127.0.0.1: each server's ports, store and pid
    file moved to its own, the routes pointed at the other two (instead of nats-N.nats-headless)."""

    def __init__(self, conf: str, root: Path, size: int) -> None:
        self.size, self.root = size, Path(root)
        self.client = [free_port() for _ in range(size)]
        self.cluster = [free_port() for _ in range(size)]
        self.http = [free_port() for _ in range(size)]
        self.conf, self.procs = conf, []

    def _conf(self, i: int) -> str:
        c = self.conf
        for j in range(self.size):
            c = c.replace(f"nats://nats-{j}.nats-headless:6222", f"nats://127.0.0.1:{self.cluster[j]}")
        assert "nats-headless" not in c, "a route the test did not map"
        c = re.sub(r"^(\s*)port: 4222$", rf"\g<1>port: {self.client[i]}", c, flags=re.M)
        c = re.sub(r"^(\s*)port: 6222$", rf"\g<1>host: 127.0.0.1\n\g<1>port: {self.cluster[i]}", c, flags=re.M)
        c = re.sub(r"^(\s*)http_port: 8222$", rf'\g<1>http: "127.0.0.1:{self.http[i]}"', c, flags=re.M)
        c = c.replace("/data/jetstream", str(self.root / f"n{i}" / "jetstream"))
        c = c.replace("/var/run/nats/nats.pid", str(self.root / f"n{i}" / "nats.pid"))
        return f"host: 127.0.0.1\n{c}"

    @property
    def urls(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client)

    def healthz(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http[i]}/healthz?js-enabled-only=true", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def jsz(self, i: int) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http[i]}/jsz", timeout=5) as r:
            return json.loads(r.read())

    def start(self, timeout: float = 60.0) -> "NatsCluster":
        if NATS_SERVER is None:
            pytest.skip("nats-server is not installed (apt-get install nats-server)")
        for i in range(self.size):
            d = self.root / f"n{i}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "nats.conf").write_text(self._conf(i))
            log = open(d / "nats.log", "wb")
            self.procs.append(subprocess.Popen([NATS_SERVER, "-c", str(d / "nats.conf")], stdout=log,
                                               stderr=subprocess.STDOUT, env={"SERVER_NAME": f"nats-{i}"}))
        deadline = time.monotonic() + timeout
        while not all(self.healthz(i) for i in range(self.size)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                logs = "\n".join((self.root / f"n{i}" / "nats.log").read_text()[-1500:] for i in range(self.size))
                raise RuntimeError(f"the NATS cluster did not form:\n{logs}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
