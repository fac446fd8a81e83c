"""``ngram-verifier demo``: a corpus and a verifier on the CPU with the real SmolLM2 model.

Runs a few real prompts (the chat-templated prompts of ``$NGRAM_SHARED_DATA/traces`` when that
folder exists, else of the repository's ``bench/data/traces``, else built-in prompts) one at a
time, each with plain greedy decoding and speculatively with drafts from the corpus (the two
engines' steps alternating, so that other processes' load falls on both), and prints tokens/s of
both, the accepted draft tokens, the acceptance (MAT: tokens committed per verify step), the
speed-up where drafts were accepted (none is reported where none was: the ratio would be noise),
what the budget policy did, and whether the outputs are token-identical (exit status 1 if not).
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

from .config import flag
from .draft.config import DraftConfig
from .draft.drafter import Drafter
from .engine.core import Engine, EngineConfig
from .model import load_model
from .step.sampling import SamplingParams

BUILTIN_PROMPTS = [
    "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number, with a docstring and an example.",
    "Explain in three sentences why the sky is blue.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "List five tips for writing clear technical documentation.",
]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    model: str = flag("smollm2", "the target model", "a .gguf file, a HF safetensors directory, or 'smollm2'")
    corpus: str = flag("server", "where drafts come from", "'server' (a python -m corpus_service subprocess on "
                       "127.0.0.1), 'local' (in process) or HOST:PORT of a running corpus service")
    prompts: int = flag(6, "prompts run (HumanEval and Spec-Bench alternately)", "an int 1..64")
    max_tokens: int = flag(32, "new tokens per prompt", "an int 1..1024")
    budget: str = flag("auto", "draft nodes per request and step", "'auto' (the adaptive policy, as the verifier's "
                       "default) or an int 0..--max-budget")
    max_budget: int = flag(7, "the most draft nodes per request and step", "an int 1..63")
    data_dir: str = flag("", "the shared data folder with traces/", "a path; '' = $NGRAM_SHARED_DATA or "
                         "../shared/data next to the repository, else the repository's bench/data")

    def __post_init__(self) -> None:
        if not 1 <= self.prompts <= 64 or not 1 <= self.max_tokens <= 1024:
            raise ValueError(f"prompts must be 1..64 and max_tokens 1..1024, got {self.prompts}, {self.max_tokens}")
        if self.budget != "auto" and not self.budget.isdigit():
            raise ValueError(f"budget: expected 'auto' or an int, got {self.budget!r}")
        if not 1 <= self.max_budget <= 63 or (self.budget != "auto" and int(self.budget) > self.max_budget):
            raise ValueError(f"max_budget: expected 1..63 and >= budget, got {self.max_budget} (budget {self.budget})")


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
           "--admin-port", "-1", "--ports-file", str(ports), "--log-level", "WARNING",
           "--data-dir", ""]  # a throwaway corpus: nothing kept, the user's data directory left alone
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ports.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the corpus server did not start: {(Path(tmp) / 'corpus.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads(ports.read_text())['grpc_port']}"


@dataclass
class Tally:
    """One mode's totals over the prompts."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0  # verify steps
    accepted: int = 0  # draft tokens accepted (and committed)
    verified: int = 0  # steps that verified draft tokens (a tree of at least one node)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mat(self) -> float:
        return self.tokens / max(self.steps, 1)


