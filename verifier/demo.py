"""``ngram-verifier demo``: a corpus and a verifier on the CPU with the real SmolLM2 model.

Runs a few real prompts (the chat-templated prompts of ``$NGRAM_SHARED_DATA/traces`` when that
folder exists, else of the repository's ``bench/data/traces``, else built-in prompts) one at a
time, first with plain greedy decoding, then speculatively with drafts from the corpus, and prints
tokens/s of both, the acceptance (MAT: tokens committed per verify step) and whether the outputs are
token-identical.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .drafter import Drafter
from .engine import Engine, EngineConfig
from .model import load_model
from .sampling import SamplingParams

BUILTIN_PROMPTS = [
    "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number, with a docstring and an example.",
    "Explain in three sentences why the sky is blue.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "List five tips for writing clear technical documentation.",
]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    model: str = "smollm2"
    corpus: str = "server"  # "server" (a python -m corpus_service subprocess), "local", or HOST:PORT
    prompts: int = 4
    max_tokens: int = 32
    budget: str = "auto"  # or a fixed node count; "auto" may rightly not draft on a busy CPU
    max_budget: int = 7
    data_dir: str = ""  # default $NGRAM_SHARED_DATA or ../shared/data next to the repository

    def __post_init__(self) -> None:
        if not 1 <= self.prompts <= 64 or not 1 <= self.max_tokens <= 1024:
            raise ValueError(f"prompts must be 1..64 and max_tokens 1..1024, got {self.prompts}, {self.max_tokens}")
        if self.budget != "auto" and not self.budget.isdigit():
            raise ValueError(f"budget: expected 'auto' or an int, got {self.budget!r}")


def _data_dir(cfg: DemoConfig) -> Path:
    if cfg.data_dir:
        return Path(cfg.data_dir)
    env = os.environ.get("NGRAM_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


# The sampled traces shipped with the repository (bench/data): the same HumanEval and Spec-Bench
# prompts, four samples each, for a machine without the shared data folder.
_SHIPPED = Path(__file__).resolve().parents[1] / "bench" / "data" / "traces"


def demo_prompts(cfg: DemoConfig, codec) -> tuple[list[list[int]], str]:
    """Alternates HumanEval and Spec-Bench prompts from the traces (their exact prompt ids): the
    shared data's greedy traces, else the repository's sampled ones, else built-in prompts (on
    which short greedy outputs may accept no draft at all)."""
    traces = _data_dir(cfg) / "traces"
    for folder, names in ((traces, ("humaneval164_greedy.jsonl", "specbench_dev120_greedy.jsonl")),
                          (_SHIPPED, ("humaneval164_t07x4.jsonl", "specbench_dev120_t07x4.jsonl"))):
        files = [folder / n for n in names]
        if all(f.is_file() for f in files):
            rows = []
            for f in files:
                seen: dict[tuple[int, ...], None] = {}  # each prompt once, in file order
                for line in f.open():
                    seen.setdefault(tuple(json.loads(line)["prompt_ids"]), None)
                rows.append([list(p) for p in seen])
            picked = [rows[i % 2][i // 2] for i in range(cfg.prompts)]
            return picked, str(folder)
    texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(cfg.prompts)]
    return [codec.encode(codec.apply_chat_template([{"role": "user", "content": t}])) for t in texts], "built-in prompts"


def _start_server(tmp: str):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import subprocess

    ports = Path(tmp) / "ports.json"
    log = open(Path(tmp) / "corpus.log", "wb")
    cmd = [sys.executable, "-m", "corpus_service", "serve", "--host", "127.0.0.1", "--grpc-port", "0",
           "--admin-port", "-1", "--ports-file", str(ports), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ports.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the corpus server did not start: {(Path(tmp) / 'corpus.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads(ports.read_text())['grpc_port']}"


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int):
    """One request at a time (batch 1): tokens/s, outputs, verify steps, accepted draft tokens."""
    outs, steps, accepted, tokens = [], 0, 0, 0
    t = time.perf_counter()
    for p in prompts:
        (req,) = engine.generate([p], SamplingParams(max_tokens=max_tokens))
        outs.append(req.output_ids)
        steps, accepted, tokens = steps + req.verify_steps, accepted + req.accepted_tokens, tokens + len(req.output_ids)
    return tokens / (time.perf_counter() - t), outs, steps, accepted, tokens


def run_demo(cfg: DemoConfig) -> int:
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    lm = load_model(cfg.model)
    print(f"model {lm.name}: {lm.model.config.num_params / 1e6:.0f}M parameters, float32 on cpu "
          f"(loaded in {time.perf_counter() - t0:.1f}s)")
    prompts, source = demo_prompts(cfg, lm.codec)
    print(f"{len(prompts)} prompts from {source}, {cfg.max_tokens} new tokens each, batch 1, greedy, "
          f"draft budget {cfg.budget}")
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        target = cfg.corpus
        if cfg.corpus == "server":
            proc, target = _start_server(tmp)
            print(f"corpus: python -m corpus_service serve on {target} (pid {proc.pid})")
        try:
            max_len = max(map(len, prompts)) + cfg.max_tokens + cfg.max_budget + 2
            plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=1, max_len=max_len, budget=0))
            tps0, outs0, _, _, n0 = _run(plain, prompts, cfg.max_tokens)
            print(f"plain decoding:        {tps0:6.2f} tok/s ({n0} tokens)")
            drafter = Drafter(target, vocab_size=lm.model.config.vocab_size, draft_timeout_s=0.5)
            budget = None if cfg.budget == "auto" else int(cfg.budget)
            spec = Engine(lm.model, lm.codec, drafter,
                          EngineConfig(max_batch=1, max_len=max_len, budget=budget, max_budget=cfg.max_budget, cost_probe_s=5.0))
            tps1, outs1, steps, acc, n1 = _run(spec, prompts, cfg.max_tokens)
            d = drafter.stats
            print(f"speculative decoding:  {tps1:6.2f} tok/s ({n1} tokens, {steps} verify steps, {acc} draft tokens "
                  f"accepted; drafts: {d.remote_steps} remote, {d.local_steps} local, {d.fallback_steps} fallback)")
            if drafter.remote:
                print(f"remote asks: {d.asks} sent, {d.asks_skipped} skipped (no measured gain); accepted tokens "
                      f"only the remote corpus drafted: {d.remote_gain_tokens}")
            if spec.policy.cost is not None:
                c = spec.policy.cost
                print("cost model (tokens in batch -> ms): "
                      + ", ".join(f"{t}: {s * 1e3:.0f}" for t, s in zip(c.tokens, c.seconds)))
            same = outs0 == outs1
            print(f"MAT (tokens per verify step): {n1 / max(steps, 1):.2f}   speed-up: {tps1 / tps0:.2f}x   "
                  f"outputs identical: {'yes' if same else 'NO'}")
            drafter.close()
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    return 0 if same else 1
