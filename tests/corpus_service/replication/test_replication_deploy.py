"""The Kubernetes deployment (deploy/k8s), offline: rendered by kubectl's kustomize as `kubectl apply -k`
renders it, every object checked strictly against the Kubernetes schemas of each supported version;
images, registry, tag and storage classes are parameters; every secret the pods read is made by
deploy/k8s/secrets.sh; disruption budgets, anti-affinity, requests and network policies cover every
workload; the NATS configuration forms a real 3-server JetStream cluster; and the corpus ConfigMap
with those secrets makes a replica that serves TLS to the verifiers' token and sets the log's
retention on that cluster."""

from __future__ import annotations

import asyncio
import copy
import os
import ssl

import httpx
import pytest
import yaml

from corpus_service.client import CorpusClient
from corpus_service.protocol.status import CorpusUnauthenticated
from corpus_service.security.tls import ClientTLS
from tests.corpus_service.k8s_manifests import (K8S, K8S_VERSIONS, NatsCluster, by_kind, make_secrets, pod_specs,
                                                render, secret_refs, secret_value)
from tests.corpus_service.replication_fixtures import wait_for
from tests.corpus_service.service_fixtures import REPO, ServerProcess

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (requirements/ci.txt)")
PARAMS = yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def docs():
    return render(K8S)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    return make_secrets(tmp_path_factory.mktemp("secrets"), PARAMS["namespace"])


def test_rendered_manifests_pass_the_kubernetes_schemas_strictly(docs):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "nats"), ("Deployment", "ngram-corpus"), ("Deployment", "ngram-verifier")} <= kinds
    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml")
    assert all(d["metadata"].get("namespace") == PARAMS["namespace"] for d in docs if d["kind"] != "Namespace")
    # The check can fail: an unknown field or a wrong type is refused.
    corpus = by_kind(docs)[("Deployment", "ngram-corpus")]
    bad = copy.deepcopy(corpus)
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = copy.deepcopy(corpus)
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def _images(docs) -> dict[str, tuple[str, str]]:
    out = {}
    for name, template in pod_specs(docs).items():
        for c in template["spec"]["containers"]:
            assert c.get("imagePullPolicy") in ("IfNotPresent", "Always"), (name, c["name"])
            out[c["name"]] = (c["image"], c["imagePullPolicy"])
    return out


def _storage_classes(docs) -> tuple[str, str]:
    k = by_kind(docs)
    return (k[("PersistentVolumeClaim", "ngram-corpus-blobs")]["spec"].get("storageClassName"),
            k[("StatefulSet", "nats")]["spec"]["volumeClaimTemplates"][0]["spec"].get("storageClassName"))


def test_registry_tag_and_storage_classes_are_parameters(docs, tmp_path):
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in PARAMS["images"]}
    got = _images(docs)
    assert got["corpus"][0] == images["ngram-corpus"] and got["verifier"][0] == images["ngram-verifier"]
    assert all(":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest") for image, _ in got.values())
    assert all(_storage_classes(docs))
    # An operator's own overlay over the base sets other values.
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "team-a",
        "resources": [os.path.relpath(K8S / "base", tmp_path)],  # kustomize takes relative paths only
        "images": [{"name": "ngram-corpus", "newName": "reg.test:5000/ai/ngram-corpus", "newTag": "2026.12.02"},
                   {"name": "ngram-verifier", "newName": "reg.test:5000/ai/ngram-verifier", "newTag": "2026.12.02"}],
        "patches": [{"target": {"kind": "PersistentVolumeClaim", "name": "ngram-corpus-blobs"},
                     "patch": "- {op: add, path: /spec/storageClassName, value: cephfs}"},
                    {"target": {"kind": "StatefulSet", "name": "nats"},
                     "patch": "- {op: add, path: /spec/volumeClaimTemplates/0/spec/storageClassName, value: gp3}"}]}))
    mine = render(tmp_path)
    got = _images(mine)
    assert got["corpus"][0] == "reg.test:5000/ai/ngram-corpus:2026.12.02"
    assert got["verifier"][0] == "reg.test:5000/ai/ngram-verifier:2026.12.02"
    assert _storage_classes(mine) == ("cephfs", "gp3")


