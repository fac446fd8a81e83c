"""A corpus server process refuses absurd policy-version jumps (--max-policy-version-step) on gRPC
and REST, keeps the version it had (across a restart too), and its REST route reads the body as
JSON whatever the Content-Type, refuses unknown fields and does not read ``true`` as 1."""

from __future__ import annotations

import grpc
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client import CorpusClient
from corpus_service.protocol.status import CorpusInvalidArgument
from corpus_service.server.config import ServiceConfig
from tests.corpus_service.service_fixtures import TOKEN, ServerProcess

STEP = 100


def test_the_default_step_is_documented_and_checked():
    assert ServiceConfig(data_dir="").max_policy_version_step == 1 << 20
    for bad in (0, -1, 1 << 62, True):
        with pytest.raises(ValueError, match="max_policy_version_step"):
            ServiceConfig(data_dir="", max_policy_version_step=bad)


def test_jumps_past_the_step_are_refused_everywhere_and_the_version_persists(tmp_path):
    srv = ServerProcess(tmp_path, "--max-policy-version-step", str(STEP))
    srv.start()
    try:
        with CorpusClient(srv.target, "default", token=TOKEN) as c:
            assert c.announce_policy_version(STEP) == STEP  # 0 -> 100: exactly the step
            with pytest.raises(CorpusInvalidArgument, match="max-policy-version-step"):
                c.announce_policy_version((1 << 62) - 1)
            with pytest.raises(CorpusInvalidArgument, match="101 ahead"):
                c.announce_policy_version(2 * STEP + 1)
            assert c.announce_policy_version(2 * STEP) == 2 * STEP
        with grpc.insecure_channel(srv.target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.CorpusStub(ch).AnnouncePolicyVersion(
                    pb.AnnouncePolicyVersionRequest(namespace="default", version=1 << 40),
                    metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with srv.http() as http:
            url = "/v1/namespaces/default/policy-version"
            r = http.post(url, json={"version": 10 * STEP})
            assert r.status_code == 400 and "max-policy-version-step" in r.json()["error"]["message"], r.text
            # curl -d '{"version": 201}' sends application/x-www-form-urlencoded: still JSON here.
            r = http.post(url, content=b'{"version": 201}',
                          headers={"content-type": "application/x-www-form-urlencoded"})
            assert r.status_code == 200 and r.json()["policy_version"] == 201, r.text
            for body, words in ((b"version=5", "JSON"), (b'{"version": 202, "force": true}', "force: unknown field"),
                                (b'{"version": true}', "version"), (b"[202]", "JSON object"),
                                (b'{"version": 202.0}', "version")):
                r = http.post(url, content=body, headers={"content-type": "text/plain"})
                assert r.status_code == 422, (body, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_request" and words in err["message"], (body, err)
                assert "valid dictionary" not in err["message"]
        with CorpusClient(srv.target, "default") as c:
            assert c.stats()["policy_version"] == 201
        srv.stop()
        srv.start()  # the version is a namespace's state: it survives the restart as before
        with CorpusClient(srv.target, "default") as c:
            assert c.stats()["policy_version"] == 201
    finally:
        if srv.alive():
            srv.stop()
