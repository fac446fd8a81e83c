"""CPU checks of bench/modes.py's request sets, summary and step log (the benchmark itself runs on a GPU)."""

import pytest

from bench import modes
from bench.penalty_workload import PENALTIES
from tests.verifier.tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)


def test_each_mode_builds_its_requests():
    prompts = [[i, i + 1] for i in range(8)]
    json_prompts = [[100 + i] for i in range(8)]
    ids, params, groups = modes.mode_requests("json", prompts, json_prompts, 16)
    assert ids == json_prompts and all(p.grammar is not None and p.greedy for p in params)
    ids, params, _ = modes.mode_requests("penalties", prompts, json_prompts, 16)
    assert ids == prompts and all(p.presence_penalty == PENALTIES["presence_penalty"] for p in params)
    _, params, _ = modes.mode_requests("sampled", prompts, json_prompts, 16)
    assert {p.temperature for p in params} == {0.8} and {p.top_p for p in params} == {0.95}
    assert len({p.seed for p in params}) == len(prompts)  # a seed per request
    _, params, _ = modes.mode_requests("logprobs", prompts, json_prompts, 16)
    assert all(p.logprobs == 5 and p.greedy for p in params)
    # n = 4: the samples of one prompt share it and a request group, each with its own seed.
    ids, params, groups = modes.mode_requests("n4", prompts, json_prompts, 16)
    assert len(ids) == 8 and ids[:4] == [prompts[0]] * 4 and ids[4:] == [prompts[1]] * 4
    assert groups == ["g0"] * 4 + ["g1"] * 4 and len({p.seed for p in params}) == 8
    _, params, _ = modes.mode_requests("mixed", prompts, json_prompts, 16)
    assert [p.penalized for p in params] == [False, True] * 4
    ids, params, _ = modes.mode_requests("greedy", prompts, json_prompts, 16)
    assert ids == prompts and all(p.greedy and not p.penalized for p in params)
    with pytest.raises(ValueError):
        modes.mode_requests("beam", prompts, json_prompts, 16)


def test_summary_ratios_and_the_worst_case():
    res = {"arms": ["spec", "spec_nogate"], "batches": {
        "1": {"prompts": 4, "rounds": 2,
              "json": {"spec_x": 0.98, "spec_x_warm": 1.02, "spec_mat": 1.1,
                       "spec_nogate_x": 0.7, "spec_nogate_x_warm": 0.75, "spec_nogate_mat": 2.3},
              "penalties": {"spec_x": 1.01, "spec_x_warm": None, "spec_mat": 1.0}}}}
    s = modes.summarize(res)
    assert s["json_b1_spec_x"] == 0.98 and s["json_b1_spec_nogate_x"] == 0.7
    assert s["json_b1_spec_x_warm"] == 1.02 and "penalties_b1_spec_x_warm" not in s
    assert s["min_spec_x"] == 0.98  # the worst mode of the default arm, every round pooled


def test_traces_pool_their_prompts_in_order(tmp_path):
    import json

    (tmp_path / "traces").mkdir()
    for name, ids in (("a.jsonl", [[1, 2], [3]]), ("b.jsonl", [[4], [5, 6], [7]])):
        (tmp_path / "traces" / name).write_text("".join(json.dumps({"prompt_ids": x}) + "\n" for x in ids) + "\n")
    assert modes.trace_prompts(tmp_path, ["a.jsonl", "b.jsonl"]) == [[1, 2], [3], [4], [5, 6], [7]]
    assert modes.trace_prompts(tmp_path, ["b.jsonl"]) == [[4], [5, 6], [7]]
    with pytest.raises(ValueError, match="no trace at"):
        modes.trace_prompts(tmp_path, ["c.jsonl"])


def test_an_arm_s_engine_fields_override_the_run_s():
    from types import SimpleNamespace

    args = SimpleNamespace(max_budget=15, cost_probe_s=0.0, eager=True)
    assert modes.engine_config(64, 512, args).max_budget == 15
    assert modes.engine_config(64, 512, args, max_budget=3).max_budget == 3  # spec_max3
    with pytest.raises(ValueError, match="no"):
        modes.engine_config(64, 512, args, fast=True)


def test_arms_need_the_engine_field_and_bad_arguments_are_refused(capsys):
    assert modes.available_arms(["spec", "spec_gate", "spec_nogate"]) == ["spec", "spec_gate", "spec_nogate"]
    for argv in (["--modes", "beam"], ["--arms", "fast"], ["--prompts", "0"], ["--rounds", "0"],
                 ["--traces", "../x.jsonl"], ["--traces", ","]):
        with pytest.raises(SystemExit):
            modes.main(argv)
    assert "expected" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_step_log_accounts_for_every_step_and_what_the_policy_was_told():
    from verifier.draft.drafter import Drafter
    from verifier.engine.core import Engine, EngineConfig
    from verifier.step.sampling import SamplingParams

    lm = tiny_lm(vocab_size=16, seed=3)
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=16), EngineConfig(max_batch=2, max_len=128, budget=3, max_budget=4))
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4], [6, 7, 6, 7]]
    params = [SamplingParams(max_tokens=9, ignore_eos=True)] * 3
    r = modes.run(eng, prompts, params, [None] * 3, step_log=True)
    log = r["step_log"]
    assert sum(x[1] for x in log) == r["tokens"] == 27 and max(x[0] for x in log) <= 2
    assert sum(x[3] for x in log) == r["request_steps_drafted"] > 0
    assert all(x[8] == 1 for x in log if x[3] > 0)  # a step that verified drafts asked the corpus for them
    classes = r["step_classes"]
    assert classes["drafted"]["steps"] == sum(1 for x in log if x[3] > 0)
    assert sum(c["steps"] for c in classes.values()) == sum(1 for x in log if x[0] > 0)
    assert "draft" not in vars(eng.drafter)  # the ask counter is gone after the run
    # The policy was told of every verify step, and exactly the tokens they committed (prefills apart).
    told = r["policy_log"]
    assert len(told) >= sum(1 for x in log if x[0] > 0) - 1 and sum(x[3] for x in told) == 27 - len(prompts)
    assert all(x[1] == 1 for x in told)  # budget 3: every step drafted
    assert set(r["policy_figures"]) and all("relative" in f for f in r["policy_figures"].values())
    assert "observe_delivered" not in vars(eng.policy)  # the watch is gone after the run
    assert "step_log" not in modes.run(eng, prompts[:1], params[:1], [None])
    eng.drafter.close()
    plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=2, max_len=128, budget=0))
    r = modes.run(plain, prompts, params, [None] * 3, step_log=True)
    assert set(r["step_classes"]) == {"plain"} and r["step_classes"]["plain"]["steps"] >= 8
