"""SGLang-pattern replay: the corpus driven exactly as SGLang's NGRAM worker drives its corpus.

SGLang's ``NGRAMWorker`` (``python/sglang/srt/speculative/ngram_worker.py``) never shows its corpus a
whole request. The prefill step drafts nothing and puts nothing; then every decode step calls
``synchronize()``, ``batch_get(req_ids, windows, total_lens)`` with each request's last
``max_trie_depth`` (18) tokens of prompt + output and its full length, verifies the K =
``draft_token_num`` tokens (the last token and K - 1 draft nodes, ``(drafts, mask)`` flat), and after
the verify ``batch_put``s each request's last 18 tokens again; a finished request's match state is
erased. This replays the traces' true outputs that way (the accepted path of the tree is the
longest one equal to the true next tokens, plus the bonus token) for, in one run:

- ``dropin``: ``corpus_service.NgramCorpus(draft_token_num=K, match_type=...)``, its defaults;
- ``dropin_sglang_bfs`` / ``dropin_sglang_prob``: the same with ``sglang_ordering=True``;
- ``sglang_bfs`` / ``sglang_prob``: the reference reimplementation of SGLang's own trie corpus
  (``bench/sglang_reference.py``, SGLang's server defaults: depth 18, BFS breadth 1..10);
- ``request_level``: the project's own API over the same steps (``start_request`` with the whole
  prompt, ``draft(budget=K - 1)``, ``extend``), which sees what SGLang's calls never pass.

MAT = tokens committed by decode steps / decode steps (SGLang's mean accept length; the prefill's
token is in neither). Deterministic: it does not depend on the machine.

  python3 bench/sglang_pattern.py                  # dev traces, K = 16 and 8, match_type BFS
  python3 bench/sglang_pattern.py --k 16 --concurrency 8 --trace bench/data/traces/humaneval164_t07x4.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import accept_path  # noqa: E402
from bench.common import parse_overrides, write_report  # noqa: E402
from bench.sglang_reference import SGLangNgramReference  # noqa: E402
from bench.traces import REPO, Trace, load_traces, shared_data_dir  # noqa: E402
from corpus_service import NgramCorpus  # noqa: E402

WINDOW = 18  # SGLang's speculative_ngram_max_trie_depth: its query and put windows


def default_traces() -> list[Path]:
    """The greedy dev traces of the shared data folder (where there is one), then the repository's."""
    shared = sorted((shared_data_dir() / "traces").glob("*_greedy.jsonl"))
    return shared + sorted((REPO / "bench" / "data" / "traces").glob("*.jsonl"))


def flat_accept(drafts: np.ndarray, mask: np.ndarray, truth: list[int]) -> int:
    """Tokens of ``truth`` accepted from one flat tree: ``drafts`` [K] (index 0 the last token),
    ``mask`` [K, K] ancestor rows. A node's parent is its nearest ancestor; siblings with one token
    are tried in index order (the verifier takes the first)."""
    k = drafts.shape[0]
    children: dict[int, dict[int, int]] = {}
    for j in range(1, k):
        anc = np.flatnonzero(mask[j, :j])
        parent = int(anc[-1]) if anc.size else 0
        children.setdefault(parent, {}).setdefault(int(drafts[j]), j)
    node = n = 0
    while n < len(truth):
        nxt = children.get(node, {}).get(truth[n])
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def real_nodes(drafts: np.ndarray, mask: np.ndarray) -> int:
    """Draft nodes that are not padding (token 0 directly under the root; a real token 0 there
    counts as padding too, which only undercounts)."""
    under_root = mask[1:].sum(axis=1) == 2
    return int(np.count_nonzero(~(under_root & (drafts[1:] == 0))))


class _Run:
    def __init__(self) -> None:
        self.steps = self.tokens = self.accepted = self.nodes = 0
        self.by_cat: dict[str, list[int]] = {}

    def record(self, tr: Trace, steps: int, tokens: int) -> None:
        self.steps += steps
        self.tokens += tokens
        c = self.by_cat.setdefault(tr.category, [0, 0])
        c[0] += tokens
        c[1] += steps

    def summary(self, seconds: float) -> dict:
        return {"mat": self.tokens / max(self.steps, 1), "steps": self.steps, "tokens": self.tokens,
                "accepted_per_step": self.accepted / max(self.steps, 1),
                "nodes_per_step": self.nodes / max(self.steps, 1), "seconds": round(seconds, 2),
                "per_category": {c: t / max(s, 1) for c, (t, s) in sorted(self.by_cat.items())}}


