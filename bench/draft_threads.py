#!/usr/bin/env python3
"""Batch drafts with a pool of threads (``CorpusConfig.draft_threads``) against the calling thread
alone, in the same run, on any machine.

Two corpora are fed the same operations: the Spec-Bench dev trace's requests but the last 64 run
to completion (the learned corpus), the last 64 are live halfway through their outputs. At each batch
size the same batch is drafted at budget 15 by both, alternating, padded (``draft``: the verifier's
in-process corpus) and compact (``draft_compact``: the service's Session step). Wall-clock medians
(the pool's threads work while the caller waits). The outputs must be identical. Prints one summary
line (pooled / serial time per batch size), writes JSON.

    python3 bench/draft_threads.py --threads 2 --out bench/results/draft_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_report  # noqa: E402
from bench.traces import default_trace_files, load_traces  # noqa: E402
from corpus_service import NgramCorpus  # noqa: E402


def build(traces, threads: int) -> tuple[NgramCorpus, list[str]]:
    c = NgramCorpus(draft_threads=threads)
    half = len(traces) - 64  # 56 finished, 64 live
    for i, t in enumerate(traces[:half]):
        c.start_request(f"done{i}", t.prompt_ids)
        c.extend(f"done{i}", t.output_ids)
        c.finish(f"done{i}")
    c.synchronize()
    ids = []
    for i, t in enumerate(traces[half:]):
        c.start_request(f"r{i}", t.prompt_ids)
        c.extend(f"r{i}", t.output_ids[: len(t.output_ids) // 2])
        ids.append(f"r{i}")
    # The live requests' prompts and tokens reach the learned corpus on its insert thread: without
    # this, the first drafts of the two corpora could see different amounts of it.
    c.synchronize()
    return c, ids


def arrays(out) -> tuple:
    """A draft's arrays: a DraftBatch's fields, or draft_compact's tuple as it is."""
    return (out.tokens, out.parents, out.probs, out.counts) if hasattr(out, "counts") else tuple(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="threads of the pooled corpus (2..64)")
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--budget", type=int, default=15)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_threads.json"))
    args = p.parse_args(argv)
    if not 2 <= args.threads <= 64:
        p.error(f"--threads: expected 2..64, got {args.threads}")
    batches = [int(b) for b in args.batches.split(",")]
    traces = load_traces(default_trace_files()[0])
    serial, ids = build(traces, 1)
    pooled, _ = build(traces, args.threads)
    if max(batches) > len(ids):
        p.error(f"--batches: at most {len(ids)} live requests")
    res = {"threads": args.threads, "budget": args.budget, "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
           "batches": {}}
    summary = {}
    for B in batches:
        sel = ids[:B]
        row = {}
        for kind in ("draft", "draft_compact"):
            a, b = (arrays(getattr(c, kind)(sel, args.budget)) for c in (serial, pooled))
            same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
            times = {"serial": [], "pooled": []}
            for _ in range(args.repeats):
                for name, c in (("serial", serial), ("pooled", pooled)):
                    t0 = time.perf_counter()
                    getattr(c, kind)(sel, args.budget)
                    times[name].append(time.perf_counter() - t0)
            s_us, p_us = (1e6 * statistics.median(times[k]) for k in ("serial", "pooled"))
            row[kind] = {"serial_us": round(s_us, 1), "pooled_us": round(p_us, 1), "ratio": round(p_us / s_us, 3),
                         "identical": same}
            if not same:
                print(f"B={B} {kind}: pooled drafts differ from serial ones", file=sys.stderr)
        res["batches"][str(B)] = row
        summary[f"b{B}_draft_ratio"] = row["draft"]["ratio"]
        summary[f"b{B}_compact_ratio"] = row["draft_compact"]["ratio"]
        print(f"B={B}: " + json.dumps(row), flush=True)
    res["summary"] = summary
    write_report(args.out, res, summary)
    ok = all(r[k]["identical"] for r in res["batches"].values() for k in r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
