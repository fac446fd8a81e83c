#!/usr/bin/env python3
"""One fleet replica's share of a GRPO rollout schedule, in process: where its steps' time goes.

``bench/rollouts.py fleet`` measures makespans through HTTP, with R replicas sharing a GPU. This runs
what one of them serves (every prompt x ``--samples`` samples: 2 is G = 8 over R = 4) on one engine
in this process, epoch after epoch with the policy change in place (the fleet's perturbation, copied
into the live model as ``POST /v1/update-weights`` does), for each arm on the same prompts and seeds:
``none`` (no corpus) and ``local`` (the embedded corpus, kept across epochs, with each request's prompt
key and policy version). Per epoch: the engine's step seconds split as its stats split them (``pack``:
drafting, node choice and packing, graph captures included; ``forward``: launch to results, the
verification included; ``commit``; prefills), steps, CUDA graphs captured during the epoch, MAT and
the longest output. ``--profile-steps N``: a torch profiler table (device time per op) over N steps
of the last epoch of each arm.

Prints one summary line (the last epoch's step seconds of each arm and none / local), writes JSON.

    python3 bench/rollout_step.py                                   # on a GPU: 67 prompts x 2, 384 tokens, T = 0.7
    python3 bench/rollout_step.py --device cpu --dtype float32 --prompts 2 --max-tokens 8 --epochs 2   # smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_report  # noqa: E402
from bench.rollouts_common import NOISE_SIGMA, TRACE_NAMES, load_samples, trace_path  # noqa: E402
from verifier.draft.drafter import Drafter  # noqa: E402
from verifier.engine.core import Engine, EngineConfig  # noqa: E402
from verifier.model import load_model  # noqa: E402
from verifier.model.loader import copy_weights_, read_weights  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402

STATS = ("steps", "step_seconds", "pack_seconds", "forward_seconds", "commit_seconds", "prefill_seconds",
         "corpus_seconds", "draft_tokens", "accepted_tokens", "generated_tokens")


def profile_table(prof, device: str) -> str:
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25)


def run_arm(arm: str, lm, prompts: list[tuple[str, list[int]]], args: argparse.Namespace) -> dict:
    drafter = None if arm == "none" else Drafter("local", vocab_size=lm.model.config.vocab_size)
    cfg = EngineConfig(max_batch=args.max_batch, max_len=args.max_len, budget=0 if arm == "none" else None,
                       max_budget=args.budget)
    eng = Engine(lm.model, lm.codec, drafter, cfg)
    out: dict = {"epochs": []}
    try:
        for epoch in range(args.epochs):
            if epoch > 0 and args.noise_sigma > 0:  # the next policy, in place (the live engine keeps its graphs)
                mcfg, state = read_weights(args.model, args.noise_sigma, args.noise_seed_base + epoch)
                eng.quiesce()
                copy_weights_(eng.model, mcfg, state)
            graphs0 = eng.graphs.captures if eng.graphs is not None else 0
            before = {k: getattr(eng.stats, k) for k in STATS}
            reqs = []
            for i, (key, ids) in enumerate(prompts):
                for s in range(args.samples):
                    p = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=False,
                                       seed=args.seed * 1_000_003 + epoch * 10_007 + i * 101 + s)
                    reqs.append(eng.add_request(ids, p, prompt_key=key, policy_version=epoch))
            prof = None
            last = epoch == args.epochs - 1
            t0, n = time.perf_counter(), 0
            while not all(r.finished for r in reqs):
                if last and args.profile_steps and n == args.profile_skip:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
                    prof = profile(activities=acts)
                    prof.__enter__()
                eng.step()
                n += 1
                if prof is not None and n == args.profile_skip + args.profile_steps:
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    prof.__exit__(None, None, None)
                    out["profile"] = profile_table(prof, args.device)
                    prof = None
            if prof is not None:  # the epoch ended inside the window
                prof.__exit__(None, None, None)
                out["profile"] = profile_table(prof, args.device)
            d = {k: getattr(eng.stats, k) - v for k, v in before.items()}
            steps = sum(r.verify_steps for r in reqs)
            d.update(epoch=epoch, wall_s=time.perf_counter() - t0, engine_steps=n,
                     captures=(eng.graphs.captures if eng.graphs is not None else 0) - graphs0,
                     mat=(steps + sum(r.accepted_tokens for r in reqs)) / max(1, steps),
                     longest=max(len(r.output_ids) for r in reqs), requests=len(reqs))
            out["epochs"].append(d)
            print(f"  {arm} epoch {epoch}: {d['step_seconds']:.3f} s in {d['steps']} steps (pack {d['pack_seconds']:.3f}, "
                  f"forward {d['forward_seconds']:.3f}, commit {d['commit_seconds']:.3f}), {d['captures']} captures, "
                  f"MAT {d['mat']:.3f}", flush=True)
    finally:
        if drafter is not None:
            drafter.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=TRACE_NAMES[1], help="the rollout trace whose prompts (and keys) to serve")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all)")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt this replica serves (G / R)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--budget", type=int, default=15, help="--max-budget (the policy chooses, as a replica's)")
    ap.add_argument("--max-batch", type=int, default=160)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--noise-sigma", type=float, default=NOISE_SIGMA, help="policy change per epoch (0: none)")
    ap.add_argument("--noise-seed-base", type=int, default=0, help="epoch e's weights: seed BASE + e")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", nargs="*", default=["none", "local"], choices=["none", "local"])
    ap.add_argument("--profile-steps", type=int, default=0, help="torch profiler over N steps of each arm's last epoch")
    ap.add_argument("--profile-skip", type=int, default=40, help="steps of that epoch before the profiler starts")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout_step.json"))
    args = ap.parse_args(argv)
    if args.samples < 1 or args.epochs < 1 or args.max_tokens < 1:
        raise SystemExit("--samples, --epochs and --max-tokens must be >= 1")
    path = trace_path(args.trace)
    rows = [r for r in load_samples(path, args.prompts, 1) if r.sample == 0]
    prompts = [(r.key, r.prompt_ids) for r in rows]
    lm = load_model(args.model, args.device, args.dtype, args.noise_sigma, args.noise_seed_base)
    res = {"mode": "rollout_step", "date": time.strftime("%Y-%m-%d", time.gmtime()), "trace": path.name,
           "prompts": len(prompts), "samples": args.samples, "epochs": args.epochs, "temperature": args.temperature,
           "max_tokens": args.max_tokens, "device": args.device, "dtype": args.dtype, "arms": {}}
    for arm in args.arms:
        res["arms"][arm] = run_arm(arm, lm, prompts, args)
    last = {arm: r["epochs"][-1] for arm, r in res["arms"].items()}
    summary = {"bench": "rollout_step", "requests": len(prompts) * args.samples, "temperature": args.temperature,
               **{f"{arm}_step_s": round(d["step_seconds"], 3) for arm, d in last.items()},
               **{f"{arm}_mat": round(d["mat"], 3) for arm, d in last.items()}}
    if "none" in last and "local" in last:
        summary["none_over_local"] = round(last["none"]["step_seconds"] / max(last["local"]["step_seconds"], 1e-9), 3)
    write_report(args.out, res, summary)
    return res


if __name__ == "__main__":
    main()
