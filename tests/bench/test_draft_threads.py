"""CPU smoke of bench/draft_threads.py: pooled and serial drafts of real trace requests, identical."""

import json

import pytest

from bench import draft_threads
from bench.common import parse_summary


def test_draft_threads_bench_smoke(tmp_path, capsys, data_dir):
    out = tmp_path / "dt.json"
    assert draft_threads.main(["--batches", "8,16", "--repeats", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for B in ("8", "16"):
        for kind in ("draft", "draft_compact"):
            row = res["batches"][B][kind]
            assert row["identical"] and row["serial_us"] > 0 and row["pooled_us"] > 0
    assert parse_summary(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        draft_threads.main(["--threads", "1", "--out", str(out)])
