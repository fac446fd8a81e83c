"""bench/acceptance.py --ranking: the rankings replayed side by side in one run."""

import json

import pytest

from bench.acceptance import main
from bench.traces import REPO

TRACE = str(REPO / "bench" / "data" / "traces" / "humaneval164_t07x4.jsonl")


def test_ranking_section_replays_each_ranking(tmp_path, capsys):
    out = tmp_path / "r.json"
    res = main(["--ranking", "today,model", "--trace", TRACE, "--limit", "24", "--budget", "7", "--out", str(out)])
    run = res["runs"][0]
    assert run["budget"] == 7 and run["requests"] == 24
    for name in ("today", "model"):
        r = run[name]
        assert 1.0 <= r["mat"] <= 8.0 and 0.0 <= r["accepted_per_drafted_node"] <= 1.0
        assert r["drafted_nodes_per_step"] <= 7 and r["us_per_draft_engine"] > 0
    # Two engines that rank differently, not one replayed twice.
    key = ("mat", "accepted_per_drafted_node", "drafted_nodes_per_step")
    assert [run["today"][k] for k in key] != [run["model"][k] for k in key]
    assert json.loads(out.read_text())["rankings"] == ["today", "model"]
    assert "SUMMARY acceptance ranking model vs today" in capsys.readouterr().out


def test_unknown_ranking_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--ranking"):
        main(["--ranking", "today,best", "--trace", TRACE, "--out", str(tmp_path / "r.json")])
