"""bench/vllm_pattern.py's fleet (--replicas): requests dealt round-robin, in order; R isolated
SuffixDecodingCaches against one shared corpus namespace; the namespace settings checked up front."""

import json

import numpy as np
import pytest

from bench import vllm_pattern
from bench.traces import Trace
from tests.integrations.vllm.engine import require_vllm


def _traces(n: int, seed: int = 0) -> list[Trace]:
    """n requests with distinct prompts and one shared output of distinct tokens: only a cache or
    corpus that saw an earlier request can draft it (its own tokens never repeat)."""
    rng = np.random.default_rng(seed)
    out = [int(t) for t in rng.permutation(np.arange(1000, 1200))[:120]]
    return [Trace(f"p{i}", "test", [int(t) for t in rng.integers(1, 900, size=12)], out) for i in range(n)]


def test_replay_deals_requests_round_robin_in_order():
    calls, finished = [], []

    def propose(replica, rid, ctx, num_prompt, num_tokens, sampled):
        calls.append((replica, rid))
        return []

    res = vllm_pattern.replay(_traces(5), 4, propose, lambda replica, rid: finished.append((replica, rid)), replicas=3)
    assert finished == [(0, "req-0"), (1, "req-1"), (2, "req-2"), (0, "req-3"), (1, "req-4")]
    assert [c for c in dict.fromkeys(calls)] == finished  # every step of a request on its replica, in order
    assert res["mat"] == 1.0 and res["steps"] == 5 * 119


def test_suffix_caches_are_isolated_per_replica():
    require_vllm()
    traces = _traces(4)
    one, two = vllm_pattern.replay_suffix(traces, 8, 1), vllm_pattern.replay_suffix(traces, 8, 2)
    four = vllm_pattern.replay_suffix(traces, 8, 4)
    assert four["mat"] == 1.0  # no replica saw the output before
    assert one["mat"] > two["mat"] > 1.0  # one cache: requests 1-3 draft it; two: only requests 2 and 3


def test_corpus_is_shared_by_the_replicas(tmp_path):
    traces = _traces(4)
    one = vllm_pattern.replay_corpus(traces, 8, tmp_path / "one", 2, replicas=1)
    four = vllm_pattern.replay_corpus(traces, 8, tmp_path / "four", 2, replicas=4)
    assert four["mat"] == pytest.approx(one["mat"]) and four["mat"] > 2.0  # requests 1-3 draft what 0 taught
    assert len(four["stats"]) == 4 and all(s["corpus_steps"] > 0 and s["fallback_steps"] == 0 for s in four["stats"])


def test_main_writes_each_replica_count_and_checks_settings(tmp_path, capsys):
    require_vllm()
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": t.id, "prompt_ids": t.prompt_ids, "output_ids": t.output_ids}) + "\n"
                            for t in _traces(4)))
    out = tmp_path / "r.json"
    res = vllm_pattern.main(["--trace", str(path), "--k", "4", "--replicas", "1", "--replicas", "4", "--out", str(out)])
    assert [(r["replicas"], r["k"]) for r in res["runs"]] == [(1, 4), (4, 4)]
    assert res["namespace"] == "default:" + vllm_pattern.VLLM_NAMESPACE_SETTINGS
    assert res["runs"][1]["suffix"]["mat"] == 1.0 < res["runs"][0]["suffix"]["mat"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        vllm_pattern.main(["--trace", str(path), "--namespace-settings", "no_such_setting=1", "--out", str(out)])
    assert "no_such_setting" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vllm_pattern.main(["--trace", str(path), "--replicas", "0", "--out", str(out)])
