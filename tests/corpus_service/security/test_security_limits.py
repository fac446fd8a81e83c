"""Rate limits (token buckets per caller) on mutating admin calls and BatchPut, against a real
server and with a fake clock; validation of the security settings; the off-loopback warnings."""

from __future__ import annotations

import json

import grpc
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import RemoteNgramCorpus
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusResourceExhausted
from corpus_service.security.auth import Role, parse_client_tokens
from corpus_service.security.config import security_warnings
from corpus_service.security.rate_limit import RateLimited, RateLimiter, peer_host
from corpus_service.security.tls import _all_loopback, auth_metadata, resolve_token
from corpus_service.server.config import ServiceConfig
from tests.corpus_service.certs import make_certs
from tests.corpus_service.service_fixtures import TOKEN, ServerProcess

A, B = "tok-limits-a-0123456789abcdef", "tok-limits-b-0123456789abcdef"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_burst_refill_and_retry_after():
    clock = FakeClock()
    lim = RateLimiter("puts", rate_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        lim.acquire("x")
    with pytest.raises(RateLimited) as e:
        lim.acquire("x")
    assert e.value.retry_after_s == pytest.approx(0.5) and e.value.retry_after_header() == "1"
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after 0.50 s" in str(e.value)
    lim.acquire("y")  # callers have their own buckets
    clock.t += 0.5
    lim.acquire("x")  # refilled one call
    with pytest.raises(RateLimited):
        lim.acquire("x")
    clock.t += 100
    for _ in range(3):  # refills up to the burst, not beyond
        lim.acquire("x")
    with pytest.raises(RateLimited):
        lim.acquire("x")
    off = RateLimiter("off", rate_per_s=0, burst=1, clock=clock)
    for _ in range(1000):
        off.acquire("x")
    small = RateLimiter("lru", rate_per_s=1.0, burst=1, clock=clock, max_keys=2)
    for k in ("k1", "k2", "k3"):
        small.acquire(k)
    assert len(small._buckets) == 2
    with pytest.raises(ValueError):
        RateLimiter("bad", rate_per_s=-1, burst=1)
    assert peer_host("ipv4:10.1.2.3:5555") == "ipv4:10.1.2.3" and peer_host("ipv6:[::1]:80") == "ipv6:[::1]"


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    d = tmp_path_factory.mktemp("limited")
    clients = [{"name": "a", "token": A, "namespaces": ["*"], "role": "admin"},
               {"name": "b", "token": B, "namespaces": ["*"], "role": "admin"}]
    (d / "tokens.json").write_text(json.dumps({"clients": clients}))
    # A refill rate this small makes the test deterministic: nothing refills while it runs.
    srv = ServerProcess(d, "--client-tokens", str(d / "tokens.json"), "--admin-rate-per-s", "0.001",
                        "--admin-rate-burst", "2", "--put-rate-per-s", "0.001", "--put-rate-burst", "3")
    srv.start()
    yield srv
    if srv.alive():
        srv.stop()


def test_batch_put_is_limited_per_token_with_retry_after(limited):
    req = pb.BatchPutRequest(namespace="default", lengths=arrays.pack([3]), tokens=arrays.pack([1, 2, 3]))
    with grpc.insecure_channel(limited.target) as ch:
        stub = pb_grpc.CorpusStub(ch)
        for _ in range(3):
            stub.BatchPut(req, metadata=(("authorization", f"Bearer {A}"),), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            stub.BatchPut(req, metadata=(("authorization", f"Bearer {A}"),), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rate limit of BatchPut calls exceeded; retry after" in e.value.details()
        retry_after = dict(e.value.trailing_metadata())["retry-after"]
        assert float(retry_after) > 1.0
        stub.BatchPut(req, metadata=(("authorization", f"Bearer {B}"),), timeout=10)  # another token's bucket
    # The SGLang drop-in surfaces a refused put at synchronize(), as its other put errors.
    remote = RemoteNgramCorpus(limited.target, draft_token_num=4, token=B)
    try:
        for _ in range(3):
            remote.batch_put([[1, 2, 3]])
        with pytest.raises(CorpusResourceExhausted, match="rate limit"):
            remote.synchronize()
    finally:
        remote.close()


def test_mutating_admin_calls_are_limited_over_rest_and_grpc(limited):
    with limited.http(A) as h:
        for _ in range(2):
            assert h.delete("/v1/namespaces/default/corpora/none").status_code == 404  # counted all the same
        r = h.delete("/v1/namespaces/default/corpora/none")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert int(r.headers["Retry-After"]) >= 1
        for _ in range(5):  # reads are not limited
            assert h.get("/v1/namespaces/default/corpora").status_code == 200
    with grpc.insecure_channel(limited.target) as ch:  # the same caller's bucket covers gRPC admin calls
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CorpusStub(ch).Reset(pb.ResetRequest(namespace="default"),
                                         metadata=(("authorization", f"Bearer {A}"),), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with limited.http(TOKEN) as h:  # the admin token is its own caller
        assert h.post("/v1/snapshot").status_code == 200
    with limited.http(B) as h:  # with client tokens /metrics needs read on every namespace
        assert 'ngram_corpus_rate_limited_total{limit="mutating admin calls",surface="rest"}' in h.get("/metrics").text


def _tokens(tmp_path, clients) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"clients": clients}))
    return str(path)


def test_settings_are_validated_without_echoing_tokens(tmp_path):
    secret = "tok-validate-0123456789abcdef"
    good = {"name": "x", "token": secret, "namespaces": ["default"], "role": "draft"}
    (entry,) = parse_client_tokens({"clients": [good]}, ["default"])
    assert entry.principal.may(Role.DRAFT, "default") and not entry.principal.may(Role.ADMIN, "default")
    bad_sets = [
        ([{**good, "namespaces": ["other"]}], "unknown"),
        ([{**good, "role": "root"}], "role"),
        ([good, {**good, "name": "y"}], "same token"),
        ([good, {**good, "token": secret + "x"}], "duplicate name"),
        ([{**good, "token": "short"}], "at least 16"),
        ([{**good, "token_sha256": "ab"}], "exactly one"),
        ([{**good, "namespaces": []}], "namespaces"),
        ([{**good, "extra": 1}], "unknown keys"),
    ]
    for clients, match in bad_sets:
        with pytest.raises(ValueError, match=match) as e:
            ServiceConfig(admin_port=-1, client_tokens=_tokens(tmp_path, clients))
        assert secret not in str(e.value)
    (tmp_path / "broken.json").write_text('{"clients": [{"token": "' + secret)
    with pytest.raises(ValueError, match="not JSON") as e:
        ServiceConfig(admin_port=-1, client_tokens=str(tmp_path / "broken.json"))
    assert secret not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        ServiceConfig(client_tokens=str(tmp_path / "missing.json"))
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="both"):
        ServiceConfig(tls_cert=str(pem))
    with pytest.raises(ValueError, match="mutual TLS"):
        ServiceConfig(tls_client_ca=str(pem))
    with pytest.raises(ValueError, match="not a PEM"):
        ServiceConfig(tls_cert=str(tmp_path / "tokens.json"), tls_key=str(pem))
    with pytest.raises(ValueError, match="admin_rate_per_s"):
        ServiceConfig(admin_rate_per_s=-1.0)
    with pytest.raises(ValueError, match="put_rate_burst"):
        ServiceConfig(put_rate_burst=0)
    assert "admin_token" not in repr(ServiceConfig(admin_token=secret)) and secret not in repr(ServiceConfig(admin_token=secret))


