#!/usr/bin/env python3
"""What would hiding the remote corpus' round trip cost in acceptance? A replay experiment.

A verifier that waits for the shared (remote) corpus every step pays a network round trip per
step (docs/benchmarks.md, end to end: remote 0.54-0.92x the in-process corpus). The alternative
is to ask the shared corpus one step ahead, without waiting: the tree that arrives during step n
was drafted from the context before step n, so at step n + 1 it is re-rooted along the tokens
step n committed (the subtree under that path, probabilities divided by the path's), and merged
with a fresh tree from the verifier's own in-process corpus (its own requests only). This replays
the traces with R verifiers (requests dealt round-robin) and compares, in the same run:

- ``local``: each verifier drafts only from its own in-process corpus (fresh);
- ``shared``: every step waits for the shared corpus (fresh; today's remote mode);
- ``local+stale shared``: fresh local tree merged with the one-step-stale shared tree.

MAT is deterministic (inserts are synchronized after every request).

    python3 bench/stale_drafts.py --trace bench/data/traces/humaneval164_t07x4.jsonl --replicas 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import Replay, accept_path  # noqa: E402
from bench.traces import REPO, Trace, default_trace_files, load_traces  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402

Tree = dict[tuple[int, ...], float]  # root path (tokens below the root) -> path probability


def as_paths(tokens: list[int], parents: list[int], probs: list[float]) -> Tree:
    paths: list[tuple[int, ...]] = []
    out: Tree = {}
    for t, p, q in zip(tokens, parents, probs):
        path = (paths[p] if p >= 0 else ()) + (int(t),)
        paths.append(path)
        out[path] = max(out.get(path, 0.0), float(q))
    return out


def reroot(tree: Tree, committed: list[int]) -> Tree:
    """The subtree under the committed tokens' path, with probabilities conditioned on it."""
    c = tuple(committed)
    base = tree.get(c)
    if not base:
        return {}
    n = len(c)
    return {p[n:]: min(1.0, q / base) for p, q in tree.items() if len(p) > n and p[:n] == c}


def merge(a: Tree, b: Tree, budget: int) -> tuple[list[int], list[int]]:
    """Union (max probability per path), the ``budget`` most probable nodes (a closed tree: a
    child's probability never exceeds its parent's in either source, ties go to the shallower),
    as (tokens, parents) in parent-before-child order."""
    union = dict(a)
    for p, q in b.items():
        union[p] = max(union.get(p, 0.0), q)
    keep = sorted(union, key=lambda p: (-union[p], len(p)))[:budget]
    kept = set(keep)
    keep = [p for p in sorted(keep, key=len) if len(p) == 1 or p[:-1] in kept]
    index = {p: i for i, p in enumerate(keep)}
    return [p[-1] for p in keep], [index[p[:-1]] if len(p) > 1 else -1 for p in keep]


def replay(traces: list[Trace], budget: int, config: CorpusConfig, replicas: int) -> dict:
    reps = {"local": Replay(), "shared": Replay(), "local+stale shared": Replay()}
    # Each mode replays its own decoding (what it accepts decides its steps), so each keeps its own
    # copy of the corpora: mode -> (shared corpus, local corpora).
    state = {m: (NgramCorpus(config), [NgramCorpus(config) for _ in range(replicas)]) for m in reps}
    for k, tr in enumerate(traces):
        for mode, rep in reps.items():
            sh, loc = state[mode]
            mine = loc[k % replicas]
            rid = f"r{k}"
            sh.start_request(rid, tr.prompt_ids)
            mine.start_request(rid, tr.prompt_ids)
            out, i, steps, stale, last_commit = tr.output_ids, 0, 0, {}, []
            while i < len(out):
                if mode == "local":
                    t, p, _ = mine.draft([rid], budget).tree(0)
                elif mode == "shared":
                    t, p, _ = sh.draft([rid], budget).tree(0)
                else:
                    fresh = as_paths(*mine.draft([rid], budget).tree(0))
                    t, p = merge(fresh, reroot(stale, last_commit), budget)
                    stale = as_paths(*sh.draft([rid], budget).tree(0))  # asked now, used next step
                a = accept_path(list(t), list(p), out[i:])
                rep.drafted += len(t)
                rep.accepted += a
                commit = out[i:i + a + 1]
                sh.extend(rid, commit)
                mine.extend(rid, commit)
                last_commit = commit
                i += len(commit)
                steps += 1
            sh.finish(rid)
            mine.finish(rid)
            sh.synchronize()
            mine.synchronize()
            rep.record(tr.category, len(out), steps)
    return {m: r.summary() for m, r in reps.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help="trace file (repeatable); default: the shipped dev traces")
    ap.add_argument("--budget", type=int, action="append", help="draft budget (repeatable); default 7 and 15")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stale_drafts.json"))
    args = ap.parse_args(argv)
    files = args.trace or [str(p) for p in default_trace_files()]
    config = CorpusConfig()
    runs, lines = [], []
    for f in files:
        traces = load_traces(f, args.limit)
        for b in args.budget or [7, 15]:
            res = replay(traces, b, config, args.replicas)
            mat = {m: round(r["mat"], 3) for m, r in res.items()}
            ratio = round(mat["local+stale shared"] / mat["shared"], 3)
            runs.append({"trace": Path(f).name, "budget": b, "replicas": args.replicas, "results": res,
                         "stale_vs_fresh_shared": ratio})
            lines.append(f"{Path(f).name} B={b}: MAT {mat}, local+stale / shared {ratio}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    for line in lines:
        print(line)
    print("SUMMARY " + "; ".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
