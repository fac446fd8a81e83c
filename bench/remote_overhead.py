#!/usr/bin/env python3
"""What drafting from the corpus service costs a verifier step, on any machine: the GPU step is
emulated by a wait that releases the GIL (as a CUDA synchronisation does), so the measurement is
the engine thread's own work plus whatever the corpus client's thread takes from it.

For each batch size, the same replay of trace requests (draft with the step's budget, wait
``--gpu-ms``, commit two tokens per request) runs with five drafters, in the same run:
- ``local``: the in-process corpus (the baseline);
- ``pipelined``: the corpus service, never waited for, its client in a child process
  (``verifier.draft.drafter``, the default), the answer taken in while the GPU works
  (``Drafter.await_ahead``, as the engine does);
- ``pipelined_no_await``: the same, the answer read when the next step drafts (before the
  engine awaited it);
- ``pipelined_thread``: the same with the client on a thread of this process (``--remote-client thread``);
- ``sync``: the corpus service, waited for every step (``--remote-drafts sync``).
A real ``python -m corpus_service serve`` runs on 127.0.0.1. Prints one summary line (wall time
per step of each remote mode against local), writes JSON.

    python3 bench/remote_overhead.py --out bench/results/remote_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import CorpusServer, write_report  # noqa: E402
from bench.traces import default_trace_files, load_traces  # noqa: E402
from corpus_service.client import CorpusClient  # noqa: E402
from verifier.draft.drafter import AWAIT_AHEAD_S, DraftConfig, Drafter  # noqa: E402

MODES = ("local", "pipelined", "pipelined_no_await", "pipelined_thread", "sync")


def gpu_step(d: Drafter, gpu_s: float, take_answer: bool) -> None:
    """The emulated GPU step. Like the engine's wait for the GPU: the remote answer taken in
    meanwhile (each call waits up to AWAIT_AHEAD_S, so the end may be noticed that late; the CUDA
    engine spins instead, which on a small machine would take a core from the corpus processes)."""
    end = time.perf_counter() + gpu_s
    if take_answer:
        while time.perf_counter() < end and d.await_ahead(AWAIT_AHEAD_S):
            pass
    rest = end - time.perf_counter()
    if rest > 0:
        time.sleep(rest)


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def run(target: str, mode: str, traces, B: int, steps: int, budget: int, gpu_s: float) -> dict:
    d = Drafter("local" if mode == "local" else target,
                DraftConfig(remote_drafts="sync" if mode == "sync" else "pipelined", draft_timeout_s=0.05,
                            corpus_timeout_s=5.0, remote_client="thread" if mode == "pipelined_thread" else "process"))
    try:
        if mode != "local":
            with CorpusClient(target) as c:
                c.reset()  # a fresh corpus per run, like the local mode's
        ids = [f"r{i}" for i in range(B)]
        trs = [traces[i % len(traces)] for i in range(B)]
        for r, t in zip(ids, trs):
            d.start_request(r, t.prompt_ids)
        pos = [0] * B
        engine_s: list[float] = []
        t0 = time.perf_counter()
        for _ in range(steps):
            a = time.perf_counter()
            d.draft(ids, budget)
            d.dispatch()  # as the engine does once the GPU step is launched
            b = time.perf_counter()
            gpu_step(d, gpu_s, mode in ("pipelined", "pipelined_thread"))  # the GIL is free meanwhile
            c = time.perf_counter()
            items = []
            for i, t in enumerate(trs):
                out = t.output_ids
                k = pos[i] % max(1, len(out) - 2)
                items.append((ids[i], list(out[k:k + 2])))
                pos[i] += 2
            d.extend_many(items)
            engine_s.append((b - a) + (time.perf_counter() - c))
        wall = (time.perf_counter() - t0) / steps
        for r in ids:
            d.finish(r)
        st = d.stats
        return {"wall_ms_per_step": round(wall * 1e3, 3),
                "engine_thread_ms_p50": round(statistics.median(engine_s) * 1e3, 3),
                "remote_steps": st.remote_steps, "fallback_steps": st.fallback_steps, "remote_errors": st.remote_errors}
    finally:
        d.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--budget", type=int, default=7)
    p.add_argument("--gpu-ms", type=float, default=1.2, help="emulated GPU step (the H200's SmolLM2 step is ~1.2 ms)")
    p.add_argument("--trace", default="", help="trace JSONL (default: the HumanEval greedy trace)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "remote_overhead.json"))
    args = p.parse_args(argv)
    if args.steps < 1 or args.budget < 1 or args.gpu_ms < 0:
        p.error("--steps and --budget must be >= 1, --gpu-ms >= 0")
    traces = load_traces(args.trace or default_trace_files()[1])
    tmp = tempfile.TemporaryDirectory()
    server = CorpusServer(tmp.name).start()
    target = server.target
    res: dict = {"gpu_ms": args.gpu_ms, "budget": args.budget, "steps": args.steps, "batches": {}}
    try:
        for B in args.batches:
            row = {m: run(target, m, traces, B, args.steps, args.budget, args.gpu_ms / 1e3) for m in MODES}
            for m in MODES[1:]:
                row[f"{m}_vs_local"] = round(row["local"]["wall_ms_per_step"] / row[m]["wall_ms_per_step"], 3)
            res["batches"][str(B)] = row
            print(f"B={B}: " + json.dumps(row), flush=True)
    finally:
        server.stop()
        tmp.cleanup()
    res["summary"] = {f"b{B}_{m}_vs_local": r[f"{m}_vs_local"] for B, r in res["batches"].items() for m in MODES[1:]}
    write_report(args.out, res, res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
