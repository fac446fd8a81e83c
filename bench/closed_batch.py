#!/usr/bin/env python3
"""Closed batches on the engine's real host path with a modeled device: where a batch's makespan
is its tail, what the budget policy's choices cost, on any machine.

On the H100 (docs/benchmarks.md, "Serving modes") one closed batch of 60 greedy requests of 128
tokens ran 0.92x plain decoding with drafts, while 120 requests refilled into the same batch ran
1.45x: plain decoding ends every request of a closed batch within a few steps of the others, and
drafting spreads their ends, so the batch waits for its worst-drafted request. This benchmark
replays that workload without a GPU: the engine's graph path (``EngineConfig(emulate_graphs=True)``)
with ``bench.host_phases.TraceDevice``'s trace standing in for the model (each request's "model"
predicts its trace's output; greedy verification accepts the longest matching draft path), and the
device's time modeled: a step of B requests (batch bucket) x K nodes takes ``t(B * K)`` from a
measured forward-time table (default: the H100 start-up probe of 2026-12-06, 7eb546e, batch-64
engine), run asynchronously as a GPU does (a launch returns at once, its results are ready ``t``
after the device is free; the host waits for them only when it collects). Host work is this
machine's, so ratios here are indicative; the GPU figures are ``bench/modes.py``'s.

Arms, each on the same requests (the Spec-Bench dev trace's prompts), interleaved per round:
``plain`` (no drafter), ``spec`` (the engine's defaults: adaptive budget), ``spec_critical``
(``MakespanConfig(critical_path=True)``), ``spec_explore2`` (the losing mode explored at most twice
``explore_every`` apart, as before ``explore_factor``'s larger factors), ``spec_explore8`` (a clear
lead re-checked at most 8x apart: ``BudgetPolicy.explore_scale`` 1, the default before 4) and
``spec_bands`` (the estimates calibrated per band of node ranks, ``BudgetPolicy.rank_bands``; off
by default). Per arm: makespan, tok/s over plain's, MAT, steps in the bulk (more than
--phase-live running, or any waiting) and in the tail, and their time, and how the budget policy
decided its steps (``BudgetPolicy.decision_counts``, per round). More --prompts than --batch
make an open workload (the batch refilled as requests end).

    python3 bench/closed_batch.py --batch 64 --prompts 60 --max-new 128 --rounds 3
    python3 bench/closed_batch.py --batch 64 --prompts 120 --max-new 256 --rounds 2   # refilled
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import set_policy_arm, write_report  # noqa: E402
from bench.host_phases import TraceDevice, stand_in_model  # noqa: E402
from bench.traces import default_trace_files, load_traces  # noqa: E402
from verifier.budget.cost_model import CostModel  # noqa: E402
from verifier.budget.makespan import MakespanConfig  # noqa: E402
from verifier.draft.drafter import Drafter  # noqa: E402
from verifier.engine.core import Engine, EngineConfig  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402

# Forward ms by tokens in the step: the H100 start-up probe of the batch-64 engine (bench/e2e.py,
# 2026-12-06, 7eb546e, SmolLM2 bf16 with CUDA graphs).
H100_FORWARD_MS = {1: 1.035, 2: 1.039, 4: 1.043, 8: 1.051, 16: 1.099, 32: 1.242, 64: 1.518, 128: 1.646,
                   256: 1.663, 512: 1.93, 1024: 2.53}
ARMS = ("plain", "spec", "spec_critical", "spec_explore2", "spec_explore8", "spec_bands")


class ModeledDevice(TraceDevice):
    """``TraceDevice`` whose steps take the modeled time of their padded size, asynchronously: a
    launch is ready ``t(B * K)`` after the device is free, and ``collect`` waits until then."""

    def __init__(self, engine: Engine, outputs, forward_s) -> None:
        super().__init__(engine, outputs, 0.0)
        self.forward_s, self.free_at = forward_s, 0.0
        self.ready: dict[int, float] = {}
        g = engine.graphs
        launch, collect = g.launch_input, g.collect

        def launch_input(inp, bs, tokens_from=None):
            out = launch(inp, bs, tokens_from)
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + self.forward_s(inp.B * inp.K)
            self.ready[id(out)] = self.free_at
            return out

        def collect_ready(out, idle=None):
            due = self.ready.pop(id(out), 0.0)
            while time.perf_counter() < due:
                if idle is None or not idle():
                    time.sleep(max(0.0, min(due - time.perf_counter(), 2e-4)))
            return collect(out, idle)

        g.launch_input, g.collect = launch_input, collect_ready

    def _prefill(self, prompts, slots):
        logits = super()._prefill(prompts, slots)
        self.free_at = max(time.perf_counter(), self.free_at) + self.forward_s(sum(map(len, prompts)))
        time.sleep(max(0.0, self.free_at - time.perf_counter()))  # a prefill's results are read at once
        return logits


def cost_model(table: dict[int, float]) -> CostModel:
    """The table as a cost model (seconds): the device's fixed times, or the engine's start-up figures
    (a separate instance, which the engine's observations refit)."""
    xs = sorted(table)
    return CostModel(xs, [table[x] / 1e3 for x in xs])


def run_arm(model, codec, arm: str, traces, args, table) -> dict:
    cost, forward_s = cost_model(table), cost_model(table)
    drafter = None if arm == "plain" else Drafter("local", vocab_size=model.config.vocab_size)
    prompts = [t.prompt_ids for t in traces]
    max_len = max(map(len, prompts)) + args.max_new + args.max_budget + 4
    makespan = MakespanConfig(critical_path=arm == "spec_critical")
    engine = Engine(model, codec, drafter,
                    EngineConfig(max_batch=args.batch, max_len=max_len, budget=0 if arm == "plain" else None,
                                 max_budget=args.max_budget, emulate_graphs=True, cuda_graphs=False, compile=False,
                                 cost_probe_s=0.0, makespan=makespan), cost=None if arm == "plain" else cost)
    set_policy_arm(engine.policy, arm)
    ModeledDevice(engine, {tuple(t.prompt_ids): t.output_ids for t in traces}, forward_s)
    params = SamplingParams(max_tokens=args.max_new)
    try:
        t0 = time.perf_counter()
        reqs = [engine.add_request(p, params) for p in prompts]
        phases = {"bulk": [0, 0.0], "tail": [0, 0.0]}
        while not all(r.finished for r in reqs):
            live = len(engine.scheduler.running)
            t = time.perf_counter()
            engine.step()
            ph = phases["bulk" if live > args.phase_live or engine.scheduler.waiting else "tail"]
            ph[0] += 1
            ph[1] += time.perf_counter() - t
        dt = time.perf_counter() - t0
    finally:
        if drafter is not None:
            drafter.close()
    tokens = sum(len(r.output_ids) for r in reqs)
    steps = sum(r.verify_steps for r in reqs)
    return {"seconds": round(dt, 4), "tokens": tokens, "tok_s": round(tokens / dt, 1), "mat": round(tokens / max(steps, 1), 3),
            "phases": {k: {"steps": n, "ms": round(1e3 * s, 1)} for k, (n, s) in phases.items()},
            "decisions": engine.policy.decision_counts() if drafter is not None else {},
            "outputs": [r.output_ids for r in reqs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="smollm2", help="GGUF file whose tokenizer and shapes are used")
    p.add_argument("--trace", default="", help="trace JSONL (default: the Spec-Bench dev greedy trace)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompts", type=int, default=60, help="requests per round (more than --batch: refilled)")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--max-budget", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3, help="rounds of disjoint requests; arms interleaved in each")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--phase-live", type=int, default=32, help="the tail: at most this many running and none waiting")
    p.add_argument("--forward-ms", default="", help="JSON {tokens: ms} forward-time table (default: the H100's)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "closed_batch.json"))
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms) or "plain" not in arms:
        p.error(f"--arms: expected plain and some of {', '.join(ARMS)}, got {args.arms}")
    if min(args.batch, args.prompts, args.max_new, args.rounds) < 1 or not 1 <= args.max_budget <= 63:
        p.error("--batch, --prompts, --max-new, --rounds: expected >= 1; --max-budget: 1..63")
    try:
        table = {int(k): float(v) for k, v in json.loads(args.forward_ms).items()} if args.forward_ms else H100_FORWARD_MS
    except (ValueError, AttributeError) as e:
        p.error(f"--forward-ms: expected a JSON object of tokens to ms ({e})")
    model, codec = stand_in_model(args.gguf)  # the trace is the model: no forward runs
    traces = load_traces(args.trace or default_trace_files()[0])
    if args.prompts * args.rounds > len(traces):
        p.error(f"--prompts x --rounds: the trace holds {len(traces)} requests")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for rnd in range(args.rounds):
        trs = traces[rnd * args.prompts:(rnd + 1) * args.prompts]
        for a in arms:
            runs[a].append(run_arm(model, codec, a, trs, args, table))
        if any(r["outputs"] != runs["plain"][-1]["outputs"] for a in arms for r in runs[a][-1:]):
            raise SystemExit("an arm's outputs differ from plain decoding's (the stand-in device is deterministic)")
    res: dict = {"batch": args.batch, "prompts": args.prompts, "max_new": args.max_new, "forward_ms": table, "arms": {}}
    plain_s = sum(r["seconds"] for r in runs["plain"])
    plain_tokens = sum(r["tokens"] for r in runs["plain"])
    summary: dict = {}
    for a, rs in runs.items():
        for r in rs:
            r.pop("outputs")
        tok_s = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
        res["arms"][a] = {"rounds": rs, "tok_s": round(tok_s, 1)}
        if a != "plain":
            x = round(tok_s / (plain_tokens / plain_s), 3)
            res["arms"][a]["x_plain"] = summary[f"{a}_x"] = x
            summary[f"{a}_rounds_x"] = [round(r["tok_s"] / p_["tok_s"], 3) for r, p_ in zip(rs, runs["plain"])]
            summary[f"{a}_mat"] = round(sum(r["tokens"] for r in rs) / sum(r["tokens"] / r["mat"] for r in rs), 3)
    write_report(args.out, res, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
