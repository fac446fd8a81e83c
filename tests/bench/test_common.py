"""bench/common.py: the percentiles every benchmark reports, the median run, and the one-line summary
with its JSON report (written, then read back as a run comparison would)."""

import json

import numpy as np
import pytest

from bench.common import (CorpusServer, median_run, parse_summary, percentiles, quantile_key,
                          write_report)


def test_percentiles_match_numpy_with_the_unit_in_each_key():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0]
    got = percentiles(xs, "us", digits=None)
    assert got == {"n": 6, "p50_us": float(np.percentile(xs, 50)), "p99_us": float(np.percentile(xs, 99)),
                   "mean_us": float(np.mean(xs)), "max_us": 100.0}
    assert got["p50_us"] == 3.5  # interpolated between the two middle samples, not one of them


def test_percentiles_scale_round_and_name_fractional_quantiles():
    seconds = [0.0012345, 0.0023456, 0.0034567]
    got = percentiles(seconds, "ms", scale=1e3, qs=(50, 99.9), digits=3)
    assert got["p50_ms"] == 2.346 and got["max_ms"] == 3.457
    assert "p999_ms" in got and got["p999_ms"] <= got["max_ms"]
    assert quantile_key(99.9, "ms") == "p999_ms" and quantile_key(50, "us") == "p50_us"


def test_percentiles_of_nothing_say_so():
    assert percentiles([], "ms") == {"n": 0}


@pytest.mark.parametrize("kwargs, message", [
    (dict(values=[1.0, float("nan")]), "not finite"),
    (dict(values=[1.0], unit=""), "unit"),
    (dict(values=[1.0], qs=(50, 101)), "quantile"),
    (dict(values=[1.0], qs=(99.9, 9.99)), "same key"),
    (dict(values=[[1.0, 2.0]]), "flat"),
])
def test_percentiles_refuse_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        percentiles(**kwargs)


def test_median_run_is_a_run_that_happened():
    runs = [{"tok_s": 3.0, "id": "a"}, {"tok_s": 1.0, "id": "b"}, {"tok_s": 2.0, "id": "c"}, {"tok_s": 4.0, "id": "d"}]
    assert median_run(runs, "tok_s")["id"] == "c"  # the lower of the two middle runs
    assert median_run(runs[:3], "tok_s")["id"] == "c"
    with pytest.raises(ValueError, match="no runs"):
        median_run([], "tok_s")
    with pytest.raises(ValueError, match="have no 'mat'"):
        median_run(runs, "mat")


def test_write_report_writes_the_json_and_one_summary_line(tmp_path, capsys):
    out = tmp_path / "nested" / "res.json"
    res = {"rows": [{"p50_us": 1.5}], "path": tmp_path}  # a Path is written as text, not refused
    write_report(out, res, {"b1_ratio": 0.97, "ok": True})
    text = capsys.readouterr().out
    assert parse_summary(text) == {"b1_ratio": 0.97, "ok": True}
    assert json.loads(out.read_text()) == {"rows": [{"p50_us": 1.5}], "path": str(tmp_path)}
    with pytest.raises(ValueError, match="non-empty dict"):
        write_report(out, res, {})


def test_parse_summary_wants_exactly_one_line_holding_an_object():
    with pytest.raises(ValueError, match="found 0"):
        parse_summary("B=1: {}\nno summary here\n")
    with pytest.raises(ValueError, match="found 2"):
        parse_summary('SUMMARY {"a": 1}\nSUMMARY {"a": 2}\n')
    with pytest.raises(ValueError, match="not an object"):
        parse_summary("SUMMARY [1, 2]\n")
    with pytest.raises(json.JSONDecodeError):
        parse_summary("SUMMARY speedup 2x\n")  # the free-text summaries of the past do not parse


def test_corpus_server_starts_on_ephemeral_ports_and_stops(tmp_path):
    """The process every service benchmark starts: a real server, its ports read back, a clear
    error (with the log) when it cannot start."""
    from corpus_service.client import CorpusClient

    with CorpusServer(tmp_path / "ok") as srv:
        assert srv.alive() and srv.grpc_port > 0 and srv.admin_port == 0
        with CorpusClient(srv.target, timeout=30) as client:
            client.start_request("r", [1, 2, 3, 1, 2, 3, 1, 2])
            assert client.draft(["r"], 4) is not None
    assert not srv.alive()
    bad = CorpusServer(tmp_path / "bad", "--namespace", "x:vocab=-1", log_level=None)
    with pytest.raises(RuntimeError, match="exited"):
        bad.start(timeout=60)


def test_gc_watch_counts_full_collections_inside_it_only():
    import gc

    from bench.common import GcWatch

    gc.collect()  # before: not counted
    with GcWatch() as w:
        gc.collect(0)  # a young collection: not a full one
        gc.collect()
        gc.collect()
    gc.collect()  # after: not counted
    assert w.full == 2 and w.seconds > 0
    assert w.as_dict() == {"gc_full": 2, "gc_full_s": round(w.seconds, 4)}


def test_gc_watch_freezes_the_heap_only_while_inside():
    import gc

    from bench.common import GcWatch

    with GcWatch(freeze=True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_policy_arms_set_fields_the_budget_policy_has():
    """An arm's fields are BudgetPolicy's own (a misspelt one would only add an attribute)."""
    from bench.common import POLICY_ARMS, set_policy_arm
    from verifier.budget.policy import BudgetPolicy, CostModel

    for arm, fields in POLICY_ARMS.items():
        p = BudgetPolicy(15, None, CostModel([1, 8], [1e-3, 1e-3]))
        assert set(fields) <= set(vars(p)), arm
        set_policy_arm(p, arm)
        assert all(getattr(p, f) == v for f, v in fields.items())
    p = BudgetPolicy(15, None, CostModel([1, 8], [1e-3, 1e-3]))
    before = dict(vars(p))
    set_policy_arm(p, "spec")  # the defaults: nothing changed
    assert vars(p).keys() == before.keys() and p.explore_max == before["explore_max"]
