"""CPU checks of the structured-output workload of bench/e2e.py (the benchmark runs on the GPU)."""

import importlib.util
import json
from pathlib import Path

from bench import structured_workload as sw

_PATH = Path(__file__).resolve().parents[2] / "bench" / "e2e.py"
_spec = importlib.util.spec_from_file_location("bench_e2e_structured", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_records_are_deterministic_and_valid_against_the_schema():
    a, b = sw.records(6, seed=3), sw.records(6, seed=3)
    assert a == b and a != sw.records(6, seed=4)
    for r in a:
        assert sw.valid(json.dumps(r))
        assert r["name"] in sw.prompt_text(r) and r["email"] in sw.prompt_text(r)
    assert not sw.valid('{"name": "x"}')  # required keys missing
    assert not sw.valid(json.dumps({**a[0], "plan": "gold"}))  # not in the enum
    assert not sw.valid('{"name": ')  # does not parse


def test_summary_reports_the_structured_rows():
    row = {"plain": {"tok_s": 10.0}, "spec": {"tok_s": 25.0, "speedup": 2.5, "mat": 3.1, "identical": True},
           "valid": "8/8", "grammar_vs_free": 0.97}
    s = e2e.summarize(None, None, {"batches": {"8": row}})
    assert s["json_b8_spec_x"] == 2.5 and s["json_b8_valid"] == "8/8" and s["json_b8_identical"] is True
