#!/usr/bin/env python3
"""How long a batch draft can wait while the learned corpus takes in finished requests, on any
machine.

A verifier (or the corpus service) drafts for its live batch every step, while requests that
finished go to the learned corpus on the engine's insert thread. That thread applies what is
queued under the learned corpus' exclusive lock, so a draft arriving meanwhile waits. This
benchmark measures those waits:
- ``learning``: one thread drafts for 64 live requests at budget 15 in a closed loop, while another
  feeds bursts of 48 finished trace requests (prompt and output) every ``--burst-gap-ms``, so the
  learned corpus grows to about 2M tokens;
- ``idle``: the same drafts on the same corpus with nothing being learned (the same-run baseline);
- ``apply``: the same bursts fed alone, each followed by ``synchronize()``: how long the insert
  thread takes per burst, with the learned corpus' size. Since the head tables are rebuilt under the
  shared lock (``Corpus::grow_learned``), a draft waits only for part of a long one.
Prints one summary line (draft p50 / p99 / max with learning, and p99 against idle), writes JSON.

    python3 bench/draft_stalls.py --out bench/results/draft_stalls.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.traces import load_traces  # noqa: E402
from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402

TRACE = ROOT / "bench" / "data" / "traces" / "humaneval164_t07x4.jsonl"
BATCH, BUDGET, BURST = 64, 15, 48


def percentiles(us: list[float]) -> dict:
    a = np.asarray(us)
    return {"n": int(a.size), "p50_us": round(float(np.percentile(a, 50)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1), "max_us": round(float(a.max()), 1),
            "over_10ms": int((a > 1e4).sum()), "top5_ms": [round(float(x) / 1e3, 2) for x in np.sort(a)[::-1][:5]]}


def feed_burst(c: NgramCorpus, traces, k: int) -> int:
    """BURST finished requests (prompt and whole output) starting at trace k; returns the next k."""
    for j in range(BURST):
        t = traces[(k + j) % len(traces)]
        rid = f"x{k + j}"
        c.start_request(rid, t.prompt_ids)
        c.extend(rid, t.output_ids)
        c.finish(rid)
    return k + BURST


def live_corpus(traces, config: CorpusConfig) -> tuple[NgramCorpus, list[str]]:
    c = NgramCorpus(config)
    ids = [f"r{i}" for i in range(BATCH)]
    for i, r in enumerate(ids):
        t = traces[i % len(traces)]
        c.start_request(r, t.prompt_ids)
        c.extend(r, t.output_ids[:30])
    c.synchronize()
    return c, ids


def run_learning(traces, seconds: float, gap_s: float, config: CorpusConfig) -> tuple[list[float], int]:
    c, ids = live_corpus(traces, config)
    stop = threading.Event()

    def writer() -> None:
        k = BATCH
        while not stop.is_set():
            k = feed_burst(c, traces, k)
            stop.wait(gap_s)

    th = threading.Thread(target=writer, name="learner")
    th.start()
    lat: list[float] = []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            a = time.perf_counter()
            c.draft(ids, BUDGET)
            lat.append((time.perf_counter() - a) * 1e6)
    finally:
        stop.set()
        th.join()
    c.synchronize()
    return lat, int(c.stats()["learned_tokens"])


def run_idle(traces, bursts: int, drafts: int, config: CorpusConfig) -> list[float]:
    c, ids = live_corpus(traces, config)
    k = BATCH
    for _ in range(bursts):
        k = feed_burst(c, traces, k)
    c.synchronize()
    lat = []
    for _ in range(drafts):
        a = time.perf_counter()
        c.draft(ids, BUDGET)
        lat.append((time.perf_counter() - a) * 1e6)
    return lat


def run_apply(traces, bursts: int, config: CorpusConfig) -> list[dict]:
    c = NgramCorpus(config)
    out, k = [], 0
    for _ in range(bursts):
        k = feed_burst(c, traces, k)
        a = time.perf_counter()
        c.synchronize()
        out.append({"ms": round((time.perf_counter() - a) * 1e3, 2), "learned_tokens": int(c.stats()["learned_tokens"])})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=6.0, help="length of the learning run")
    p.add_argument("--burst-gap-ms", type=float, default=20.0, help="pause between bursts of finished requests")
    p.add_argument("--bursts", type=int, default=120, help="bursts of the apply run (and learned before the idle run)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="CorpusConfig.learned_max_bytes (default: the config's, 2 GiB); a small bound reaches "
                        "the steady state of eviction and compaction within the run")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="CorpusConfig override, e.g. learned_copy_growth=false (grow in place under the lock)")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_stalls.json"))
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.burst_gap_ms < 0 or args.bursts < 1:
        p.error("--seconds must be > 0, --burst-gap-ms >= 0, --bursts >= 1")
    overrides = {} if args.max_bytes is None else {"learned_max_bytes": args.max_bytes}
    for kv in args.set:
        k, eq, v = kv.partition("=")
        if not eq:
            p.error(f"--set: expected FIELD=VALUE, got {kv!r}")
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    try:
        config = CorpusConfig(**overrides)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    traces = load_traces(args.trace)
    learning, learned = run_learning(traces, args.seconds, args.burst_gap_ms / 1e3, config)
    idle = run_idle(traces, args.bursts, min(len(learning), 5000), config)
    apply = run_apply(traces, args.bursts, config)
    worst = sorted(apply, key=lambda r: -r["ms"])[:5]
    res = {"batch": BATCH, "budget": BUDGET, "burst": BURST, "burst_gap_ms": args.burst_gap_ms,
           "learned_max_bytes": config.learned_max_bytes, "learned_copy_growth": config.learned_copy_growth,
           "learning": {**percentiles(learning), "learned_tokens_at_end": learned}, "idle": percentiles(idle),
           "apply_largest": worst, "apply_median_ms": float(np.median([r["ms"] for r in apply]))}
    res["p99_learning_vs_idle"] = round(res["learning"]["p99_us"] / res["idle"]["p99_us"], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    L, I = res["learning"], res["idle"]
    print(f"draft_stalls: batch {BATCH} at budget {BUDGET} while learning (to {learned} tokens): p50 {L['p50_us']} us "
          f"p99 {L['p99_us']} us max {L['max_us'] / 1e3:.1f} ms ({L['over_10ms']} over 10 ms); idle p99 {I['p99_us']} us "
          f"({res['p99_learning_vs_idle']}x); largest apply {worst[0]['ms']} ms at {worst[0]['learned_tokens']} "
          f"learned tokens -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
