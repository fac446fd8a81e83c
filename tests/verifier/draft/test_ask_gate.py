"""The adaptive remote ask (verifier.draft.ask_gate): asks stop paying for remote trees that add no
accepted token, and never stop where the shared corpus knows what this verifier does not.
Real gRPC server on 127.0.0.1 for the drafter tests."""

import pytest

from corpus_service.client import CorpusClient
from verifier.draft.ask_gate import AskGate, AskGateConfig
from verifier.draft.drafter import DraftConfig, Drafter


def test_intervals_double_without_gain_up_to_the_maximum():
    gate = AskGate(AskGateConfig(min_gain=0.05, window_tokens=10, max_interval=4))
    assert [gate.ask() for _ in range(3)] == [True] * 3
    gate.observe(10, 0)  # a window without gain
    assert gate.interval == 2 and [gate.ask() for _ in range(4)] == [False, True, False, True]
    for _ in range(3):
        gate.observe(10, 0)
    assert gate.interval == 4
    assert [gate.ask() for _ in range(8)] == [False, False, False, True] * 2


def test_a_step_with_gain_asks_every_step_again_and_windows_decide_on_their_share():
    gate = AskGate(AskGateConfig(min_gain=0.05, window_tokens=100, max_interval=8))
    gate.interval = 8
    gate.observe(3, 1)  # one step: a third of its tokens came from the remote tree alone
    assert gate.interval == 1
    gate.interval = 2
    gate.observe(50, 1)  # 2%: below the share a step needs on its own...
    assert gate.interval == 2
    gate.observe(50, 1)  # ...and below it over the window
    assert gate.interval == 4
    for _ in range(6):
        gate.observe(50, 1)
    assert gate.interval == 8
    gate = AskGate(AskGateConfig(min_gain=0.01, window_tokens=100, max_interval=8))
    gate.interval = 8
    gate.observe(50, 0)
    gate.observe(60, 2)  # 2 / 110 over the window
    assert gate.interval == 1
    gate.observe(0, 0)  # nothing delivered: nothing learned
    assert gate.interval == 1


def test_config_is_validated():
    for bad in ({"min_gain": -0.1}, {"min_gain": 2}, {"window_tokens": 0}, {"max_interval": 0}):
        with pytest.raises(ValueError):
            AskGateConfig(**bad)
    with pytest.raises(ValueError, match="remote_asks"):
        Drafter("local", DraftConfig(remote_asks="sometimes"))


def accept(tree, truth):
    """The verifier's greedy acceptance: the longest tree path that matches ``truth``, then the
    bonus token."""
    tokens, parents, _ = tree
    at, n = -1, 0
    while n < len(truth) - 1:
        nxt = next((i for i in range(len(tokens)) if parents[i] == at and tokens[i] == truth[n]), None)
        if nxt is None:
            break
        at, n = nxt, n + 1
    return truth[:n + 1]


def run_batch(drafter, requests, budget=4):
    """Drafts and commits each request's output after its prompt (``requests``: id -> (prompt,
    output)), all in one batch, as a pipelined verifier would, waiting for each remote answer (what
    a GPU step's time lets in). Returns the steps each request took."""
    done = {}
    for rid, (prompt, _) in requests.items():
        drafter.start_request(rid, prompt)
        done[rid] = 0
    steps = dict.fromkeys(requests, 0)
    while done:
        ids = list(done)
        batch = drafter.draft(ids, budget)
        drafter.dispatch()
        if drafter._ahead is not None:
            handle = drafter._ahead[0]
            handle.result(timeout=10) if hasattr(handle, "result") else handle.wait(10)
        commits = []
        for i, rid in enumerate(ids):
            out = requests[rid][1]
            commits.append((rid, accept(batch.tree(i), out[done[rid]:])))
            done[rid] += len(commits[-1][1])
            steps[rid] += 1
        drafter.extend_many(commits)
        for rid in ids:
            if done[rid] >= len(requests[rid][1]):
                del done[rid]
                drafter.finish(rid)
    drafter.dispatch()
    return steps


def run(drafter, rid, prompt, output, budget=4):
    return run_batch(drafter, {rid: (prompt, output)}, budget)[rid]


TEXT = list(range(300, 360))


