"""bench/plot_e2e.py reads e2e.py's JSON and, for runs whose JSON was lost, its printed log."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from plot_e2e import load_rows  # noqa: E402


def test_rows_from_log_and_json(tmp_path):
    log = tmp_path / "e2e.log"
    log.write_text('noise\nsmollm2 batch 8: {"plain": {"tok_s": 2.5, "mat": 1.0}, "local": {"tok_s": 4.0}}\n'
                   'smollm2 batch 1: {"plain": {"tok_s": 1.0}, "remote": {"tok_s": 0.5}, "remote_vs_local": 0.9}\n')
    assert load_rows(log) == {1: {"plain": 1.0, "remote": 0.5}, 8: {"plain": 2.5, "local": 4.0}}
    js = tmp_path / "e2e.json"
    js.write_text(json.dumps({"smollm2": {"batches": {"64": {"plain": {"tok_s": 3.0}, "local": {"tok_s": 5.0},
                                                               "remote_vs_local": 0.9}}}}))
    assert load_rows(js) == {64: {"plain": 3.0, "local": 5.0}}
    js.write_text(json.dumps({"summary": {"smol_b1_plain_tok_s": 7.0, "smol_b1_local_x": 1.2}}))
    assert load_rows(js) == {1: {"plain": 7.0}}
    js.write_text(json.dumps({"summary": {}}))
    with pytest.raises(ValueError, match="no SmolLM2 rows"):
        load_rows(js)