def test_secrets_script_makes_every_secret_the_pods_read(docs, secrets):
    for secret in secrets.values():
        for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
            kubernetes_validate.validate(secret, version, strict=True)
        assert secret["metadata"]["namespace"] == PARAMS["namespace"]
    refs = secret_refs(docs)
    assert {name for name, _ in refs} == set(secrets), (refs, sorted(secrets))
    missing = sorted((n, k) for n, k in refs if k not in secrets[n].get("data", {}))
    assert not missing, missing
    # Where the operator reads what to create.
    for name in secrets:
        assert name in (K8S / "kustomization.yaml").read_text() and name in (REPO / "docs" / "operations.md").read_text()
    # The gRPC server has tokens and TLS.
    config = by_kind(docs)[("ConfigMap", "ngram-corpus-config")]["data"]
    assert {"NGRAM_CORPUS_CLIENT_TOKENS", "NGRAM_CORPUS_TLS_CERT", "NGRAM_CORPUS_TLS_KEY"} <= set(config)
    assert float(config["NGRAM_CORPUS_GRPC_MAX_CONNECTION_AGE_S"]) > 0  # clients rebalance onto new replicas


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_budgets_anti_affinity_requests_and_network_policies_cover_every_workload(docs):
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for name, template in pod_specs(docs).items():
        labels, spec = template["metadata"]["labels"], template["spec"]
        assert any(_matches(p["spec"]["selector"], labels) for p in pdbs), f"{name}: no PodDisruptionBudget"
        assert spec["affinity"]["podAntiAffinity"], name
        for c in spec["containers"]:
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, c["name"])
        deny = [p for p in policies if _matches(p["spec"]["podSelector"], labels) and not p["spec"].get("ingress")]
        assert deny and "Ingress" in deny[0]["spec"]["policyTypes"], f"{name}: not under a default-deny policy"
    k = by_kind(docs)
    assert k[("StatefulSet", "nats")]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]  # one NATS server per node
    assert k[("Deployment", "ngram-verifier")]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 1

    def sources(policy: str, port: int) -> list[dict]:
        rules = k[("NetworkPolicy", policy)]["spec"]["ingress"]
        return [src for r in rules if any(p["port"] == port for p in r["ports"]) for src in r["from"]]

    # gRPC only from the verifiers and pods labelled as corpus clients; NATS only from the replicas and itself.
    assert all(s.get("podSelector", {}).get("matchLabels") in ({"app.kubernetes.io/name": "ngram-verifier"},
                                                               {"ngram-corpus/client": "true"})
               for s in sources("ngram-corpus", 50051))
    assert [s["podSelector"]["matchLabels"] for s in sources("nats", 4222)] == [
        {"app.kubernetes.io/name": "ngram-corpus"}, {"ngram-corpus/nats-admin": "true"}, {"app.kubernetes.io/name": "nats"}]