@pytest.mark.parametrize("client", ["process", "thread"])
def test_asks_that_add_nothing_are_skipped_and_asks_that_add_tokens_are_kept(corpus_server, client):
    gate = dict(remote_ask_min_gain=0.02, remote_ask_window_tokens=16, remote_ask_max_interval=8)
    with CorpusClient(corpus_server.target) as c:
        c.reset()
    # Alone on a fresh corpus: the request repeats its own prompt, which the mirror knows as well
    # as the corpus does. Remote trees add nothing, so the drafter asks less and less.
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_client=client, **gate))
    try:
        pattern = [11, 12, 13, 14, 15, 16]
        run(drafter, "alone", pattern * 3, pattern * 20)
        s = drafter.stats
        assert s.remote_gain_tokens == 0 and s.asks_skipped > s.asks > 0, s
        # Another replica's output, which only the shared corpus holds: the first step of a new
        # request asks about it whatever the interval, its trees add accepted tokens, and asks
        # go back to every step.
        with CorpusClient(corpus_server.target) as other:
            other.start_request("other-1", [1, 2, 3])
            other.extend("other-1", TEXT)
            other.finish("other-1")
            other.synchronize()
        asks, skipped = s.asks, s.asks_skipped
        run(drafter, "fleet", [7, 8] + TEXT[:4], TEXT[4:])
        assert s.remote_gain_tokens > 10, s
        assert s.asks_skipped - skipped <= 1 and s.asks > asks, s
    finally:
        drafter.close()


def test_always_asks_every_step(corpus_server):
    with CorpusClient(corpus_server.target) as c:
        c.reset()
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, remote_asks="always",
                                                        remote_ask_window_tokens=4, remote_ask_max_interval=8))
    try:
        pattern = [21, 22, 23, 24]
        run(drafter, "r", pattern * 3, pattern * 10)
        assert drafter.stats.asks_skipped == 0 and drafter.stats.asks >= 5
    finally:
        drafter.close()


def test_a_request_the_fleet_knows_is_asked_about_every_step_in_a_batch_that_gains_little(corpus_server):
    """At large batch a few requests the shared corpus knows would not lift the batch's share: the
    drafter asks about those requests every step (hot) while the gate keeps the others' asks rare."""
    gate = dict(remote_ask_min_gain=0.5, remote_ask_window_tokens=16, remote_ask_max_interval=8)  # never reached
    with CorpusClient(corpus_server.target) as c:
        c.reset()
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0, **gate))
    try:
        pattern = [41, 42, 43, 44, 45, 46]
        run(drafter, "warm", pattern * 3, pattern * 20)
        assert drafter._gate.interval > 1
        with CorpusClient(corpus_server.target) as other:
            other.start_request("other-1", [1, 2, 3])
            other.extend("other-1", TEXT)
            other.finish("other-1")
            other.synchronize()
        many = {f"plain-{i}": ([50 + i, 60 + i] * 4, [50 + i, 60 + i] * 12) for i in range(5)}
        many["fleet"] = ([7, 8] + TEXT[:4], TEXT[4:])
        steps = run_batch(drafter, many)
        # The fleet request accepted the other replica's output, several tokens a step...
        assert steps["fleet"] <= len(TEXT[4:]) // 3, steps
        assert drafter.stats.remote_gain_tokens > 20, drafter.stats
        # ...while the batch as a whole kept skipping its asks.
        assert drafter._gate.interval > 1 and drafter.stats.asks_skipped > 0
    finally:
        drafter.close()


def test_finished_requests_leave_no_ask_state(corpus_server):
    with CorpusClient(corpus_server.target) as c:
        c.reset()
        c.start_request("other-1", [1, 2, 3])
        c.extend("other-1", TEXT)
        c.finish("other-1")
        c.synchronize()
    drafter = Drafter(corpus_server.target, DraftConfig(corpus_timeout_s=5.0))
    try:
        run(drafter, "fleet", [7, 8] + TEXT[:4], TEXT[4:])
        assert drafter.stats.remote_gain_tokens > 10
        drafter.dispatch()  # scores whatever the last step left
        assert drafter._hot == {} and drafter._unasked == set()
    finally:
        drafter.close()
