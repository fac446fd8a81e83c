"""CPU smoke of bench/remote_overhead.py: a real corpus server, the five drafters, the JSON."""

import json

from bench import remote_overhead
from bench.common import parse_summary


def test_remote_overhead_smoke(tmp_path, capsys, trace_file):
    out = tmp_path / "ro.json"
    trace = trace_file("humaneval164_greedy.jsonl")
    assert remote_overhead.main(["--batches", "1,2", "--steps", "4", "--gpu-ms", "1", "--trace", str(trace),
                                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for B in ("1", "2"):
        row = res["batches"][B]
        assert row["sync"]["remote_steps"] == 4 and row["local"]["remote_steps"] == 0
        for m in ("pipelined", "pipelined_no_await", "pipelined_thread"):
            assert row[m]["remote_steps"] + row[m]["fallback_steps"] >= 3 and row[m]["remote_errors"] == 0
        assert row["pipelined_vs_local"] > 0 and row["pipelined_no_await_vs_local"] > 0 and row["sync_vs_local"] > 0
    assert parse_summary(capsys.readouterr().out)