@pytest.fixture(scope="module")
def nats_cluster(docs, tmp_path_factory):
    k = by_kind(docs)
    conf = k[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    size = k[("StatefulSet", "nats")]["spec"]["replicas"]
    assert size == 3 and conf.count("nats-headless:6222") == size
    cluster = NatsCluster(conf, tmp_path_factory.mktemp("nats"), size).start()
    yield cluster
    cluster.stop()


def test_nats_configuration_forms_a_three_server_jetstream_cluster(nats_cluster):
    def meta(i: int) -> dict:
        try:
            return nats_cluster.jsz(i).get("meta_cluster") or {}
        except OSError:  # a server still starting up
            return {}

    def agreed() -> bool:  # every server in a group of three with the same leader (peers join one by one)
        metas = [meta(i) for i in range(3)]
        return all(m.get("cluster_size") == 3 for m in metas) and len({m.get("leader") for m in metas} - {None}) == 1 \
            and all(m.get("leader") for m in metas)

    wait_for(agreed, timeout=60, what="a JetStream meta group of 3 with one leader")
    assert all(nats_cluster.healthz(i) for i in range(3))  # what the readiness probe asks


def test_configmap_and_secrets_make_a_replica_that_serves_tls_to_the_verifiers_token(docs, secrets, nats_cluster, tmp_path):
    import nats

    config = dict(by_kind(docs)[("ConfigMap", "ngram-corpus-config")]["data"])
    files = {"tokens.json": secret_value(secrets["ngram-corpus-clients"], "tokens.json")}
    for key in ("tls.crt", "tls.key", "ca.crt"):
        files[key] = secret_value(secrets["ngram-corpus-tls"], key)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    # The pod's paths become this test's files, its addresses loopback; everything else as shipped.
    env = {**config, "NGRAM_CORPUS_NATS_URL": nats_cluster.urls, "NGRAM_CORPUS_BLOB_STORE": str(tmp_path / "blobs"),
           "NGRAM_CORPUS_CLIENT_TOKENS": str(tmp_path / "tokens.json"), "NGRAM_CORPUS_TLS_CERT": str(tmp_path / "tls.crt"),
           "NGRAM_CORPUS_TLS_KEY": str(tmp_path / "tls.key"), "NGRAM_CORPUS_REPLICA_ID": "ngram-corpus-5d9f7-abcde"}
    admin = secret_value(secrets["ngram-corpus-admin"], "token").decode()
    (tmp_path / "data").mkdir()
    srv = ServerProcess(tmp_path / "data", env=env, admin_token=admin).start()
    try:
        https = httpx.Client(verify=ssl.create_default_context(cafile=str(tmp_path / "ca.crt")), timeout=10)
        wait_for(lambda: https.get(f"https://localhost:{srv.admin_port}/readyz").status_code == 200, timeout=60,
                 what="/readyz over HTTPS")
        tls = ClientTLS(ca=str(tmp_path / "ca.crt"), server_name="ngram-corpus")  # the name the verifiers dial
        token = secret_value(secrets["ngram-verifier"], "corpus-token").decode()
        with CorpusClient(srv.target, config["NGRAM_CORPUS_NAMESPACES"].split(":")[0], token=token, tls=tls) as c:
            c.start_request("r", [7, 8, 9, 10, 7, 8])
            assert c.draft(["r"], 4).tree(0)[0][:2] == [9, 10]
        with CorpusClient(srv.target, "smollm2", token="", tls=tls, timeout=5) as c:
            c.start_request("r", [7, 8, 9, 10, 7, 8])
            with pytest.raises(CorpusUnauthenticated):
                c.draft(["r"], 4)

        async def stream_limits():
            nc = await nats.connect(nats_cluster.urls.split(","))
            try:
                return (await nc.jetstream().stream_info(config["NGRAM_CORPUS_LOG_STREAM"])).config
            finally:
                await nc.close()

        limits = asyncio.run(stream_limits())
        assert limits.max_bytes == int(config["NGRAM_CORPUS_LOG_MAX_BYTES"])
        assert limits.max_msgs == int(config["NGRAM_CORPUS_LOG_MAX_MSGS"])
        assert limits.max_age == float(config["NGRAM_CORPUS_LOG_MAX_AGE_S"])

        # The ConfigMap's NGRAM_CORPUS_LOG_REPLICAS puts the log and the snapshot bucket on the
        # cluster's 3 servers; a replica that starts later keeps them, and sets them back if lowered.
        async def replicas(lower_to: int | None = None) -> list[int]:
            nc = await nats.connect(nats_cluster.urls.split(","))
            try:
                js, out = nc.jetstream(), []
                for name in (config["NGRAM_CORPUS_LOG_STREAM"], f"KV_{config['NGRAM_CORPUS_LOG_STREAM']}-snapshots"):
                    cfg = (await js.stream_info(name)).config
                    if lower_to:
                        cfg.num_replicas = lower_to
                        cfg = (await js.update_stream(cfg)).config
                    out.append(cfg.num_replicas)
                return out
            finally:
                await nc.close()

        assert config["NGRAM_CORPUS_LOG_REPLICAS"] == "3"
        wait_for(lambda: asyncio.run(replicas()) == [3, 3], timeout=30, what="the log and the bucket on 3 servers")
        assert asyncio.run(replicas(lower_to=1)) == [1, 1]  # an operator's edit, or a bucket recreated with one
        (tmp_path / "data2").mkdir()
        second = ServerProcess(tmp_path / "data2", env={**env, "NGRAM_CORPUS_REPLICA_ID": "ngram-corpus-5d9f7-fghij"},
                               admin_token=admin).start()
        try:
            wait_for(lambda: https.get(f"https://localhost:{second.admin_port}/readyz").status_code == 200, timeout=60,
                     what="the second replica ready")
            assert asyncio.run(replicas()) == [3, 3] and asyncio.run(stream_limits()).max_age == limits.max_age
        finally:
            second.stop()
    finally:
        srv.stop()
