"""bench/batched_replay.py: a trace replayed with the verifier engine's corpus calls."""

from __future__ import annotations

import pytest

from bench.batched_replay import replay_batched
from bench.traces import Trace
from corpus_service import CorpusConfig


def looping(i: int) -> Trace:
    """A prompt of a 12-token cycle; the output goes on cycling: prompt lookup drafts it all."""
    cycle = [100 + 20 * i + j for j in range(12)]
    return Trace(f"t{i}", "loop", cycle * 3, cycle * 4)


def test_a_copied_output_accepts_whole_trees():
    traces = [looping(i) for i in range(5)]
    for batch in (1, 2, 5):
        r = replay_batched(traces, 4, CorpusConfig(), batch)
        # 48 output tokens each: the prefill's token, then steps of 4 accepted + 1 bonus (the last
        # step may be shorter), so 10 verify steps per request.
        assert r["mat"] == pytest.approx(48 / 10)
        assert r["accepted_per_drafted_node"] > 0.9 and r["batch"] == batch


def test_unpredictable_outputs_take_a_step_per_token():
    traces = [Trace(f"u{i}", "noise", [1, 2, 3], [1000 + 50 * i + j for j in range(20)]) for i in range(3)]
    r = replay_batched(traces, 7, CorpusConfig(), 2)
    assert r["mat"] == pytest.approx(20 / 19)  # the prefill's token, then one token per step


def test_bad_batch_is_refused():
    with pytest.raises(ValueError, match="batch"):
        replay_batched([looping(0)], 4, CorpusConfig(), 0)
