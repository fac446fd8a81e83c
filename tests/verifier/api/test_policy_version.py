"""POST /v1/policy-version's announcer (verifier/api/policy_version.py) against a real corpus service
and an unreachable one: the service's version moves forward, then the verifier's mirror; an older
version is 409, a corpus that cannot be reached 502, no corpus 409."""

import pytest

from verifier.api.body import ApiError
from verifier.api.policy_version import PolicyAnnouncer
from verifier.draft.drafter import DraftConfig, Drafter


def test_announces_to_the_service_then_the_mirror(corpus_server):
    from corpus_service.client import CorpusClient

    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client="thread"))
    try:
        announcer = PolicyAnnouncer(drafter, namespace="default")
        with CorpusClient(corpus_server.target) as c:
            start = int(c.stats()["policy_version"])
            out = announcer.announce(start + 3)
            assert out == {"version": start + 3, "corpus": corpus_server.target, "namespace": "default"}
            assert int(c.stats()["policy_version"]) == start + 3
        assert drafter.local.policy_version() == start + 3
        with pytest.raises(ApiError) as e:
            announcer.announce(start + 1)
        assert e.value.status == 409 and "older" in e.value.message
    finally:
        drafter.close()


def test_unreachable_corpus_and_no_corpus():
    drafter = Drafter("127.0.0.1:9", DraftConfig(corpus_timeout_s=0.5, remote_client="thread"))
    try:
        with pytest.raises(ApiError) as e:
            PolicyAnnouncer(drafter, timeout_s=0.5).announce(1)
        assert e.value.status == 502 and "announcement failed" in e.value.message
    finally:
        drafter.close()
    with pytest.raises(ApiError) as e:
        PolicyAnnouncer(None).announce(1)
    assert e.value.status == 409
