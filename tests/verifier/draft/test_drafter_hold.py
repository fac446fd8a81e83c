"""Held hand-offs (``Drafter.dispatch(hold=True)``): while the engine steps, commits that no draft
request needs wait in the engine's process for up to ``HOLD_CALLS_S`` instead of waking the client
every step. Nothing is lost by it: a draft request carries every held call before it, in order; the
hold ends on time; closing the drafter sends what it holds. Real gRPC server on 127.0.0.1; the
learned corpus, probed by another replica, shows what reached the server."""

import time

import pytest

from corpus_service.client import CorpusClient
from verifier.draft.corpus_process import FLUSH_AFTER_S
from verifier.draft import drafter as drafter_mod
from verifier.draft.drafter import DraftConfig, Drafter


def learned(target: str, text: list[int], name: str) -> bool:
    """Whether the shared corpus drafts text[5] after text[:5] (another replica's probe)."""
    with CorpusClient(target) as other:
        other.start_request(name, text[:5])
        tree = other.draft([name], 4).tree(0)
        other.finish(name)
    return tree[0][:1] == [text[5]]


def wait_learned(target: str, text: list[int], name: str) -> None:
    deadline = time.monotonic() + 10
    k = 0
    while not learned(target, text, f"{name}{k}"):
        k += 1
        assert time.monotonic() < deadline, f"{name}: the held commits never reached the corpus"
        time.sleep(0.05)


@pytest.mark.parametrize("client", ["process", "thread"])
def test_held_commits_go_with_the_next_ask_after_the_hold_and_at_close(corpus_server, client, monkeypatch):
    base = 5000 + 100 * (client == "thread")
    text_a, text_b, text_c = (list(range(base + 30 * i, base + 30 * i + 12)) for i in range(3))
    monkeypatch.setattr(drafter_mod, "HOLD_CALLS_S", 60.0)  # held until an ask or close
    with CorpusClient(corpus_server.target) as c:
        c.reset()
    draft = DraftConfig(corpus_timeout_s=5.0, remote_client=client, remote_asks="always")
    drafter = Drafter(corpus_server.target, draft)
    try:
        drafter.start_request("a", text_a[:3])
        drafter.dispatch()  # handed over now (no hold): the start
        drafter.extend_many([("a", text_a[3:])])
        drafter.finish("a")
        drafter.dispatch(hold=True)  # nothing needs them yet: held
        time.sleep(3 * FLUSH_AFTER_S)  # a client that had them would have sent them by now
        assert not learned(corpus_server.target, text_a, "probe-a-early")
        # The next ask carries them (in order, before the draft request).
        drafter.start_request("b", [1, 2, 3])
        drafter.draft(["b"], 4)
        drafter.dispatch(hold=True)
        assert drafter.stats.asks == 1
        wait_learned(corpus_server.target, text_a, "probe-a")
        drafter._ahead[0].result(timeout=10)
        drafter.finish("b")
        # The hold ends on time.
        monkeypatch.setattr(drafter_mod, "HOLD_CALLS_S", 0.05)
        drafter.start_request("c", text_c[:3])
        drafter.extend_many([("c", text_c[3:])])
        drafter.finish("c")
        drafter.dispatch(hold=True)  # no draft this step: held
        time.sleep(0.1)
        drafter.dispatch(hold=True)
        wait_learned(corpus_server.target, text_c, "probe-c")
        # Closing sends what is held.
        monkeypatch.setattr(drafter_mod, "HOLD_CALLS_S", 60.0)
        drafter.dispatch()
        drafter.start_request("d", text_b[:3])
        drafter.extend_many([("d", text_b[3:])])
        drafter.finish("d")
        drafter.dispatch(hold=True)
    finally:
        drafter.close()
    wait_learned(corpus_server.target, text_b, "probe-d")
    assert drafter.stats.remote_errors == 0
