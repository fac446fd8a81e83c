"""TLS for gRPC and HTTPS for the admin, with a CA and certificates generated in the test: a TLS
client drafts, a plaintext client (or one trusting another CA) fails with a clear error, the admin
answers over HTTPS; with ``--tls-client-ca`` a client needs its own certificate (mutual TLS)."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys

import httpx
import pytest

from corpus_service.admin.client import AdminClient
from corpus_service.client import AsyncCorpusClient, CorpusClient, RemoteNgramCorpus
from corpus_service.protocol.status import CorpusUnavailable
from corpus_service.security.tls import ClientTLS
from tests.corpus_service.certs import make_certs
from tests.corpus_service.service_fixtures import REPO, TOKEN, ServerProcess

PROMPT = [7, 8, 9, 10, 7, 8]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    srv = ServerProcess(tmp_path_factory.mktemp("tls"), "--tls-cert", certs.server_cert, "--tls-key", certs.server_key)
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()


def draft_once(client) -> list[int]:
    with client as c:
        c.start_request("r", PROMPT)
        return c.draft(["r"], 4).tree(0)[0]


def test_tls_client_drafts_and_plaintext_fails_clearly(tls_server, certs):
    assert draft_once(CorpusClient(tls_server.target, tls=certs.ca))[:2] == [9, 10]
    # The name in the certificate is checked: 'localhost' is in its SANs too.
    assert draft_once(CorpusClient(f"localhost:{tls_server.grpc_port}", tls=certs.ca))[:2] == [9, 10]
    with pytest.raises(CorpusUnavailable, match="connect with TLS"):
        draft_once(CorpusClient(tls_server.target, tls=False, timeout=5))
    with pytest.raises(CorpusUnavailable, match="CERTIFICATE_VERIFY_FAILED"):  # a CA that did not sign it
        draft_once(CorpusClient(tls_server.target, tls=certs.other_ca, timeout=5))


def test_async_and_sglang_clients_and_env_over_tls(tls_server, certs, monkeypatch):
    import asyncio

    async def aio() -> list[int]:
        async with AsyncCorpusClient(tls_server.target, tls=certs.ca) as c:
            await c.start_request("r", PROMPT)
            return (await c.draft(["r"], 4)).tree(0)[0]

    assert asyncio.run(aio())[:2] == [9, 10]
    monkeypatch.setenv("NGRAM_CORPUS_TLS_CA", certs.ca)  # the default when tls is not given
    remote = RemoteNgramCorpus(tls_server.target, draft_token_num=4)
    try:
        remote.batch_put([[40, 41, 42, 43]])
        remote.synchronize()
        assert remote.batch_get(["q"], [[40, 41]], [2])[0].tolist()[:3] == [41, 42, 43]
    finally:
        remote.close()


def test_admin_serves_https(tls_server, certs):
    url = f"https://127.0.0.1:{tls_server.admin_port}"
    with AdminClient(url, TOKEN, tls_ca=certs.ca) as admin:
        assert [n["name"] for n in admin.namespaces()] == ["default"]
        admin.snapshot()  # a mutating route, with the admin token, over HTTPS
    with pytest.raises(httpx.ConnectError):  # not trusted without the CA
        httpx.get(f"{url}/healthz", verify=ssl.create_default_context(cafile=certs.other_ca))
    with pytest.raises(httpx.TransportError):  # plaintext HTTP to the HTTPS port
        httpx.get(f"http://127.0.0.1:{tls_server.admin_port}/healthz")
    env = {**os.environ, "NGRAM_CORPUS_ADMIN_URL": url, "NGRAM_CORPUS_ADMIN_TOKEN": TOKEN, "NGRAM_CORPUS_TLS_CA": certs.ca}
    r = subprocess.run([sys.executable, "-m", "corpus_service", "stats"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "default" in json.loads(r.stdout)


def test_mutual_tls_needs_a_client_certificate(tmp_path, certs):
    srv = ServerProcess(tmp_path, "--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
                        "--tls-client-ca", certs.ca)
    srv.start()
    try:
        mtls = ClientTLS(ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
        assert draft_once(CorpusClient(srv.target, tls=mtls))[:2] == [9, 10]
        with pytest.raises(CorpusUnavailable):
            draft_once(CorpusClient(srv.target, tls=certs.ca, timeout=5))  # no client certificate
        ctx = ssl.create_default_context(cafile=certs.ca)
        url = f"https://127.0.0.1:{srv.admin_port}/healthz"
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=ctx)
        ctx.load_cert_chain(certs.client_cert, certs.client_key)
        assert httpx.get(url, verify=ctx).status_code == 200
    finally:
        srv.stop()


def test_a_key_that_does_not_match_the_certificate_is_refused_at_start(certs):
    from corpus_service.server.config import ServiceConfig

    ServiceConfig(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca)
    with pytest.raises(ValueError, match="not a usable certificate"):
        ServiceConfig(tls_cert=certs.server_cert, tls_key=certs.client_key)
