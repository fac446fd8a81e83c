"""bench/norm_linear.py on the CPU: both sides are the torch reference there, so this checks the
benchmark's plumbing (shapes of every projection, the report, argument errors), not its figures."""

import json

import pytest

from bench import norm_linear
from bench.common import parse_summary


def test_cpu_smoke_writes_every_projection(tmp_path, capsys):
    out = tmp_path / "nl.json"
    res = norm_linear.main(["--device", "cpu", "--layers", "2", "--rows", "1,3", "--replays", "2", "--out", str(out)])
    summary = parse_summary(capsys.readouterr().out)
    assert json.loads(out.read_text())["rows"].keys() == {"1", "3"}
    for M in ("1", "3"):
        row = res["rows"][M]
        assert row["rows_independent"] is None  # a GPU-only check
        for impl in ("native", "torch"):
            assert row[f"{impl}_layer_us"] > 0
            assert all(row[f"{impl}_{p}_us"] > 0 for p in norm_linear.PROJECTIONS)
        assert summary[f"M{M}_torch_vs_native"] == row["torch_vs_native"]
    assert summary["rows_independent"] is None


def test_shapes_follow_the_preset():
    from verifier.model import ModelConfig
    s = norm_linear.shapes(ModelConfig.from_name("smollm2-135m"))
    assert s == {"qkv": (True, False, 960, 576), "o": (False, False, 576, 576), "gate_up": (True, True, 1536, 576),
                 "down": (False, False, 576, 1536)}


@pytest.mark.parametrize("args", [["--rows", "33"], ["--rows", "0"], ["--replays", "0"], ["--layers", "-1"]])
def test_bad_arguments_exit_with_a_message(args, tmp_path):
    with pytest.raises(SystemExit):
        norm_linear.main(["--device", "cpu", "--out", str(tmp_path / "x.json")] + args)
