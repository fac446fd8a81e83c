"""Prompt keys and policy versions through every drafter transport: the in-process corpus, and a
corpus service through the child-process client and the thread client. A finished request's output
joins its key's history; an aborted one's does not."""

import time

import pytest

from verifier.draft.drafter import DraftConfig, Drafter


def _run(drafter: Drafter, tag: str) -> None:
    """Two finished samples of one key (version 7) and one aborted sample."""
    prompt = [11, 12, 13, 14]
    for i in range(3):
        drafter.start_request(f"{tag}-{i}", prompt, prompt_key=f"rollout/{tag}", policy_version=7)
    drafter.extend_many([(f"{tag}-{i}", [20 + i, 30 + i, 40 + i]) for i in range(3)])
    assert len(drafter.draft([f"{tag}-0"], 4)) == 1
    drafter.dispatch()
    drafter.finish(f"{tag}-0")
    drafter.finish(f"{tag}-1")
    drafter.finish(f"{tag}-2", rollout=False)
    drafter.dispatch()


def test_local_corpus_keeps_the_keys_history():
    drafter = Drafter("local")
    _run(drafter, "local")
    assert drafter.local.prompt_history("rollout/local") == [(7, 3), (7, 3)]
    drafter.close()


def test_bad_keys_and_versions_raise_value_error():
    drafter = Drafter("local")
    with pytest.raises(ValueError, match="prompt_key"):
        drafter.start_request("x", [1, 2], prompt_key="a\nb")
    with pytest.raises(ValueError, match="policy_version"):
        drafter.start_request("x", [1, 2], policy_version=-2)
    drafter.close()


@pytest.mark.parametrize("client", ["process", "thread"])
def test_a_corpus_service_gets_key_and_version(corpus_server, client):
    from corpus_service.client import CorpusClient

    with CorpusClient(corpus_server.target) as admin:
        before = admin.stats()
        drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client))
        try:
            _run(drafter, client)
            assert drafter.local.prompt_history(f"rollout/{client}") == [(7, 3), (7, 3)]  # the mirror's
            deadline = time.monotonic() + 20
            while True:  # engine-like idle steps: the client sends what it holds at least every FLUSH_AFTER_S
                drafter.dispatch()
                after = admin.stats()
                if after["history_rollouts"] - before["history_rollouts"] >= 2:
                    break
                assert time.monotonic() < deadline, (before, after)
                time.sleep(0.05)
            time.sleep(0.2)  # the aborted one, had it been added, would be in by now
        finally:
            drafter.close()
        after = admin.stats()
        assert after["history_rollouts"] - before["history_rollouts"] == 2  # not the aborted sample
        assert after["history_keys"] - before["history_keys"] == 1
        assert drafter.stats.remote_errors == 0, drafter.stats.last_error
