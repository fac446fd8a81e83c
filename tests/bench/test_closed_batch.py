"""CPU smoke of bench/closed_batch.py: the engine's graph path with the trace as the model and the
device's time modeled (asynchronously, from a forward-time table); every arm's outputs equal plain
decoding's, the phases add up, and the modeled device time is really waited for."""

import json

import pytest

from bench import closed_batch
from bench.common import parse_summary


def test_closed_batch_smoke(tmp_path, capsys, trace_file):
    out = tmp_path / "cb.json"
    # 4 ms per step whatever its size: plain decoding's steps cannot take less.
    assert closed_batch.main(["--batch", "3", "--prompts", "4", "--max-new", "12", "--rounds", "1",
                              "--forward-ms", json.dumps({1: 4.0, 4096: 4.0}), "--phase-live", "1",
                              "--trace", str(trace_file("specbench_dev120_greedy.jsonl")), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["arms"]) == set(closed_batch.ARMS)
    plain = res["arms"]["plain"]["rounds"][0]
    steps = sum(ph["steps"] for ph in plain["phases"].values())
    assert 0 < plain["tokens"] <= 4 * 12  # (a trace may end before 12 tokens)
    assert plain["seconds"] >= 0.004 * (steps - 1)  # every step but the prefill's waited its 4 ms
    assert plain["phases"]["bulk"]["steps"] > 0 and plain["phases"]["tail"]["steps"] > 0
    for arm in ("spec", "spec_critical"):
        r = res["arms"][arm]["rounds"][0]
        assert r["tokens"] == plain["tokens"] and r["mat"] >= 1.0
        # How the policy decided the steps (BudgetPolicy.decision_counts): counts per "<bucket>_<how>".
        assert r["decisions"] and all(k.split("_", 1)[0].isdigit() and n > 0 for k, n in r["decisions"].items())
    assert plain["decisions"] == {}
    summary = parse_summary(capsys.readouterr().out)
    assert summary["spec_x"] > 0 and len(summary["spec_rounds_x"]) == 1
    for bad in (["--arms", "spec"], ["--batch", "0"], ["--forward-ms", "[1, 2]"]):
        with pytest.raises(SystemExit):
            closed_batch.main([*bad, "--out", str(out)])