def replay_sglang(traces: list[Trace], corpus: Any, k: int, window: int = WINDOW, concurrency: int = 1) -> dict:
    """Drives ``corpus`` (any object with SGLang's corpus methods) as SGLang's NGRAM worker does:
    up to ``concurrency`` requests decode together, admitted in file order."""
    t0 = time.perf_counter()
    run = _Run()
    pending = [(i, tr) for i, tr in enumerate(traces) if len(tr.output_ids) > 1]  # the prefill makes token 0
    live: list[dict] = []
    while pending or live:
        while pending and len(live) < concurrency:
            i, tr = pending.pop(0)
            ctx = list(tr.prompt_ids) + tr.output_ids[:1]  # the prefill's token
            live.append({"rid": f"req-{i}", "tr": tr, "ctx": ctx, "pos": 1, "steps": 0})
        corpus.synchronize()
        drafts, mask = corpus.batch_get([r["rid"] for r in live], [r["ctx"][-window:] for r in live],
                                        [len(r["ctx"]) for r in live])
        drafts = drafts.reshape(len(live), k)
        mask = mask.reshape(len(live), k, k)
        for row, r in enumerate(live):
            out = r["tr"].output_ids
            a = flat_accept(drafts[row], mask[row], out[r["pos"]:])
            run.nodes += real_nodes(drafts[row], mask[row])
            commit = out[r["pos"]:r["pos"] + a + 1]
            r["ctx"] += commit
            r["pos"] += len(commit)
            r["steps"] += 1
            run.accepted += a
        corpus.batch_put([r["ctx"][-window:] for r in live])
        done = [r for r in live if r["pos"] >= len(r["tr"].output_ids)]
        if done:
            corpus.erase_match_state([r["rid"] for r in done])
            for r in done:
                run.record(r["tr"], r["steps"], len(r["tr"].output_ids) - 1)
        live = [r for r in live if r["pos"] < len(r["tr"].output_ids)]
    corpus.synchronize()
    return run.summary(time.perf_counter() - t0)


def replay_request_level(traces: list[Trace], k: int, concurrency: int = 1) -> dict:
    """The project's request-level API over the same steps: the whole prompt indexed at the start,
    ``draft(budget=K - 1)`` per step, ``extend`` with what was committed, ``finish``."""
    t0 = time.perf_counter()
    eng = NgramCorpus()
    run = _Run()
    pending = [(i, tr) for i, tr in enumerate(traces) if len(tr.output_ids) > 1]
    live: list[dict] = []
    while pending or live:
        while pending and len(live) < concurrency:
            i, tr = pending.pop(0)
            rid = f"req-{i}"
            eng.start_request(rid, tr.prompt_ids)
            eng.extend(rid, tr.output_ids[:1])  # the prefill's token
            live.append({"rid": rid, "tr": tr, "pos": 1, "steps": 0})
        batch = eng.draft([r["rid"] for r in live], k - 1)
        for row, r in enumerate(live):
            out = r["tr"].output_ids
            toks, parents, _ = batch.tree(row)
            a = accept_path(toks, parents, out[r["pos"]:])
            run.nodes += len(toks)
            commit = out[r["pos"]:r["pos"] + a + 1]
            eng.extend(r["rid"], commit)
            r["pos"] += len(commit)
            r["steps"] += 1
            run.accepted += a
        for r in [r for r in live if r["pos"] >= len(r["tr"].output_ids)]:
            eng.finish(r["rid"])
            run.record(r["tr"], r["steps"], len(r["tr"].output_ids) - 1)
        live = [r for r in live if r["pos"] < len(r["tr"].output_ids)]
        eng.synchronize()  # inserts applied after every step: deterministic MAT
    return run.summary(time.perf_counter() - t0)


# The corpus arguments SGLang's worker passes (NgramCorpus(...) in ngram_worker.py), at its server
# defaults (speculative_ngram_*); match_type and draft_token_num come per contender.
SGLANG_ARGS = dict(max_trie_depth=WINDOW, min_bfs_breadth=1, max_bfs_breadth=10, capacity=10_000_000,
                   external_sam_budget=0, external_corpus_max_tokens=10_000_000)


