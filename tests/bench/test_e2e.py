"""CPU smoke of bench/e2e.py's helpers (the benchmark itself runs on the GPU machine)."""

import gc
import importlib.util
import json
from pathlib import Path

import argparse

import pytest
import torch

from tests.verifier.tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)

_PATH = Path(__file__).resolve().parents[2] / "bench" / "e2e.py"
_spec = importlib.util.spec_from_file_location("bench_e2e", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_parse_ints_and_ratio():
    assert e2e.parse_ints("1,8, 64") == [1, 8, 64]
    with pytest.raises(argparse.ArgumentTypeError):
        e2e.parse_ints("0,1")
    assert e2e.ratio(3.0, 2.0) == 1.5
    assert e2e.ratio(None, 2.0) is None and e2e.ratio(1.0, 0) is None


def test_pooled_rate_weighs_rounds_by_their_time():
    runs = [{"tokens": 100, "seconds": 1.0}, {"tokens": 300, "seconds": 1.0}]
    assert e2e.pooled_tok_s(runs) == 200.0
    # A slow round counts for its time: 200 tokens in 4 s, not the mean of 100 and 33.3 tok/s.
    assert e2e.pooled_tok_s([{"tokens": 100, "seconds": 1.0}, {"tokens": 100, "seconds": 3.0}]) == 50.0


def test_mismatches_reports_first_differing_position():
    assert e2e.mismatches([[1, 2], [3]], [[1, 2], [3]]) == (0, [])
    assert e2e.mismatches([[1, 2, 3], [4]], [[1, 9, 3], [4, 5]]) == (2, [1, 1])


def test_load_prompts_cycles(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [i, i + 1]}) for i in range(3)) + "\n")
    assert e2e.load_prompts(f, 4) == [[0, 1], [1, 2], [2, 3], [0, 1]]


def test_forward_time_and_summary_on_a_tiny_model():
    cfg = e2e.ModelConfig.from_name("smollm2-135m", num_layers=1, vocab_size=64, hidden_size=32,
                                    intermediate_size=64, num_heads=4, num_kv_heads=2, eos_token_ids=())
    model = e2e.build_model(cfg, None, "cpu", torch.float32)
    cache = e2e.KVCache(1, 2, 16, 2, cfg.head_dim, "cpu", torch.float32)
    assert e2e.forward_time(model, cache, 2, 4, 8, repeats=2) > 0
    big = {"weight_read_ms": 1.0, "decode_vs_weight_read": {"1": 1.2}, "step_ms": {"1": {"1": 1.2, "16": 1.3}},
           "vs_decode": {"1": {"16": 1.08}}}
    s = e2e.summarize(None, big)
    assert s["8b_b1_decode_vs_read"] == 1.2 and s["8b_b1_verify16_vs_decode"] == 1.08


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--rounds", "0", "--skip-8b", "--skip-structured", "--skip-penalties", "--skip-smol"])
    assert "--rounds: expected >= 1" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_step_log_accounts_for_every_step_and_token():
    from verifier.draft.drafter import Drafter
    from verifier.engine.core import Engine, EngineConfig
    from verifier.step.sampling import SamplingParams

    lm = tiny_lm(vocab_size=16, seed=3)
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=16),
                 EngineConfig(max_batch=2, max_len=128, budget=3, max_budget=4))
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4], [6, 7, 6, 7]]
    r = e2e.run_engine(eng, prompts, 0, SamplingParams(max_tokens=9, ignore_eos=True), step_log=True)
    log = r["step_log"]
    assert len(log) == r["engine_steps"] and sum(x[2] for x in log) == r["tokens"] == 27
    assert sum(x[3] for x in log) == r["prefills"]
    assert max(x[1] for x in log) == 2 and min(x[1] for x in log) >= 1  # at most max_batch running
    assert any(x[4] for x in log) and all(x[0] > 0 for x in log)  # budget 3: steps drafted
    # Steps that verified drafts, and what they accepted (the drafts' quality apart from plain steps).
    assert 0 < r["spec_steps"] <= r["verify_steps"]
    assert r["accepted_per_spec_step"] == pytest.approx(r["accepted"] / r["spec_steps"], abs=1e-4)
    # The run went with the process's heap frozen (as a server's is), and left it as it was.
    assert r["gc_full"] >= 0 and r["gc_full_s"] >= 0 and gc.get_freeze_count() == 0
    # The phase columns add up to the run's own phase totals, and no phase outlasts its step.
    assert all(len(x) == 5 + len(e2e.STEP_PHASES) for x in log)
    for j, name in enumerate(("prefill_s", "corpus_s", "pack_s", "forward_s", "commit_s")):
        assert sum(x[5 + j] for x in log) == pytest.approx(r[name] * 1e3, abs=0.1)  # totals: 0.1 ms steps
    assert all(0 <= p <= x[0] + 1e-3 for x in log for p in x[5:])
    # The summary's kinds of steps partition the log.
    summ = r["step_summary"]
    assert sum(k["steps"] for k in summ.values()) == len(log) and summ["drafted"]["steps"] > 0
    assert sum(k["tokens"] for k in summ.values()) == 27
    assert sum(k["ms"] for k in summ.values()) == pytest.approx(sum(x[0] for x in log), abs=0.1)
    assert eng.step.__func__ is Engine.step  # the wrapper is gone after the run
    assert "step_log" not in e2e.run_engine(eng, prompts[:1], 0, SamplingParams(max_tokens=2, ignore_eos=True))


def test_host_cpu_reports_the_limit_and_a_process_cpu_time():
    """bench/host_cpu.py, which e2e runs record (CPU quota, throttling, the processes' CPU seconds)."""
    import os

    from bench import host_cpu

    lim = host_cpu.cpu_limit()
    assert lim["cpus"] >= 1 and (lim["quota_cpus"] is None or lim["quota_cpus"] > 0)
    watch = host_cpu.CpuWatch({"me": os.getpid(), "gone": 2**22 + 12345})
    sum(i * i for i in range(200_000))  # some CPU to count
    out = watch.stop()
    assert out["me_cpu_s"] >= 0 and "gone_cpu_s" not in out
    t = host_cpu.throttled()
    assert t is None or (t[0] >= 0 and t[1] >= 0)


def test_summary_carries_the_paired_remote_statistic():
    row = {"plain": {"tok_s": 100.0}, "local": {"tok_s": 200.0, "speedup": 2.0, "mat": 2.5, "identical": True},
           "remote": {"tok_s": 190.0, "speedup": 1.9, "mat": 2.4, "identical": True},
           "remote_vs_local": 0.95, "remote_vs_local_rounds": [0.9, 0.97, 0.99], "remote_vs_local_median_round": 0.97}
    s = e2e.summarize({"batches": {"1": row}}, None)
    assert s["smol_b1_remote_vs_local"] == 0.95 and s["smol_b1_remote_vs_local_median_round"] == 0.97
