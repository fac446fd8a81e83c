"""CPU smoke of bench/fleet.py: replicas sharing a real corpus server, the three ask modes, the
JSON; where another replica answered the same prompts, the remote trees add accepted tokens and the
adaptive ask keeps them."""

import json

import pytest

from bench import fleet
from bench.common import parse_summary


def test_fleet_smoke(tmp_path, capsys, trace_file):
    out = tmp_path / "fleet.json"
    assert fleet.main(["--prompts", "4", "--batch", "2", "--max-new", "24", "--scenarios", "solo,repeat",
                       "--trace", str(trace_file("specbench_dev120_greedy.jsonl")), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for s in ("solo", "repeat"):
        row = res["scenarios"][s]
        for m in fleet.MODES:
            assert row[m]["outputs_follow_trace"] and row[m]["steps"] > 0
        assert row["local"]["asks"] == 0 and row["always"]["asks_skipped"] == 0 and row["always"]["asks"] > 0
    solo, repeat = res["scenarios"]["solo"], res["scenarios"]["repeat"]
    assert solo["always"]["remote_gain_tokens"] == 0  # one replica: the corpus knows nothing more
    assert repeat["always"]["remote_gain_tokens"] > 0 and repeat["adaptive"]["remote_gain_tokens"] > 0
    assert repeat["adaptive"]["mat"] > repeat["local"]["mat"]
    assert parse_summary(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        fleet.main(["--scenarios", "duo", "--out", str(out)])
