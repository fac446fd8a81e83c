"""CPU smoke of bench/host_phases.py: the engine's graph path with the trace standing in for the
device (its outputs are the trace's), the modes with a real corpus server
(and the rank model's in-process corpus), the JSON."""

import json

import pytest

from bench import host_phases
from bench.common import parse_summary


def test_host_phases_smoke(tmp_path, capsys, trace_file):
    out = tmp_path / "hp.json"
    assert host_phases.main(["--batches", "1,3", "--prompts", "3", "--max-new", "12", "--rounds", "1",
                             "--device-ms", "0.2", "--trace", str(trace_file("specbench_dev120_greedy.jsonl")),
                             "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for B in ("1", "3"):
        row = res["batches"][B]
        for m in ("plain", "local", "remote"):
            r = row[m]
            assert r["outputs_follow_trace"] and r["steps"] > 0 and r["host_ms"] > 0
            assert all(r[p] >= -1e-3 for p in host_phases.PHASES)
        assert row["plain"]["pack"] == 0 and row["local"]["pack"] > 0  # plain steps draft nothing
        assert row["local"]["mat"] >= row["plain"]["mat"]
        assert row["remote"]["draft_steps"]["remote"] + row["remote"]["draft_steps"]["fallback"] > 0
    assert parse_summary(capsys.readouterr().out)
    # Streamed requests (EngineLoop.submit, updates drained on another thread's event loop): the same outputs.
    assert host_phases.main(["--batches", "2", "--prompts", "3", "--max-new", "12", "--rounds", "1",
                             "--device-ms", "0.2", "--modes", "local,local_stream,local_rank",
                             "--trace", str(trace_file("specbench_dev120_greedy.jsonl")), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["batches"]["2"]
    assert row["local_stream"]["outputs_follow_trace"] and row["local_stream"]["mat"] == row["local"]["mat"]
    # The rank model's engine (its draft and commit work on the engine thread): the same outputs, the model used.
    assert row["local_rank"]["outputs_follow_trace"] and row["local_rank"]["rank_tested_nodes"] > 0
    assert row["local"]["rank_tested_nodes"] == 0
    with pytest.raises(SystemExit):
        host_phases.main(["--batches", "0", "--out", str(out)])
