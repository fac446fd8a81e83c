"""bench/e2e.py's record of the rounds of one mode (issue 26, point 3: on the H200 the slowest of
five rounds must reach 0.95x the median round and no round's MAT may fall below 0.9x the median):
per-round tok/s and MAT and the two ratios, in the JSON row and in the summary line."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "e2e.py"
_spec = importlib.util.spec_from_file_location("bench_e2e_rounds", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_round_spread_and_summary_carry_the_ratios():
    # The H200 batch-64 run: one round's policy chose plain for 211 full-batch steps.
    rs = [{"tok_s": t, "mat": m} for t, m in ((27000, 2.58), (26500, 2.60), (21000, 1.26), (27500, 2.55), (26900, 2.59))]
    spread = e2e.round_spread(rs)
    assert spread["rounds_tok_s"] == [27000, 26500, 21000, 27500, 26900]
    assert spread["rounds_mat"] == [2.58, 2.60, 1.26, 2.55, 2.59]
    assert spread["slowest_vs_median_round"] == round(21000 / 26900, 3)
    assert spread["min_mat_vs_median"] == round(1.26 / 2.58, 3)
    row = {"plain": {"tok_s": 19000.0}, "local": {"tok_s": 26900.0, "speedup": 1.416, "mat": 2.59, "identical": True,
                                                  **spread}}
    s = e2e.summarize({"batches": {"64": row}}, None)
    assert s["smol_b64_local_slowest_vs_median_round"] == spread["slowest_vs_median_round"]
    assert s["smol_b64_local_min_mat_vs_median"] == spread["min_mat_vs_median"]
    assert s["smol_b64_local_rounds_tok_s"] == spread["rounds_tok_s"] and s["smol_b64_local_rounds_mat"] == spread["rounds_mat"]
    # One round only: no spread to report.
    assert "smol_b1_local_slowest_vs_median_round" not in e2e.summarize(
        {"batches": {"1": {"plain": {"tok_s": 1.0}, "local": {"tok_s": 2.0, "speedup": 2.0, "mat": 2.0, "identical": True}}}},
        None)
