"""bench/rollouts.py at smoke scale: the lockstep replay on the repository's rollout trace slices (the
shared data folder hidden, as on a fresh clone), the memory mode's accounting on a small synthetic
history, and the fleet mode's replica commands."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from bench import rollouts
from tests.conftest import REPO, shared_data_dir


@pytest.fixture
def no_shared_data(monkeypatch, tmp_path):
    monkeypatch.setenv("NGRAM_SHARED_DATA", str(tmp_path / "absent"))


def test_replay_smoke_on_the_shipped_slice(no_shared_data, tmp_path, capsys):
    out = tmp_path / "replay.json"
    res = rollouts.main(["replay", "--trace", "rollouts_dev_g8e3_t07.jsonl", "--prompts", "3", "--out", str(out)])
    assert json.loads(out.read_text())["runs"][0]["ratios"] == pytest.approx(res["runs"][0]["ratios"])
    (run,) = res["runs"]
    assert run["trace"] == "rollouts_dev_g8e3_t07_slice4.jsonl"  # the fallback
    assert run["requests"] == 3 * 8 * 3 and run["prompts"] == 3 and run["scored_epochs"] == [1, 2]
    a = run["arms"]
    assert set(a) == {"shared", "local", "no_history", "prompt_lookup"}
    for arm in a.values():
        assert set(arm["epochs"]) == {"0", "1", "2"}
        for ep in arm["epochs"].values():
            assert ep["tokens"] > 0 and ep["longest_rounds"] <= ep["longest_output"]
    # At T = 0.7 the samples of a prompt overlap: the shared corpus (groups of all 8 samples, every
    # earlier rollout) accepts more than 4 corpora of 2 samples each, and both more than prompt lookup.
    assert a["shared"]["mat"] > a["local"]["mat"] > a["prompt_lookup"]["mat"] > 1.0
    assert a["shared"]["epochs"]["2"]["mat"] > a["shared"]["epochs"]["0"]["mat"]  # history builds up
    assert run["ratios"]["shared_over_local"] == pytest.approx(a["shared"]["mat"] / a["local"]["mat"])
    h = a["shared"]["history"]
    assert h["history_keys"] == 3 and h["history_rollouts"] == 3 * 8 * 3  # max_age 4: all three epochs kept
    assert 0 < h["history_bytes"] <= 48 * h["history_tokens"] + 48 * 256 * 3
    assert a["no_history"]["history"]["history_rollouts"] == 0
    assert "SUMMARY rollouts replay: rollouts_dev_g8e3_t07_slice4 R=4 B=15" in capsys.readouterr().out


def test_phases_split_the_lockstep_rounds_at_the_live_count():
    from bench.rollouts_replay import EpochStats

    st = EpochStats(phase_live=2)
    # Four requests of 5, 3, 2 and 2 tokens without speculation: 4, 4 live, then 2, then 1 and 1.
    for live, tokens in ((4, 4), (4, 4), (2, 2), (1, 1), (1, 1)):
        st.round(live, tokens)
    for n in (5, 3, 2, 2):
        st.add(n, n)
    ph = st.summary()["phases"]
    assert ph["bulk"] == {"rounds": 2, "request_rounds": 8, "tokens": 8, "mat": 1.0}
    assert ph["tail"] == {"rounds": 3, "request_rounds": 4, "tokens": 4, "mat": 1.0}
    # Plain decoding's bulk lasts until the third-longest output is done (2 rounds), its tail 5 - 2.
    assert ph["none"] == {"bulk_rounds": 2, "tail_rounds": 3}


def test_replay_reports_each_epochs_phases(no_shared_data, tmp_path):
    argv = ["replay", "--trace", "rollouts_dev_g8e3_t07.jsonl", "--prompts", "2", "--arms", "shared", "--phase-live", "2"]
    res = rollouts.main(argv + ["--out", str(tmp_path / "r.json")])
    deep = rollouts.main(argv + ["--tail-budget", "63", "--out", str(tmp_path / "d.json")])
    assert deep["tail_budget"] == 63
    base_ep, deep_ep = (r["runs"][0]["arms"]["shared"]["epochs"]["0"]["phases"] for r in (res, deep))
    # The first epoch's bulk comes before any tail: it drafts as before (later epochs learn from the tails).
    assert deep_ep["bulk"] == base_ep["bulk"]
    assert deep_ep["tail"]["mat"] >= base_ep["tail"]["mat"]
    for ep in res["runs"][0]["arms"]["shared"]["epochs"].values():
        ph = ep["phases"]
        assert ph["bulk"]["rounds"] + ph["tail"]["rounds"] == ep["longest_rounds"]
        assert ph["bulk"]["tokens"] + ph["tail"]["tokens"] == ep["tokens"]
        assert ph["bulk"]["request_rounds"] + ph["tail"]["request_rounds"] == ep["rounds"]
        assert ph["none"]["bulk_rounds"] + ph["none"]["tail_rounds"] == ep["longest_output"]


def test_the_slices_are_the_first_prompts_of_the_shared_traces():
    shared = shared_data_dir() / "traces"
    for name, piece in rollouts.SLICES.items():
        sliced = (REPO / "bench" / "data" / "traces" / piece).read_text().splitlines()
        assert len(sliced) == 4 * 8 * 3
        assert len({json.loads(x)["prompt_key"] for x in sliced}) == 4
        if (shared / name).exists():  # provenance: the same rows, in order
            rows = rollouts.load_samples(shared / name, prompts=4)
            assert [(r.key, r.epoch, r.sample, r.output_ids) for r in rows] == [
                (r["prompt_key"], r["epoch"], r["sample"], r["output_ids"]) for r in map(json.loads, sliced)]


def test_missing_traces_and_bad_rows_are_reported(no_shared_data, tmp_path):
    with pytest.raises(FileNotFoundError, match="rollout trace not found"):
        rollouts.trace_path("no_such_rollouts.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "prompt_ids": [1], "output_ids": [2]}) + "\n")
    with pytest.raises(ValueError, match="not a rollout trace"):
        rollouts.load_samples(bad)


def test_memory_mode_counts_what_the_engine_holds(tmp_path):
    res = rollouts.main(["memory", "--prompts", "40", "--samples", "4", "--tokens", "200", "--out",
                         str(tmp_path / "m.json")])
    assert res["keys"] == 40 and res["rollouts"] == 160 and res["tokens"] == 160 * (200 + 16)
    assert res["fits"] and res["within_bound"]
    assert 0 < res["bytes_per_token"] <= res["bytes_per_token_bound"] == 48.0


def test_fleet_replica_commands_follow_the_verifier_contract():
    args = Namespace(model="smollm2", device="cuda", dtype="bfloat16", max_batch=160, max_len=1024, budget=15,
                     replicas=4, verifier_arg=["--log-level=WARNING"], noise_sigma=0.014075, noise_seed_base=20251202,
                     noise_seed_stride=1000)
    cmd = rollouts.verifier_cmd(args, "127.0.0.1:5000", REPO / "p.json", "tok")
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert cmd[1:4] == ["-m", "verifier", "serve"]
    assert flags["--corpus"] == "127.0.0.1:5000" and flags["--corpus-token"] == "tok"
    assert flags["--weight-noise-sigma"] == "0.014075" and flags["--weight-noise-seed"] == "20251202"  # epoch 0's
    assert flags["--allow-weight-updates"] == "true"  # later epochs' weights: POST /v1/update-weights
    assert flags["--allow-policy-version"] == "true" and flags["--admin-key"] == rollouts.VERIFIER_ADMIN_KEY
    assert rollouts.noise_seed(args, 2) == 20251202 + 2000
    assert "--log-level=WARNING" in cmd
    assert flags["--gpu-share"] == "4"  # the replicas share the one GPU
    local = rollouts.verifier_cmd(Namespace(**{**vars(args), "noise_sigma": 0.0}), "local", REPO / "p.json", "tok")
    assert "--corpus-token" not in local and "--weight-noise-sigma" not in local
    cpu = rollouts.verifier_cmd(Namespace(**{**vars(args), "device": "cpu"}), "local", REPO / "p.json", "tok")
    assert "--gpu-share" not in cpu


def _fleet_part(arm: str, makespans: list[float], **over) -> dict:
    res = {"mode": "fleet", "trace": "t.jsonl", "prompts": 2, "samples": 2, "replicas": 2, "epochs": len(makespans),
           "temperature": 0.7, "max_tokens": 8, "noise_sigma": 0.0, "device": "cpu", "dtype": "float32"}
    res.update(over)
    res["arms"] = {arm: {"epochs": {str(e): {"makespan_s": m, "mat": 1.5} for e, m in enumerate(makespans)}}}
    return res


def test_fleet_merge_joins_arms_of_one_schedule(tmp_path):
    paths = []
    for arm, spans in (("shared", [4.0, 2.0]), ("local", [4.0, 3.0]), ("none", [5.0, 5.0])):
        paths.append(tmp_path / f"{arm}.json")
        paths[-1].write_text(json.dumps(_fleet_part(arm, spans)))
    res = rollouts.main(["fleet-merge", *map(str, paths), "--out", str(tmp_path / "all.json")])
    assert set(res["arms"]) == {"shared", "local", "none"}
    assert res["ratios"] == {"makespan_none_over_shared": 2.5, "makespan_local_over_shared": 1.5}  # the last epoch
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_fleet_part("none", [5.0, 5.0], temperature=1.0)))
    with pytest.raises(SystemExit, match="temperature"):
        rollouts.main(["fleet-merge", str(paths[0]), str(other), "--out", str(tmp_path / "x.json")])
    shared_gpu = tmp_path / "gpu_share.json"
    shared_gpu.write_text(json.dumps(_fleet_part("none", [5.0, 5.0], gpu_share=4)))
    with pytest.raises(SystemExit, match="gpu_share"):
        rollouts.main(["fleet-merge", str(paths[0]), str(shared_gpu), "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="appears twice"):
        rollouts.main(["fleet-merge", str(paths[0]), str(paths[0]), "--out", str(tmp_path / "x.json")])


@pytest.mark.slow
def test_phase_stats_split_counters_and_requests():
    before = {"ngram_verifier_steps_total": 10, "ngram_verifier_generated_tokens_total": 100,
              "ngram_verifier_draft_tokens_total": 50, "ngram_verifier_accepted_draft_tokens_total": 20,
              "ngram_verifier_step_seconds_total": 1.0, "ngram_verifier_budget_plain_switches_total_cost": 1}
    after = {"ngram_verifier_steps_total": 30, "ngram_verifier_generated_tokens_total": 160,
             "ngram_verifier_draft_tokens_total": 90, "ngram_verifier_accepted_draft_tokens_total": 30,
             "ngram_verifier_step_seconds_total": 1.1, "ngram_verifier_budget_plain_switches_total_cost": 3}
    st = rollouts.phase_stats(before, after, 0.5, [{"tokens": 12, "steps": 8}, {"tokens": 6, "steps": 4}])
    assert st["engine_steps"] == 20 and st["step_ms"] == pytest.approx(5.0) and st["tokens"] == 60
    assert st["tokens_per_engine_step"] == 3.0 and st["draft_nodes_per_engine_step"] == 2.0
    assert st["acceptance"] == 0.25 and st["plain_switches"] == 2
    assert st["requests_finished"] == 2 and st["finished_mat"] == 1.5
    assert rollouts.phase_stats({}, {}, 0.0, [])["tokens_per_engine_step"] is None  # nothing ran: no ratio


def test_fleet_runs_real_replicas_on_the_cpu(tmp_path):
    """The fleet orchestration end to end at toy scale: a real corpus service, a real verifier replica
    (SmolLM2 on the CPU) serving 2 epochs, the second with new weights pushed in place (POST
    /v1/update-weights, which announces the policy version), answers' usage read back; the keyed
    rollouts of both epochs reach the corpus' history."""
    out = tmp_path / "fleet.json"
    res = rollouts.main(["fleet", "--device", "cpu", "--dtype", "float32", "--replicas", "1", "--samples", "2",
                         "--prompts", "1", "--epochs", "2", "--max-tokens", "6", "--max-batch", "2", "--max-len", "512",
                         "--budget", "4", "--verifier-arg=--budget=4", "--arms", "shared", "none",
                         "--phase-live", "1", "--start-timeout-s", "300", "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == res["ratios"]
    for arm in ("shared", "none"):
        for epoch in ("0", "1"):
            e = res["arms"][arm]["epochs"][epoch]
            assert e["requests"] == 2 and 0 < e["tokens"] <= 12 and e["makespan_s"] > 0
    assert res["arms"]["none"]["epochs"]["1"]["mat"] == 1.0  # no speculation
    # The epoch's phases: while more than 1 request was live (bulk), then the tail; the replica's
    # /metrics read at the boundary split its engine steps and tokens between them.
    for arm in ("shared", "none"):
        e = res["arms"][arm]["epochs"]["1"]
        bulk, tail = e["phases"]["bulk"], e["phases"]["tail"]
        assert bulk["requests_finished"] + tail["requests_finished"] == 2 and tail["requests_finished"] >= 1
        assert bulk["seconds"] + tail["seconds"] == pytest.approx(e["makespan_s"], abs=2e-3)
        assert bulk["engine_steps"] + tail["engine_steps"] > 0 and bulk["tokens"] + tail["tokens"] >= e["tokens"]
    assert res["arms"]["none"]["epochs"]["1"]["phases"]["bulk"]["draft_nodes_per_engine_step"] in (0.0, None)
    assert res["arms"]["shared"]["epochs"]["1"]["mat"] >= 1.0
    assert res["ratios"]["makespan_none_over_shared"] > 0
    assert res["arms"]["shared"]["epochs"]["1"]["policy_update_s"] > 0
    corpus = res["arms"]["shared"]["corpus"]
    assert corpus["policy_version"] == 1  # announced with epoch 1's weights
    assert corpus["history_keys"] == 1 and corpus["history_rollouts"] == 4  # every keyed sample, both epochs


@pytest.mark.slow
def test_rollout_step_runs_one_replica_share_in_process(no_shared_data, tmp_path, capsys):
    """bench/rollout_step.py at toy scale (SmolLM2 on the CPU): both arms, two epochs with the policy
    change copied in, the engine's phases per epoch and one summary line."""
    from bench import rollout_step
    from bench.common import parse_summary

    out = tmp_path / "step.json"
    res = rollout_step.main(["--device", "cpu", "--dtype", "float32", "--prompts", "1", "--max-tokens", "5",
                             "--epochs", "2", "--max-batch", "4", "--max-len", "512", "--out", str(out)])
    assert json.loads(out.read_text())["arms"].keys() == {"none", "local"}
    for arm, r in res["arms"].items():
        assert [e["epoch"] for e in r["epochs"]] == [0, 1]
        for e in r["epochs"]:
            assert e["requests"] == 2 and 1 <= e["longest"] <= 5 and e["steps"] >= 1
            assert e["step_seconds"] >= e["pack_seconds"] + e["forward_seconds"] + e["commit_seconds"] - 1e-6
    assert all(e["mat"] == 1.0 for e in res["arms"]["none"]["epochs"])
    summary = parse_summary(capsys.readouterr().out)
    assert summary["bench"] == "rollout_step" and summary["none_over_local"] > 0
