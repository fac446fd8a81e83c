"""The penalty workload of ``bench/e2e.py``: Spec-Bench prompts on SmolLM2 with presence,
frequency and repetition penalties (OpenAI-style values users send), at each --penalty-batches size.

Greedy: tokens/s without penalties, with penalties and plain decoding, with penalties and
speculation (local corpus), the acceptance, and whether speculative output is token-identical to
plain output (reported, never raised). Penalties are applied per tree node with its path
(``verifier.step.penalties``); ``penalty_vs_free`` is the plain cost of the penalties themselves.
Sampled (temperature 0.8, same penalties): tokens/s and acceptance (outputs differ by design).
"""

from __future__ import annotations

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


def bench(args, lm, all_prompts: list[list[int]], run_engine, mismatches, ratio) -> dict:
    V = lm.model.config.vocab_size
    max_len = max(map(len, all_prompts)) + args.max_new + args.max_budget + 4
    budget = None if args.budget == "auto" else int(args.budget)
    free = SamplingParams(max_tokens=args.max_new)
    greedy = SamplingParams(max_tokens=args.max_new, **PENALTIES)
    res: dict = {"penalties": PENALTIES, "max_new": args.max_new, "batches": {}}

    def config(B: int, b: int | None) -> EngineConfig:
        return EngineConfig(max_batch=B, max_len=max_len, budget=b, max_budget=args.max_budget,
                            cost_probe_s=args.cost_probe_s, cuda_graphs=not args.eager, compile=not args.eager)

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k != "outputs"}

    Engine(lm.model, lm.codec, None, config(2, 0)).generate(all_prompts[:2], greedy)  # warm-up
    for B in args.penalty_batches:
        prompts = all_prompts[:max(B, args.min_prompts)]
        sampled = [SamplingParams(max_tokens=args.max_new, temperature=0.8, seed=i, **PENALTIES)
                   for i in range(len(prompts))]
        row: dict = {"prompts": len(prompts)}
        row["free"] = strip(run_engine(Engine(lm.model, lm.codec, None, config(B, 0)), prompts, 0, free))
        base = run_engine(Engine(lm.model, lm.codec, None, config(B, 0)), prompts, 0, greedy)
        row["plain"] = strip(base)
        r = run_engine(Engine(lm.model, lm.codec, Drafter(vocab_size=V), config(B, budget)), prompts, 0, greedy)
        n_diff, first = mismatches(base["outputs"], r["outputs"])
        row["spec"] = {**strip(r), "speedup": ratio(r["tok_s"], base["tok_s"]), "identical": n_diff == 0,
                       "outputs_differing": n_diff, "first_diff_pos": first}
        row["penalty_vs_free"] = ratio(base["tok_s"], row["free"]["tok_s"])
        sp = strip(run_engine(Engine(lm.model, lm.codec, None, config(B, 0)), prompts, 0, sampled))
        ss = strip(run_engine(Engine(lm.model, lm.codec, Drafter(vocab_size=V), config(B, budget)),
                              prompts, 0, sampled))
        row["sampled"] = {"plain": sp, "spec": ss, "speedup": ratio(ss["tok_s"], sp["tok_s"])}
        res["batches"][str(B)] = row
        print(f"penalties batch {B}: plain {base['tok_s']} tok/s, spec {r['tok_s']} tok/s "
              f"(x{row['spec']['speedup']}, MAT {r['mat']}, identical {n_diff == 0}); sampled x{row['sampled']['speedup']}",
              flush=True)
    return res


def summarize(res: dict | None) -> dict:
    s: dict = {}
    for B, row in (res or {}).get("batches", {}).items():
        s[f"pen_b{B}_plain_tok_s"] = row["plain"]["tok_s"]
        s[f"pen_b{B}_spec_tok_s"] = row["spec"]["tok_s"]
        s[f"pen_b{B}_spec_x"] = row["spec"]["speedup"]
        s[f"pen_b{B}_spec_mat"] = row["spec"]["mat"]
        s[f"pen_b{B}_identical"] = row["spec"]["identical"]
        s[f"pen_b{B}_vs_free"] = row["penalty_vs_free"]
        s[f"pen_b{B}_sampled_x"] = row["sampled"]["speedup"]
    return s