def test_beyond_loopback_without_client_tokens_or_tls_is_a_loud_warning(tmp_path):
    assert security_warnings(ServiceConfig()) == []
    warn = security_warnings(ServiceConfig(host="0.0.0.0", admin_token=TOKEN))
    assert len(warn) == 2 and "no --client-tokens" in warn[0] and "plaintext" in warn[1]
    # With an admin token, anyone may draft and feed, not reset or load: the admin calls of REST and
    # gRPC need the token (test_admin_authority.py, test_service_prompt_history.py show they do).
    open_part, guarded = warn[0].split("; ")
    assert "draft from and feed" in open_part and "reset" not in open_part and "load" not in open_part
    assert all(w in guarded for w in ("REST writes", "gRPC Reset", "external corpora", "policy versions",
                                      "need the admin token")), guarded
    # Without a REST admin no token is required: then the gRPC admin calls are open, and it says so.
    open_grpc = security_warnings(ServiceConfig(host="0.0.0.0", admin_port=-1))
    assert "no --admin-token" in open_grpc[0] and "reset and load corpora" in open_grpc[0], open_grpc
    certs = make_certs(tmp_path / "certs")
    tokens = _tokens(tmp_path, [{"name": "x", "token": "tok-warn-0123456789abcdef", "namespaces": ["*"]}])
    assert security_warnings(ServiceConfig(host="0.0.0.0", admin_token=TOKEN, client_tokens=tokens,
                                           tls_cert=certs.server_cert, tls_key=certs.server_key)) == []
    with pytest.raises(ValueError, match="admin_token: required"):  # still a refusal, as before
        ServiceConfig(host="0.0.0.0")


def test_client_token_handling(monkeypatch):
    monkeypatch.setenv("NGRAM_CORPUS_TOKEN", "tok-from-env-0123456789")
    assert resolve_token(None) == "tok-from-env-0123456789" and resolve_token("") is None
    assert auth_metadata("abc") == (("authorization", "Bearer abc"),) and auth_metadata(None) == ()
    for bad in (" padded ", "two\nlines", "   "):
        with pytest.raises(ValueError) as e:
            auth_metadata(bad)
        assert bad not in str(e.value)
    # Where a client warns that its token travels in plaintext: every address must be loopback.
    assert _all_loopback("127.0.0.1:1") and _all_loopback("ipv4:127.0.0.1:1,127.0.0.1:2") and _all_loopback("ipv6:[::1]:5")
    assert not _all_loopback("10.0.0.1:5") and not _all_loopback("dns:///corpus:50051")
    assert not _all_loopback("ipv4:127.0.0.1:1,10.0.0.2:2")
