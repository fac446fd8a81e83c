"""CPU smoke of bench/step_host.py: both paths timed on real trace requests, the JSON."""

import json

import pytest

from bench import step_host


def test_step_host_smoke(tmp_path, capsys, data_dir):
    out = tmp_path / "sh.json"
    res = step_host.main(["--batches", "1,3", "--repeats", "5", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    for B in ("1", "3"):
        row = res["batches"][B]
        assert row["choose_prune_pack_us"] > 0 and row["extend_int32_runs_us"] > 0 and row["sorted_vs_fast"] > 0
    assert "SUMMARY" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--batches"):
        step_host.main(["--batches", "0", "--repeats", "1", "--out", str(out)])
