"""bench/penalties.py on the CPU: bad shapes are refused, and a small run compares the batched
penalties with the per-request baseline (the same greedy choice, every shape in the summary)."""

import json

import pytest

from bench import penalties


@pytest.mark.parametrize("shapes", ["64", "64x8", "8x16p9", "0x1p0", "axbpc", "8x65p1"])
def test_bad_shapes_are_refused(shapes, capsys):
    with pytest.raises(SystemExit) as e:
        penalties.main(["--shapes", shapes, "--device", "cpu"])
    assert e.value.code == 2 and "--shapes" in capsys.readouterr().err


def test_a_small_cpu_run_agrees_with_the_baseline(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert penalties.main(["--device", "cpu", "--vocab", "300", "--repeats", "1", "--shapes", "3x4p2,2x1p2,2x1p0",
                           "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["bs"], r["K"], r["penalized"]) for r in res["shapes"]] == [(3, 4, 2), (2, 1, 2), (2, 1, 0)]
    assert res["summary"]["all_same_choice"] is True
    assert all(r["max_abs_diff"] < 1e-4 for r in res["shapes"])
    assert set(res["summary"]) >= {"b3_k4_p2_x", "min_x"} and "SUMMARY" in capsys.readouterr().out
