"""bench/engine_costs.py --arm: several configs timed against the default in the same rounds (the
plumbing and the report; its figures are the benchmark's, not a test's)."""

import json

import pytest

from bench import engine_costs
from bench.common import parse_overrides, parse_summary


def test_arms_are_compared_with_the_default_round_by_round(tmp_path, capsys, trace_file):
    out = tmp_path / "costs.json"
    res = engine_costs.main(["--arm", "rank_model=true,rank_depth=1", "--arm", "rank_model=true", "--rounds", "5",
                             "--trace", str(trace_file("specbench_dev120_greedy.jsonl")), "--out", str(out)])
    assert json.loads(out.read_text())["arms"] == res["arms"]
    assert res["arms"].keys() == {"rank_model=true,rank_depth=1", "rank_model=true"}
    for r in res["arms"].values():
        assert r["draft_over_default"] > 0 and r["extend_over_default"] > 0
    summary = parse_summary(capsys.readouterr().out)
    assert summary["rank_model=true: draft_over_default"] == res["arms"]["rank_model=true"]["draft_over_default"]


def test_a_bad_arm_is_refused(trace_file):
    with pytest.raises(ValueError, match="rank_depth"):
        engine_costs.main(["--arm", "rank_model=true,rank_depth=99", "--trace",
                           str(trace_file("specbench_dev120_greedy.jsonl"))])


def test_overrides_parse_as_json_where_they_look_like_it():
    assert parse_overrides(["rank_model=true", "rank_depth=3", "rank_lambda=1.5", "mode=prob", "orders=[1,2]"]) == {
        "rank_model": True, "rank_depth": 3, "rank_lambda": 1.5, "mode": "prob", "orders": (1, 2)}
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        parse_overrides(["rank_model"])
