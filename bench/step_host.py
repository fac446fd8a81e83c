#!/usr/bin/env python3
"""Host work of a speculative step before its launch, on any machine (no GPU involved).

For batches of live trace requests drafting from the in-process corpus (budget 12), it times
what the engine's fast path does on the host each step (``Engine._packed_drafts``): the node
choice (``BudgetPolicy.choose_nodes_rows``), the pruning (``tree_batch.prune_rows``) and the
packing (``tree_batch.pack_rows``) of the trees cut to at most 3 nodes (so that pruning has work
to do, as at large batch), and the drafter's extend of the committed tokens. Same-run
baselines: the node choice and pruning without the best-first shortcut (the corpus's rows sorted
as if unranked), and the extend through the generic list form of ``NgramCorpus.extend_batch``.
CPU time of the calling thread, medians. Prints one summary line, writes JSON.

    python3 bench/step_host.py --out bench/results/step_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.traces import default_trace_files, load_traces  # noqa: E402
from verifier.budget.policy import BudgetPolicy, CostModel  # noqa: E402
from verifier.draft.drafter import Drafter  # noqa: E402
from verifier.step.tree_batch import best_first_rows, pack_rows, prune_rows  # noqa: E402

# An H200-like cost model (ms of forward against tokens in the batch): only its shape matters here.
COST = CostModel([1, 64, 256, 1024], [1.2e-3, 1.7e-3, 2.2e-3, 4.1e-3])


def median_us(fn, repeats: int) -> float:
    for _ in range(min(200, repeats)):  # warm-up: first calls pay numpy's and the caches' set-up
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        samples.append(time.thread_time() - t0)
    return 1e6 * statistics.median(samples)


def run(traces, B: int, repeats: int) -> dict[str, float]:
    drafter = Drafter()
    ids = [f"r{i}" for i in range(B)]
    for rid, t in zip(ids, traces):
        drafter.start_request(rid, t.prompt_ids + t.output_ids[: len(t.output_ids) // 2])
    batch = drafter.draft(ids, 12)
    probs, counts = batch.probs, batch.counts.astype(np.int64)
    policy = BudgetPolicy(15, None, COST)
    last, prefix, slots = [1] * B, [100] * B, list(range(B))

    def fast():
        bf = best_first_rows(probs)
        k = policy.choose_nodes_rows(probs, counts, bf)
        t, p, pr, c = prune_rows(batch.tokens, batch.parents, probs, counts, min(k, 3), bf)
        pack_rows(last, t, p, pr, c, prefix, slots, 4)

    def generic():
        k = policy.choose_nodes_rows(probs, counts, best_first=False)
        t, p, pr, c = prune_rows(batch.tokens, batch.parents, probs, counts, min(k, 3), best_first=False)
        pack_rows(last, t, p, pr, c, prefix, slots, 4)

    step = [t.output_ids[:2] for t in traces[:B]]
    runs = np.array([tok for s in step for tok in s], dtype=np.int32)
    lens = np.array([len(s) for s in step], dtype=np.int64)
    out = {"choose_prune_pack_us": median_us(fast, repeats),
           "choose_prune_pack_sorted_us": median_us(generic, repeats),
           "extend_drafter_us": median_us(lambda: drafter.extend_many(list(zip(ids, step))), repeats),
           "extend_int32_runs_us": median_us(lambda: drafter.local.extend_batch(ids, runs, lens), repeats),
           "extend_lists_us": median_us(lambda: drafter.local.extend_batch(ids, step), repeats)}
    drafter.close()
    return {k: round(v, 1) for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_host.json"))
    args = ap.parse_args(argv)
    traces = load_traces(default_trace_files()[0])
    res = {"repeats": args.repeats, "batches": {}}
    for B in (int(b) for b in args.batches.split(",")):
        if not 1 <= B <= len(traces):
            raise ValueError(f"--batches: expected sizes 1..{len(traces)} (the trace's requests), got {B}")
        row = run(traces, B, args.repeats)
        row["sorted_vs_fast"] = round(row["choose_prune_pack_sorted_us"] / row["choose_prune_pack_us"], 2)
        row["lists_vs_int32_runs"] = round(row["extend_lists_us"] / row["extend_int32_runs_us"], 2)
        res["batches"][str(B)] = row
    res["summary"] = {f"b{B}_{k}": r[k] for B, r in res["batches"].items()
                      for k in ("choose_prune_pack_us", "sorted_vs_fast", "extend_drafter_us", "lists_vs_int32_runs")}
    print("SUMMARY " + json.dumps(res["summary"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