def contenders(match_type: str, overrides: dict | None = None) -> dict[str, Callable[[int], Any]]:
    """Each built as SGLang's worker builds its corpus. ``overrides`` (CorpusConfig fields) apply to
    the drop-in's default only: a sweep of it."""
    trie = {k: SGLANG_ARGS[k] for k in ("max_trie_depth", "min_bfs_breadth", "max_bfs_breadth", "capacity")}
    return {
        "dropin": lambda k: NgramCorpus(draft_token_num=k, match_type=match_type, **SGLANG_ARGS, **(overrides or {})),
        "dropin_sglang_bfs": lambda k: NgramCorpus(draft_token_num=k, match_type="BFS", sglang_ordering=True,
                                                   **SGLANG_ARGS),
        "dropin_sglang_prob": lambda k: NgramCorpus(draft_token_num=k, match_type="PROB", sglang_ordering=True,
                                                    **SGLANG_ARGS),
        "sglang_bfs": lambda k: SGLangNgramReference(k, "BFS", **trie),
        "sglang_prob": lambda k: SGLangNgramReference(k, "PROB", **trie),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help="trace file (repeatable); default: the greedy shared dev "
                    "traces where ../shared exists, and bench/data/traces/*.jsonl")
    ap.add_argument("--k", type=int, action="append", help="draft_token_num, the root included (repeatable); "
                    "default 16 and 8 (budgets 15 and 7)")
    ap.add_argument("--match-type", default="BFS", choices=["BFS", "PROB"],
                    help="the match_type the drop-in is constructed with, as SGLang passes it (default BFS, SGLang's)")
    ap.add_argument("--window", type=int, default=WINDOW, help=f"query and put window in tokens (SGLang: {WINDOW})")
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoding together, >= 1 (default 1)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--only", action="append", choices=[*contenders("BFS"), "request_level"],
                    help="replay only these (repeatable); default all")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="CorpusConfig override for the drop-in's default (repeatable; a sweep, not the default)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sglang_pattern.json"))
    args = ap.parse_args(argv)
    overrides = parse_overrides(args.set)
    if args.concurrency < 1 or args.window < 1:
        ap.error("--concurrency and --window must be >= 1")
    ks = args.k or [16, 8]
    if any(k < 2 for k in ks):
        ap.error("--k must be >= 2 (the root and at least one draft node)")
    files = [Path(f) for f in args.trace] if args.trace else default_traces()
    chosen = contenders(args.match_type, overrides)
    names = args.only or [*chosen, "request_level"]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "window": args.window, "concurrency": args.concurrency,
                 "match_type": args.match_type, "dropin_overrides": overrides, "runs": []}
    ratios: dict[str, float] = {}
    for f in files:
        traces = load_traces(f, args.limit)
        for k in ks:
            run: dict = {"trace": f.name, "k": k, "requests": len(traces)}
            for name in names:
                if name == "request_level":
                    run[name] = replay_request_level(traces, k, args.concurrency)
                else:
                    run[name] = replay_sglang(traces, chosen[name](k), k, args.window, args.concurrency)
            line = f"{f.stem} K={k}: " + ", ".join(f"{n} {run[n]['mat']:.3f}" for n in names)
            if "dropin" in run and "sglang_bfs" in run:
                run["dropin_vs_sglang_bfs"] = run["dropin"]["mat"] / run["sglang_bfs"]["mat"]
                ratios[f"{f.stem}/K={k}"] = round(run["dropin_vs_sglang_bfs"], 4)
                line += f" | dropin / sglang_bfs {run['dropin_vs_sglang_bfs']:.3f}x"
                if "sglang_prob" in run:
                    best = max(run["sglang_bfs"]["mat"], run["sglang_prob"]["mat"])
                    run["dropin_vs_sglang_best"] = run["dropin"]["mat"] / best
                    line += f", / best SGLang mode {run['dropin_vs_sglang_best']:.3f}x"
            print(line, flush=True)
            res["runs"].append(run)
    summary = {"bench": "sglang_pattern", "match_type": args.match_type, "concurrency": args.concurrency,
               "dropin_overrides": overrides,
               "mat": {f"{r['trace'].removesuffix('.jsonl')}/K={r['k']}": {n: round(r[n]["mat"], 3) for n in names}
                       for r in res["runs"]},
               "dropin_vs_sglang_bfs": ratios, "min_ratio": min(ratios.values()) if ratios else None,
               "out": str(args.out)}
    write_report(args.out, res, summary)
    return res


if __name__ == "__main__":
    main()
