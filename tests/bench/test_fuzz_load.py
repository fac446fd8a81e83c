"""Smoke scale of bench/fuzz_load.py: hostile callers (BatchGet floods with fresh client ids, many
sessions, one huge request, malformed gRPC and REST input) against a real server whose limits are
small enough that every flood is refused part way; its RSS stays within the configured bounds."""

import json

from bench import fuzz_load
from bench.common import parse_summary


def test_fuzz_load_smoke_stays_within_the_configured_bounds(tmp_path, capsys):
    out = tmp_path / "fuzz_load.json"
    assert fuzz_load.main(["--scale", "smoke", "--out", str(out)]) == 0, capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["server_alive"] and res["log_tracebacks"] == 0
    assert res["grpc"]["cases"] > 0 and res["rest"]["cases"] > 0
    assert res["grpc"]["unclear"] == [] and res["rest"]["unclear"] == []
    # The budget (16 MiB) is smaller than what the callers ask for: each flood is cut short.
    assert res["flood"]["codes"].get("RESOURCE_EXHAUSTED", 0) > 0 and res["flood"]["codes"].get("OK", 0) > 0
    assert res["refused"]["live_request_bytes"] > 0
    assert res["huge"]["tokens_held"] < 600_000 and "max_live_request_bytes" in res["huge"]["stopped_by"]
    assert res["rss_peak_mib"] <= res["bound_mib"]
    assert res["live_requests_after_idle"] == 0
    # What the budget charges a request covers what the server holds for it.
    assert 0 < res["probe"]["rss_per_request_b"] <= res["probe"]["charged_per_request_b"]
    summary = parse_summary(capsys.readouterr().out)
    assert summary["scale"] == "smoke" and summary["ok"] and summary["rss_peak_mib"] == res["rss_peak_mib"]
