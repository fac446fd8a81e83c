"""Pipelined remote drafts (verifier.draft.drafter): a step never waits for the corpus service, and what
only the shared corpus knows (here: another replica's output) still reaches the drafts, one step
late, re-rooted along the tokens committed meanwhile. Real gRPC server on 127.0.0.1."""

import time

import pytest

from corpus_service.client import CorpusClient
from verifier.draft.drafter import DraftConfig, Drafter

TEXT = list(range(200, 240))


@pytest.mark.parametrize("client", ["process", "thread"])
def test_shared_knowledge_arrives_one_step_late_and_re_rooted(corpus_server, client):
    with CorpusClient(corpus_server.target) as other:  # another replica generated TEXT
        other.reset()
        other.start_request("other-1", [1, 2, 3])
        other.extend("other-1", TEXT)
        other.finish("other-1")
        other.synchronize()
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client))
    try:
        drafter.start_request("mine", [7, 8] + TEXT[:6])
        first = drafter.draft(["mine"], 4)  # nothing asked yet: this verifier's mirror alone
        assert int(first.counts[0]) == 0 and drafter.stats.local_steps == 1
        drafter.dispatch()  # the engine does this once the GPU is busy with the step
        drafter._ahead[0].result(timeout=10)  # the next step's remote tree, asked for 2 x 4 nodes
        drafter.extend("mine", [TEXT[6]])  # the step committed one token
        second = drafter.draft(["mine"], 4)
        assert second.tree(0)[0] == TEXT[7:11]  # the remote chain, re-rooted past TEXT[6]
        assert drafter.stats.remote_steps == 1 and drafter.stats.fallback_steps == 0
        drafter.finish("mine")
    finally:
        drafter.close()


@pytest.mark.parametrize("client", ["process", "thread"])
def test_requests_the_remote_tree_was_not_asked_for_get_the_fresh_tree(corpus_server, client):
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client))
    try:
        drafter.start_request("r", [5, 6, 7, 5, 6])
        drafter.draft(["r"], 4)
        drafter.dispatch()
        pending = drafter._ahead[0]
        pending.result(timeout=10)
        # A request the remote tree was not asked for (the batch changed) gets the fresh tree only.
        drafter.start_request("s", [9, 9, 9])
        out = drafter.draft(["s", "r"], 4)
        assert len(out) == 2 and drafter.stats.remote_steps == 1
        for r in ("r", "s"):
            drafter.finish(r)
    finally:
        drafter.close()


def test_remote_drafts_mode_is_validated():
    with pytest.raises(ValueError, match="remote_drafts"):
        Drafter("local", DraftConfig(remote_drafts="eager"))
    with pytest.raises(ValueError, match="remote_client"):
        Drafter("local", DraftConfig(remote_client="fork"))


def test_a_thread_client_lowers_the_gil_switch_interval_and_never_raises_it(corpus_server):
    import sys

    from verifier.draft.drafter import GIL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # Python's default
        Drafter().close()
        assert sys.getswitchinterval() == 0.005  # in-process drafting has no client thread
        Drafter(corpus_server.target).close()
        assert sys.getswitchinterval() == 0.005  # nor has the default client, in a child process
        d = Drafter(corpus_server.target, DraftConfig(remote_client="thread"))
        d.close()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
        sys.setswitchinterval(1e-4)  # a process that chose a shorter one keeps it
        Drafter(corpus_server.target, DraftConfig(remote_client="thread")).close()
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("client", ["process", "thread"])
def test_await_ahead_takes_the_answer_in_while_the_gpu_would_run(corpus_server, client):
    """The engine calls await_ahead while the GPU runs a step: it reports an outstanding answer
    until the answer is in, and the next draft then merges it without waiting or polling."""
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client))
    try:
        assert drafter.pipelined_remote
        assert drafter.await_ahead() is False  # nothing asked yet
        drafter.start_request("r", [5, 6, 7, 5, 6])
        drafter.draft(["r"], 4)
        drafter.dispatch()
        calls = 0
        while drafter.await_ahead(timeout_s=0.01):
            calls += 1
            assert calls < 1000, "the remote answer never came"
        assert drafter._ahead[0].done()
        assert drafter.await_ahead() is False  # answered: nothing to wait for
        drafter.extend("r", [7])
        drafter.draft(["r"], 4)
        assert drafter.stats.remote_steps == 1 and drafter.stats.fallback_steps == 0
        drafter.finish("r")
    finally:
        drafter.close()


def test_the_process_clients_await_never_sleeps(corpus_server, monkeypatch):
    """With the client in a child process, await_ahead is one non-blocking read: the engine polls
    the GPU between calls as tightly as a local step's event wait (a select() with a timeout
    sleeps for the kernel's timer slack, ~50 us, past the GPU's finish)."""
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client="process"))
    try:
        drafter.start_request("r", [5, 6, 7, 5, 6])
        drafter.draft(["r"], 4)
        drafter.dispatch()
        handle = drafter._ahead[0]
        monkeypatch.setattr(type(handle), "wait", lambda self, timeout: pytest.fail("await_ahead waited"))
        deadline = time.monotonic() + 30
        while drafter.await_ahead():
            assert time.monotonic() < deadline, "the remote answer never came"
        assert handle.done() and handle.batch is not None
    finally:
        drafter.close()


def test_a_local_drafter_has_nothing_to_await():
    drafter = Drafter()
    try:
        assert not drafter.pipelined_remote and drafter.await_ahead() is False
    finally:
        drafter.close()