def run_interleaved(plain: Engine, spec: Engine, prompts: list[list[int]], max_tokens: int):
    """Each prompt with both engines, one request at a time (batch 1), their steps alternating
    (plain, speculative, plain, ...; the speculative one first on odd prompts), each step timed on
    its own: a slow spell of the machine (other processes) falls on both modes alike, where two runs
    one after the other would hand it to one of them. Returns both tallies and outputs."""
    tallies = (Tally(), Tally())
    outs: tuple[list, list] = ([], [])
    params = SamplingParams(max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        reqs = (plain.add_request(prompt, params), spec.add_request(prompt, params))
        order = (0, 1) if i % 2 == 0 else (1, 0)
        while not all(r.finished for r in reqs):
            for m in order:
                if not reqs[m].finished:
                    t = time.perf_counter()
                    (plain, spec)[m].step()
                    tallies[m].seconds += time.perf_counter() - t
        for m, req in enumerate(reqs):
            tallies[m].tokens += len(req.output_ids)
            tallies[m].steps += req.verify_steps
            tallies[m].accepted += req.accepted_tokens
            tallies[m].verified += req.spec_steps
            outs[m].append(req.output_ids)
    return tallies[0], tallies[1], outs[0], outs[1]


def _ms(cost) -> str:
    return ", ".join(f"{t}: {x * 1e3:.0f}" for t, x in zip(cost.tokens, cost.seconds))


def steps_line(s: Tally, spec: Engine) -> str:
    """The speculative engine's steps in one sentence, each count a part of the one before: the
    steps, those that asked the corpus for a draft tree (the budget policy skips drafting on the
    others), and those that verified draft tokens (the rest got an empty tree, or one with no node
    the policy found worth verifying)."""
    d = spec.drafter.stats if spec.drafter is not None else None
    asked = d.remote_steps + d.local_steps + d.fallback_steps if d is not None else 0
    where = (f" ({d.remote_steps} remote, {d.local_steps} in process, {d.fallback_steps} in-process fallback)"
             if d is not None else "")
    return (f"steps:                 {s.steps} verify steps; {asked} asked the corpus for a draft tree{where}, "
            f"{max(s.steps - asked, 0)} did not (the budget policy decoded plainly); {s.verified} of the {asked} "
            f"verified draft tokens (the other {max(asked - s.verified, 0)}: an empty tree or no node worth verifying)")


def explain(p: Tally, s: Tally, spec: Engine) -> list[str]:
    """The figures and what they mean: tokens/s of both modes, the steps (drafted, verified), the
    accepted draft tokens, MAT, the speed-up (only where drafts were accepted: otherwise both runs
    decoded alike and a ratio is noise), and what the budget policy did."""
    lines = [f"plain decoding:        {p.tok_s:7.2f} tok/s ({p.tokens} tokens in {p.seconds:.2f} s, "
             f"{p.steps} steps)",
             f"speculative decoding:  {s.tok_s:7.2f} tok/s ({s.tokens} tokens in {s.seconds:.2f} s, "
             f"{s.steps} verify steps)",
             steps_line(s, spec),
             f"accepted drafts:       {s.accepted} of {s.tokens} tokens came from accepted draft tokens; MAT "
             f"{s.mat:.2f} tokens per verify step (plain decoding: {p.mat:.2f})"]
    if s.accepted == 0:
        lines.append("speed-up:              none to report: no draft token was accepted, so both runs decoded "
                     "token by token and their tokens/s differ only by noise")
    else:
        ratio = s.tok_s / p.tok_s if p.tok_s > 0 else 0.0
        # tok/s = tokens / steps / (seconds per step): the ratio is fewer steps (the accepted
        # drafts) times the ratio of step times (drafting's cost, and the machine's noise).
        fewer = s.mat / p.mat if p.mat > 0 else 0.0
        step_ratio = (s.seconds / max(s.steps, 1)) / (p.seconds / max(p.steps, 1)) if p.seconds > 0 else 0.0
        why = ("drafting saved more steps than it cost" if ratio > 1.0 else
               "drafting cost more time than its accepted tokens saved on this machine now")
        lines.append(f"speed-up:              {ratio:.2f}x = speculative tok/s / plain tok/s over the same prompts, "
                     f"the two engines' steps alternating ({why}): {fewer:.2f}x fewer steps, each "
                     f"{step_ratio:.2f}x as long as a plain step")
    pol, st = spec.policy, spec.stats
    if pol.fixed is None:
        b = st.budget
        lines.append(f"budget policy:         adaptive; switches to plain "
                     f"decoding: {b.plain_switches_cost} by the cost model, {b.plain_switches_delivered} because "
                     f"drafting delivered less, {b.plain_switches_nothing} with nothing to draft"
                     + (f", {b.plain_switches_critical} for the request expected to end last"
                        if b.plain_switches_critical else ""))
        c = pol.cost
        lines.append(f"cost model (tokens in batch -> ms): probed {', '.join(f'{t}: {x * 1e3:.0f}' for t, x in zip(c.tokens, c.probed))}; "
                     f"now {_ms(c)} (from {c.observations} steps)")
    else:
        lines.append(f"budget policy:         fixed, {pol.fixed} draft nodes per step")
    return lines


def _warm_up(engine: Engine, codec) -> None:
    """First calls pay one-time costs (allocations, kernel choices); a built-in prompt, not one of
    the demo's, takes them."""
    ids = codec.encode(codec.apply_chat_template([{"role": "user", "content": BUILTIN_PROMPTS[1]}]))
    engine.generate([ids], SamplingParams(max_tokens=2))


def run_demo(cfg: DemoConfig) -> int:
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    lm = load_model(cfg.model)
    print(f"model {lm.name}: {lm.model.config.num_params / 1e6:.0f}M parameters, float32 on cpu "
          f"(loaded in {time.perf_counter() - t0:.1f}s)")
    prompts, source = demo_prompts(cfg, lm.codec)
    print(f"{len(prompts)} prompts from {source}, {cfg.max_tokens} new tokens each, batch 1, greedy, "
          f"draft budget {cfg.budget} (at most {cfg.max_budget} nodes)")
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        target = cfg.corpus
        if cfg.corpus == "server":
            proc, target = _start_server(tmp)
            print(f"corpus: python -m corpus_service serve on {target} (pid {proc.pid})")
        drafter = None
        try:
            max_len = max(map(len, prompts)) + cfg.max_tokens + cfg.max_budget + 2
            max_len = max(max_len, 256)  # the warm-up prompt
            plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=1, max_len=max_len, budget=0))
            drafter = Drafter(target, DraftConfig(draft_timeout_s=0.5), vocab_size=lm.model.config.vocab_size)
            budget = None if cfg.budget == "auto" else int(cfg.budget)
            spec = Engine(lm.model, lm.codec, drafter,
                          EngineConfig(max_batch=1, max_len=max_len, budget=budget, max_budget=cfg.max_budget, cost_probe_s=5.0))
            _warm_up(plain, lm.codec)
            p, s, outs0, outs1 = run_interleaved(plain, spec, prompts, cfg.max_tokens)
            for line in explain(p, s, spec):
                print(line)
            d = drafter.stats
            if drafter.remote:  # asks: what the verifier sent the remote corpus, one step ahead of its trees
                print(f"remote corpus:         {d.asks} asks sent, {d.asks_skipped} skipped (no measured gain); "
                      f"accepted tokens only its trees drafted: {d.remote_gain_tokens}")
            same = outs0 == outs1
            print(f"outputs identical:     {'yes' if same else 'NO'}")
        finally:
            if drafter is not None:
                drafter.close()
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    return 0 if same else 1
