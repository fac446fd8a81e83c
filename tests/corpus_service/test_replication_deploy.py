"""The replicated deployment: Kubernetes manifests checked against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict, offline) plus what the design needs of them; the compose profile."""

from __future__ import annotations

import copy

import pytest
import yaml

from corpus_service.cli import _config_from, build_parser
from tests.corpus_service.service_fixtures import REPO

K8S = REPO / "deploy" / "k8s"
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (requirements/ci.txt)")


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_manifests_pass_the_kubernetes_schemas_strictly():
    docs = _docs()
    assert len(docs) >= 10
    for doc in docs.values():
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    # The check can fail: an unknown field or a wrong type is refused.
    bad = copy.deepcopy(docs[("Deployment", "ngram-corpus")])
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)
    bad = copy.deepcopy(docs[("Deployment", "ngram-corpus")])
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


def test_manifests_wire_the_replicated_design(monkeypatch):
    docs = _docs()
    nats = docs[("StatefulSet", "nats")]
    assert nats["spec"]["volumeClaimTemplates"] and "jetstream" in docs[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    corpus = docs[("Deployment", "ngram-corpus")]["spec"]["template"]["spec"]
    c = corpus["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"  # follows the replica's lag
    assert {e["name"] for e in c["env"]} >= {"NGRAM_CORPUS_ADMIN_TOKEN", "NGRAM_CORPUS_REPLICA_ID"}
    assert docs[("Service", "ngram-corpus")]["spec"]["clusterIP"] == "None"  # headless: client-side balancing
    assert docs[("PersistentVolumeClaim", "ngram-corpus-blobs")]["spec"]["accessModes"] == ["ReadWriteMany"]
    verifier = docs[("Deployment", "ngram-verifier")]["spec"]["template"]["spec"]["containers"][0]
    assert verifier["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert docs[("ConfigMap", "ngram-verifier-config")]["data"]["NGRAM_VERIFIER_CORPUS"] == "dns:///ngram-corpus:50051"
    # The ConfigMap plus the secret make a valid corpus configuration (as the container reads it).
    for key, value in docs[("ConfigMap", "ngram-corpus-config")]["data"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("NGRAM_CORPUS_ADMIN_TOKEN", "0123456789abcdef0123")
    monkeypatch.setenv("NGRAM_CORPUS_REPLICA_ID", "ngram-corpus-5d9f7-abcde")
    cfg = _config_from(build_parser().parse_args(["serve"]))
    assert cfg.replicated and cfg.log == "nats://nats:4222" and cfg.blob_store == "/blobs" and cfg.ready_lag == 64


def test_compose_profile_runs_nats_and_two_replicas():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["nats"]["profiles"] == ["replicated"] and "-js" in services["nats"]["command"]
    rep = services["corpus-replica"]
    assert rep["profiles"] == ["replicated"] and rep["environment"]["NGRAM_CORPUS_LOG"] == "nats://nats:4222"
    assert "2" in str(rep["deploy"]["replicas"]) and "corpus-blobs:/blobs" in rep["volumes"]
    assert "corpus" in services and "profiles" not in services["corpus"]  # single node stays the default
