"""CPU smoke of bench/draft_stalls.py: drafts timed while the learned corpus takes in finished
requests, against the same drafts with nothing being learned."""

import json

import pytest

from bench import draft_stalls


def test_draft_stalls_bench_smoke(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert draft_stalls.main(["--seconds", "0.5", "--bursts", "3", "--burst-gap-ms", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["learning"]["n"] > 0 and res["idle"]["n"] > 0
    assert 0 < res["learning"]["p50_us"] <= res["learning"]["p99_us"] <= res["learning"]["max_us"]
    assert res["learning"]["learned_tokens_at_end"] > 0 and res["p99_learning_vs_idle"] > 0
    # the apply run's bursts grow the learned corpus; the largest is reported first
    sizes = [r["learned_tokens"] for r in res["apply_largest"]]
    assert len(sizes) == 3 and all(n > 0 for n in sizes)
    assert res["apply_largest"][0]["ms"] >= res["apply_largest"][-1]["ms"]
    assert "draft_stalls:" in capsys.readouterr().out


def test_a_memory_bound_is_passed_to_the_corpus(tmp_path):
    out = tmp_path / "ds.json"
    assert draft_stalls.main(["--seconds", "0.3", "--bursts", "2", "--max-bytes", "4000000", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["learned_max_bytes"] == 4000000 and res["learned_copy_growth"] is True
    # 4 MB holds about 100k tokens (37-40 B each): the learning run's growth stops at the bound
    assert 0 < res["learning"]["learned_tokens_at_end"] <= 4000000 // 30


def test_config_overrides_reach_the_corpus(tmp_path):
    out = tmp_path / "ds.json"
    assert draft_stalls.main(["--seconds", "0.3", "--bursts", "2", "--set", "learned_copy_growth=false",
                              "--out", str(out)]) == 0
    assert json.loads(out.read_text())["learned_copy_growth"] is False


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        draft_stalls.main(["--seconds", "0"])
    with pytest.raises(SystemExit):
        draft_stalls.main(["--max-bytes", "100"])  # too small for 1024 tokens: CorpusConfig refuses it
    with pytest.raises(SystemExit):
        draft_stalls.main(["--bursts", "0"])
    with pytest.raises(SystemExit):
        draft_stalls.main(["--set", "no_such_field=1"])
    with pytest.raises(SystemExit):
        draft_stalls.main(["--set", "learned_copy_growth"])
