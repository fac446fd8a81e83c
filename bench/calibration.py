"""Calibration benchmark: do the draft tree's probabilities say how often a node is accepted?

Replays a trace as bench/acceptance.py does and, for every drafted node whose parent was accepted
(a tested node), compares its conditional probability P(node | parent) = prob(node) / prob(parent)
with whether it was accepted. Prints, per depth, the observed acceptance rate in bins of the
predicted one, and the expected calibration error (ECE: |predicted - observed| averaged over
tested nodes, by bin). Run it with and without acceptance feedback (CorpusConfig.feedback):

  python bench/calibration.py                          # specbench_dev120, B = 7, feedback off
  python bench/calibration.py --set feedback=true --budget 15 --trace humaneval164_greedy.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import accept_path  # noqa: E402
from bench.common import parse_overrides, write_report  # noqa: E402
from bench.traces import REPO, default_trace_files, load_traces  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402

BINS = 10


def tested_nodes(tokens: list[int], parents: list[int], probs: list[float], truth: list[int]):
    """Yields (depth, conditional probability, accepted) for each tested node (parents come first)."""
    depth: list[int] = []
    ok: list[bool] = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = 1 if p < 0 else depth[p] + 1
        depth.append(d)
        tested = (p < 0 or ok[p]) and d <= len(truth)
        ok.append(tested and t == truth[d - 1])
        if tested:
            yield d, probs[i] / (probs[p] if p >= 0 else 1.0), ok[-1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(default_trace_files()[0]))
    ap.add_argument("--budget", type=int, default=7)
    ap.add_argument("--limit", type=int, default=None, help="first N requests")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="CorpusConfig override")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "calibration.json"))
    args = ap.parse_args(argv)

    config = CorpusConfig(**parse_overrides(args.set))
    eng = NgramCorpus(config)
    # (depth bucket, predicted bin) -> [tested, accepted, sum of predicted]
    cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    tokens_out = steps = 0
    for k, tr in enumerate(load_traces(args.trace, args.limit)):
        rid = f"r{k}"
        eng.start_request(rid, tr.prompt_ids)
        out, i = tr.output_ids, 0
        while i < len(out):
            toks, parents, probs = eng.draft([rid], args.budget).tree(0)
            for d, q, accepted in tested_nodes(toks, parents, probs, out[i:]):
                c = cells[(min(d, 4), min(int(q * BINS), BINS - 1))]
                c[0] += 1
                c[1] += accepted
                c[2] += q
            commit = out[i:i + accept_path(toks, parents, out[i:]) + 1]
            eng.extend(rid, commit)
            i += len(commit)
            steps += 1
        tokens_out += len(out)
        eng.finish(rid)
        eng.synchronize()

    tested = sum(c[0] for c in cells.values())
    ece = sum(abs(c[2] / c[0] - c[1] / c[0]) * c[0] for c in cells.values()) / max(tested, 1)
    table = {f"depth{d}{'+' if d == 4 else ''}": [
        {"predicted": round(c[2] / c[0], 3), "observed": round(c[1] / c[0], 3), "tested": int(c[0])}
        for (dd, _), c in sorted(cells.items()) if dd == d] for d in range(1, 5)}
    for name, rows in table.items():
        print(f"  {name:>7}: " + "  ".join(f"{r['predicted']:.2f}->{r['observed']:.2f} ({r['tested']})" for r in rows))
    res = {"trace": Path(args.trace).name, "budget": args.budget, "feedback": config.feedback,
           "mat": tokens_out / max(steps, 1), "tested_nodes": tested, "ece": ece, "table": table}
    write_report(args.out, res, {"trace": res["trace"], "budget": args.budget, "feedback": config.feedback,
                                 "ece": round(ece, 4), "tested_nodes": tested, "mat": round(res["mat"], 4)})
    return res


if __name__ == "__main__":
    main()
