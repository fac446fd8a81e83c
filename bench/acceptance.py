"""Acceptance benchmark: replays real traces through the corpus engine exactly as a verifier would.

For each request (file order): start it with its prompt; loop: draft a tree with budget B, accept the
longest tree path equal to the true next output tokens, add one bonus token, extend with them;
finish. Reports MAT (output tokens / verify steps) per category and overall, accepted tokens per
drafted node, microseconds per draft and extend call, and bytes per learned token. Same-run
baselines: prompt lookup (longest suffix n = 3..1 in the context, a chain) and the oracle chain.

  python bench/acceptance.py                       # both shipped traces, budgets 7 and 15
  python bench/acceptance.py --budget 15 --mode prob --replicas 4 --trace humaneval164_greedy.jsonl
  python bench/acceptance.py --concurrent-samples    # n samples of a prompt at once, without and with groups
  python bench/acceptance.py --bound                 # also the perfect-ranking bound of the engine's candidates
  python bench/acceptance.py --ranking today,feedback,model   # the rankings side by side (docs/ranking.md)
  python bench/acceptance.py --ranking today,model --batch 64   # ... with the verifier engine's calls at batch 64

The bound (``--bound``) replays the same trace with every candidate the engine can find (up to
1,024 occurrences per source, long chain walks, full continuations) kept in the tree to depth B,
at any width: the accepted path of that tree is what a perfect ranking of those candidates would
accept with B nodes, since any B-node tree holding the path accepts it. So at every step no
ordering of the engine's evidence accepts more; "captured" is the share of the bound's accepted tokens a B-node tree
gets, (MAT - 1) / (bound - 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import parse_overrides  # noqa: E402
from bench.traces import REPO, Trace, default_trace_files, load_traces  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402


def accept_path(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Length of the longest root path in the tree whose tokens equal truth[0..]."""
    children: dict[int, dict[int, int]] = defaultdict(dict)
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children[p].setdefault(t, i)
    node, n = -1, 0
    while n < len(truth):
        nxt = children.get(node, {}).get(truth[n])
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def prompt_lookup_chain(ctx: list[int], budget: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup decoding: the most recent earlier occurrence of the longest suffix n-gram
    (n = max_ngram..1) and the tokens that followed it."""
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), 0, -1):
        tail = ctx[L - n:]
        for start in range(L - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                return ctx[start + n:start + n + budget]
    return []


# The bound's tree: every node to depth B, at most this many (steps that reach it are counted).
BOUND_WIDTH = 1024


def bound_config(config: CorpusConfig, budget: int) -> CorpusConfig:
    """``config`` with the engine's candidate search opened wide and its trees cut at depth
    ``budget`` instead of at ``budget`` nodes (drafted at ``BOUND_WIDTH`` nodes)."""
    return config.replace(max_depth=budget, max_candidates=1024, max_chain=256, enough_candidates=0,
                          weak_weight=0.0, min_prob=0.0)


class Replay:
    def __init__(self) -> None:
        self.steps = 0
        self.full_trees = 0  # steps whose tree had as many nodes as the budget allowed
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.cat_steps: dict[str, int] = defaultdict(int)
        self.cat_tokens: dict[str, int] = defaultdict(int)

    def record(self, cat: str, out_len: int, steps: int) -> None:
        self.steps += steps
        self.tokens += out_len
        self.cat_steps[cat] += steps
        self.cat_tokens[cat] += out_len

    def summary(self) -> dict:
        return {
            "mat": self.tokens / max(self.steps, 1),
            "accepted_per_drafted_node": self.accepted / max(self.drafted, 1),
            "drafted_nodes_per_step": self.drafted / max(self.steps, 1),
            "full_trees": self.full_trees,
            "per_category": {c: self.cat_tokens[c] / self.cat_steps[c] for c in sorted(self.cat_steps)},
        }


def replay_engine(traces: list[Trace], budget: int, config: CorpusConfig, replicas: int) -> dict:
    engines = [NgramCorpus(config) for _ in range(replicas)]
    rep = Replay()
    draft_ns = extend_ns = start_ns = 0
    n_draft = n_extend = 0
    for k, tr in enumerate(traces):
        eng = engines[k % replicas]
        rid = f"r{k}"
        t0 = time.perf_counter_ns()
        eng.start_request(rid, tr.prompt_ids)
        start_ns += time.perf_counter_ns() - t0
        out, i, steps = tr.output_ids, 0, 0
        while i < len(out):
            t0 = time.perf_counter_ns()
            batch = eng.draft([rid], budget)
            draft_ns += time.perf_counter_ns() - t0
            n_draft += 1
            toks, parents, _ = batch.tree(0)
            a = accept_path(toks, parents, out[i:])
            rep.drafted += len(toks)
            rep.full_trees += len(toks) == budget
            rep.accepted += a
            commit = out[i:i + a + 1]
            t0 = time.perf_counter_ns()
            eng.extend(rid, commit)
            extend_ns += time.perf_counter_ns() - t0
            n_extend += 1
            i += len(commit)
            steps += 1
        eng.finish(rid)
        eng.synchronize()  # requests replay one after another: the next sees all of this one
        rep.record(tr.category, len(out), steps)
    stats = [e.stats() for e in engines]
    learned = sum(s["learned_tokens"] for s in stats)
    res = rep.summary()
    res.update(
        us_per_draft=draft_ns / max(n_draft, 1) / 1e3,
        us_per_draft_engine=1e6 * sum(s["draft_seconds"] for s in stats) / max(sum(s["drafts"] for s in stats), 1),
        us_per_extend=extend_ns / max(n_extend, 1) / 1e3,
        us_per_start=start_ns / max(len(traces), 1) / 1e3,
        learned_tokens=learned,
        bytes_per_learned_token=sum(s["learned_bytes"] for s in stats) / max(learned, 1),
    )
    return res


def sample_sets(traces: list[Trace]) -> list[list[Trace]]:
    """Consecutive traces of one prompt (ids ``PROMPT#SAMPLE``): the n samples of one API request."""
    sets: list[list[Trace]] = []
    for tr in traces:
        if sets and sets[-1][0].id.rpartition("#")[0] == tr.id.rpartition("#")[0]:
            sets[-1].append(tr)
        else:
            sets.append([tr])
    return sets


def replay_concurrent(traces: list[Trace], budget: int, config: CorpusConfig, groups: bool) -> dict:
    """The samples of each prompt replayed at once, as a verifier decoding ``n`` samples does: every
    step drafts all unfinished samples in one batch, then extends each with what it accepted. With
    ``groups`` the samples start in one request group (they draft from each other at once); without,
    they are independent requests (a sample sees a sibling's tokens only via the learned corpus)."""
    eng = NgramCorpus(config)
    rep = Replay()
    draft_ns = drafted_rows = start_ns = started_bytes = 0
    for k, samples in enumerate(sample_sets(traces)):
        ids = [f"p{k}s{j}" for j in range(len(samples))]
        for rid, tr in zip(ids, samples):
            t0 = time.perf_counter_ns()
            eng.start_request(rid, tr.prompt_ids, group=f"p{k}" if groups else None)
            start_ns += time.perf_counter_ns() - t0
        started_bytes += eng.stats()["live_request_bytes"]  # the samples' context indexes, just started
        pos = [0] * len(samples)
        steps = [0] * len(samples)
        live = list(range(len(samples)))
        while live:
            t0 = time.perf_counter_ns()
            batch = eng.draft([ids[j] for j in live], budget)
            draft_ns += time.perf_counter_ns() - t0
            drafted_rows += len(live)
            for row, j in enumerate(live):
                out = samples[j].output_ids
                toks, parents, _ = batch.tree(row)
                a = accept_path(toks, parents, out[pos[j]:])
                rep.drafted += len(toks)
                rep.accepted += a
                commit = out[pos[j]:pos[j] + a + 1]
                eng.extend(ids[j], commit)
                pos[j] += len(commit)
                steps[j] += 1
            for j in [j for j in live if pos[j] >= len(samples[j].output_ids)]:
                eng.finish(ids[j])
                rep.record(samples[j].category, len(samples[j].output_ids), steps[j])
            live = [j for j in live if pos[j] < len(samples[j].output_ids)]
            eng.synchronize()  # inserts applied after every step: deterministic MAT
        eng.synchronize()  # prompts replay one after another: the next sees all of this one
    res = rep.summary()
    res["prompts"] = len(sample_sets(traces))
    res["us_per_draft_row"] = draft_ns / max(drafted_rows, 1) / 1e3
    res["us_per_start"] = start_ns / max(len(traces), 1) / 1e3
    res["kb_per_prompt_started"] = started_bytes / max(res["prompts"], 1) / 1e3
    return res


def replay_prompt_lookup(traces: list[Trace], budget: int) -> dict:
    rep = Replay()
    for tr in traces:
        ctx = list(tr.prompt_ids)
        out, i, steps = tr.output_ids, 0, 0
        while i < len(out):
            chain = prompt_lookup_chain(ctx, budget)
            a = accept_path(chain, list(range(-1, len(chain) - 1)), out[i:])
            rep.drafted += len(chain)
            rep.accepted += a
            commit = out[i:i + a + 1]
            ctx.extend(commit)
            i += len(commit)
            steps += 1
        rep.record(tr.category, len(out), steps)
    return rep.summary()


def replay_oracle(traces: list[Trace], budget: int) -> dict:
    rep = Replay()
    for tr in traces:
        n = len(tr.output_ids)
        steps = -(-n // (budget + 1))
        rep.drafted += steps * budget
        rep.accepted += n - steps
        rep.record(tr.category, n, steps)
    return rep.summary()


def captured(run: dict, bound: dict) -> float:
    """The share of the bound's accepted tokens per step that ``run`` got: (MAT - 1) / (bound - 1)."""
    return (run["mat"] - 1) / max(bound["mat"] - 1, 1e-9)


# The rankings --ranking compares, as CorpusConfig changes of the run's config.
RANKINGS = {
    "today": {"feedback": False, "rank_model": False},
    "feedback": {"feedback": True, "rank_model": False},
    "model": {"feedback": False, "rank_model": True},
}


def main_ranking(args: argparse.Namespace, config: CorpusConfig, budgets: list[int]) -> dict:
    """Same-run comparison of rankings: each trace and budget replayed once per ranking, in turn, so
    the machine's load falls on all of them alike; MAT, accepted tokens per drafted node, drafted nodes
    per step and the draft and extend costs, each ranking's MAT as a ratio of the first one's."""
    names = [n.strip() for n in args.ranking.split(",") if n.strip()]
    unknown = [n for n in names if n not in RANKINGS]
    if unknown or not names:
        raise SystemExit(f"--ranking: expected names from {sorted(RANKINGS)}, got {args.ranking!r}")
    files = args.trace or [str(p) for p in default_trace_files()]
    out = Path(args.out if args.out != str(REPO / "bench" / "results" / "acceptance.json")
               else REPO / "bench" / "results" / "acceptance_ranking.json")
    results = {"config": {k: getattr(config, k) for k in config.__slots__}, "mode": "ranking", "rankings": names,
               "runs": []}
    for f in files:
        traces = load_traces(f, args.limit)
        for b in budgets:
            run = {"trace": Path(f).name, "budget": b, "requests": len(traces)}
            for name in names:
                cfg = config.replace(**RANKINGS[name])
                if args.batch:  # the verifier engine's calls (continuous batching; bench/batched_replay.py)
                    from bench.batched_replay import replay_batched

                    run[name] = replay_batched(traces, b, cfg, args.batch)
                else:
                    run[name] = replay_engine(traces, b, cfg, args.replicas)
            if args.bound:
                run["bound"] = replay_engine(traces, BOUND_WIDTH, bound_config(config, b), args.replicas)
            base = run[names[0]]
            results["runs"].append(run)
            parts = []
            for name in names:
                r = run[name]
                costs = (f", draft {r['us_per_draft_engine']:.2f} us, extend {r['us_per_extend']:.2f} us"
                         if "us_per_extend" in r else "")
                parts.append(f"{name} MAT {r['mat']:.3f} ({r['mat'] / base['mat']:.3f}x, {r['accepted_per_drafted_node']:.3f} "
                             f"acc/node, {r['drafted_nodes_per_step']:.2f} nodes/step{costs})")
            line = f"{Path(f).stem} B={b}: " + " | ".join(parts)
            if "bound" in run:
                line += f" | bound {run['bound']['mat']:.3f}"
            print(line, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    last = names[-1]
    print(f"SUMMARY acceptance ranking {last} vs {names[0]}: MAT "
          + " ".join(f"{r[last]['mat']:.3f} ({r[last]['mat'] / r[names[0]]['mat']:.3f}x)" for r in results["runs"])
          + f" -> {out}")
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help="trace file (repeatable); default: the shipped dev traces")
    ap.add_argument("--budget", type=int, action="append", help="draft budget (repeatable); default 7 and 15")
    ap.add_argument("--mode", default="score", choices=["score", "prob", "bfs"])
    ap.add_argument("--replicas", type=int, default=1, help="R engines, requests dealt round-robin")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--no-baselines", action="store_true", help="skip prompt lookup and oracle")
    ap.add_argument("--concurrent-samples", action="store_true",
                    help="replay the samples of each prompt at once (one batched draft per step), without and "
                         "with request groups; default traces: bench/data/traces/*_t07x4.jsonl")
    ap.add_argument("--bound", action="store_true",
                    help="also replay the perfect-ranking bound: every candidate's path to depth B at any width "
                         "(at every step, what no ordering of the engine's candidates can beat with B nodes)")
    ap.add_argument("--ranking", default=None, metavar="NAMES",
                    help=f"compare rankings in the same run, comma-separated from {sorted(RANKINGS)} "
                         "(e.g. today,feedback,model); with --bound also the perfect-ranking bound")
    ap.add_argument("--batch", type=int, default=0, metavar="N",
                    help="with --ranking: replay N requests at a time with the verifier engine's corpus calls "
                         "(bench/batched_replay.py) instead of one after another")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="CorpusConfig override")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "acceptance.json"))
    args = ap.parse_args(argv)
    if args.batch < 0 or (args.batch and not args.ranking):
        ap.error(f"--batch: expected N >= 1 with --ranking, got {args.batch}")

    overrides = parse_overrides(args.set)
    config = CorpusConfig(mode=args.mode, **overrides)
    budgets = args.budget or [7, 15]
    if args.concurrent_samples:
        return main_concurrent(args, config, budgets)
    if args.ranking:
        return main_ranking(args, config, budgets)
    files = args.trace or [str(p) for p in default_trace_files()]
    results = {"config": {k: getattr(config, k) for k in config.__slots__}, "replicas": args.replicas, "runs": []}
    lines = []
    for f in files:
        traces = load_traces(f, args.limit)
        for b in budgets:
            run = {"trace": Path(f).name, "budget": b, "requests": len(traces)}
            run["engine"] = replay_engine(traces, b, config, args.replicas)
            if args.replicas > 1:
                run["engine_shared"] = replay_engine(traces, b, config, 1)
            if args.bound:
                bc = bound_config(config, b)
                run["bound"] = replay_engine(traces, BOUND_WIDTH, bc, args.replicas)
                if args.replicas > 1:
                    run["bound_shared"] = replay_engine(traces, BOUND_WIDTH, bc, 1)
            if not args.no_baselines:
                run["prompt_lookup"] = replay_prompt_lookup(traces, b)
                run["oracle_chain"] = replay_oracle(traces, b)
            results["runs"].append(run)
            e = run["engine"]
            line = (f"{Path(f).stem} B={b}: MAT {e['mat']:.3f} ({e['accepted_per_drafted_node']:.3f} acc/node, "
                    f"{e['drafted_nodes_per_step']:.1f} nodes/step)")
            if "engine_shared" in run:
                line += f" | shared x1 MAT {run['engine_shared']['mat']:.3f} = {run['engine_shared']['mat'] / e['mat']:.2f}x of R={args.replicas}"
            if "bound" in run:
                line += (f" | bound {run['bound']['mat']:.3f} (captured {captured(e, run['bound']):.1%}; "
                         f"{run['bound']['full_trees']} steps cut at {BOUND_WIDTH} nodes)")
                if "bound_shared" in run:
                    line += (f", shared {run['bound_shared']['mat']:.3f} (captured "
                             f"{captured(run['engine_shared'], run['bound_shared']):.1%}; bound shared/local "
                             f"{run['bound_shared']['mat'] / run['bound']['mat']:.2f}x)")
            if "prompt_lookup" in run:
                line += f" | PLD {run['prompt_lookup']['mat']:.3f} ({e['mat'] / run['prompt_lookup']['mat']:.2f}x)"
                line += f" | oracle {run['oracle_chain']['mat']:.3f}"
            line += (f" | draft {e['us_per_draft']:.1f} us ({e['us_per_draft_engine']:.1f} in engine), extend {e['us_per_extend']:.1f} us, "
                     f"start {e['us_per_start']:.1f} us, {e['bytes_per_learned_token']:.1f} B/learned token")
            print(line, flush=True)
            for cat, mat in e["per_category"].items():
                pl = run.get("prompt_lookup", {}).get("per_category", {}).get(cat)
                print(f"    {cat:>16}: {mat:.3f}" + (f"  (PLD {pl:.3f})" if pl else ""))
            lines.append(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    mats = [r["engine"]["mat"] for r in results["runs"]]
    print(f"SUMMARY acceptance mode={args.mode} R={args.replicas}: MAT " + " ".join(f"{m:.3f}" for m in mats) + f" -> {out}")
    return results


def main_concurrent(args: argparse.Namespace, config: CorpusConfig, budgets: list[int]) -> dict:
    files = args.trace or sorted(str(p) for p in (REPO / "bench" / "data" / "traces").glob("*_t07x4.jsonl"))
    out = Path(args.out if args.out != str(REPO / "bench" / "results" / "acceptance.json")
               else REPO / "bench" / "results" / "acceptance_groups.json")
    results = {"config": {k: getattr(config, k) for k in config.__slots__}, "mode": "concurrent-samples", "runs": []}
    for f in files:
        traces = load_traces(f, args.limit)
        for b in budgets:
            run = {"trace": Path(f).name, "budget": b, "requests": len(traces),
                   "independent": replay_concurrent(traces, b, config, groups=False),
                   "groups": replay_concurrent(traces, b, config, groups=True)}
            run["ratio"] = run["groups"]["mat"] / run["independent"]["mat"]
            results["runs"].append(run)
            print(f"{Path(f).stem} B={b}: {run['requests']} samples of {run['groups']['prompts']} prompts at once: "
                  f"MAT independent {run['independent']['mat']:.3f}, groups {run['groups']['mat']:.3f} "
                  f"= {run['ratio']:.3f}x | draft {run['independent']['us_per_draft_row']:.1f} / "
                  f"{run['groups']['us_per_draft_row']:.1f} us per request, start {run['independent']['us_per_start']:.1f} / "
                  f"{run['groups']['us_per_start']:.1f} us, {run['independent']['kb_per_prompt_started']:.0f} / "
                  f"{run['groups']['kb_per_prompt_started']:.0f} KB of context indexes per prompt", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"SUMMARY acceptance concurrent samples mode={args.mode}: groups/independent MAT "
          + " ".join(f"{r['ratio']:.3f}x" for r in results["runs"]) + f" -> {out}")
    return results


if __name__ == "__main__":
    main()
