"""Offline rollouts in process, in the spirit of vLLM's ``LLM.generate``: every prompt's ``n``
samples are queued at once and the engine batches them (continuous batching over its KV-cache
slots), drafting from the corpus; each sample has its own seed stream.

    from verifier import LLM, SamplingParams
    llm = LLM(model="smollm2", corpus="local")                  # or corpus="HOST:PORT", device="cuda", ...
    outs = llm.generate(["Write a haiku."], SamplingParams(n=8, temperature=0.7, max_tokens=256, seed=0))
    outs[0].outputs[3].token_ids, outs[0].outputs[3].logprobs    # sample 3 of prompt 0
    llm.last_run.makespan_s                                      # time until the batch's last sample ended

Seeds: sample s of prompt p (of ``len(prompts)`` prompts, n samples each) draws from
``seed + p * n + s`` (mod 2**63), so every sample is a different draw and a run is reproducible (the
OpenAI route's n samples use ``seed + s`` alike); no seed: random ones. Speculation is lossless:
each sample has the distribution plain sampling gives it (tests/verifier/engine/test_lossless_sampling.py).

Prompt history: each sample starts with its prompt's key (``prompt_keys[p]``, else the corpus'
default, a hash of the prompt ids) and ``policy_version``; the n samples of a prompt draft from each
other as they run, and from the key's earlier rollouts (earlier calls, earlier epochs).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from corpus_service import check_prompt_key, default_prompt_key

from ..config import VerifierConfig
from ..engine.request import Request
from ..model.loader import LoadedModel
from ..step import sampling
from .prompts import encode_prompt

log = logging.getLogger(__name__)

MAX_SAMPLES_PER_PROMPT = 4096
_runs = itertools.count()  # generate() calls: their group names differ


@dataclass(frozen=True, slots=True)
class SamplingParams(sampling.SamplingParams):
    """The engine's sampling parameters plus ``n``: samples per prompt."""

    n: int = 1

    def __post_init__(self) -> None:
        sampling.SamplingParams.__post_init__(self)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES_PER_PROMPT:
            raise ValueError(f"n: expected an int in [1, {MAX_SAMPLES_PER_PROMPT}], got {self.n!r}")


@dataclass
class CompletionOutput:
    index: int  # the sample's index among its prompt's n
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    logprobs: list[float] | None  # each token's logprob under the sampling distribution (params.logprobs set)
    cumulative_logprob: float | None
    seed: int | None
    accepted_draft_tokens: int = 0
    verify_steps: int = 0


@dataclass
class RequestOutput:
    prompt_index: int
    prompt_token_ids: list[int]
    prompt_key: str  # the key its samples carry (the default key where none was given)
    policy_version: int | None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return True


@dataclass
class RunSummary:
    """One ``generate`` call: its batch's makespan and throughput."""

    prompts: int = 0
    completions: int = 0
    output_tokens: int = 0
    makespan_s: float = 0.0  # from the call's start until its last sample ended
    mean_completion_s: float = 0.0  # a sample's mean time from the call's start to its end
    verify_steps: int = 0
    accepted_draft_tokens: int = 0
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per verify step (MAT): 1 + accepted drafts per step."""
        return (self.verify_steps + self.accepted_draft_tokens) / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(tokens_per_s=round(self.tokens_per_s, 2), mean_accepted_tokens=round(self.mean_accepted_tokens, 4))
        return d


class LLM:
    """A verifier engine in this process. ``model``, ``corpus`` and every other keyword are
    ``VerifierConfig`` fields (``device``, ``dtype``, ``max_batch``, ``max_len``, ``budget``,
    ``max_budget``, ``weight_noise_sigma``, ``weight_noise_seed``, ``tail_requests``, ...); the HTTP
    fields are unused. Defaults here suit a batch: ``max_batch`` 32, the tail rule on
    (verifier/budget/makespan.py)."""

    def __init__(self, model: str = "smollm2", corpus: str = "local", *, loaded: LoadedModel | None = None,
                 **config: Any) -> None:
        """``loaded``: the model already loaded (``verifier.model.load_model``) as the config says."""
        from ..service import build_verifier

        config.setdefault("max_batch", 32)
        config.setdefault("tail_requests", max(1, config["max_batch"] // 8))
        self.config = VerifierConfig(model=model, corpus=corpus, **config)
        self.verifier = build_verifier(self.config, loaded)
        self.engine = self.verifier.engine
        self.last_run = RunSummary()

    def close(self) -> None:
        if self.engine.drafter is not None:
            self.engine.drafter.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: Any, where: str = "prompt") -> list[int]:
        """A prompt's token ids: text, token ids, or an object with prompt / prompt_ids / messages."""
        return encode_prompt(prompt, self.engine.codec, self.engine.model.config.vocab_size, where)

    def generate(self, prompts: Any | Sequence[Any], params: SamplingParams | None = None, *,
                 prompt_keys: Sequence[str | None] | None = None, policy_version: int | None = None,
                 use_tqdm: bool = True, on_done: Callable[[int, CompletionOutput], None] | None = None,
                 ) -> list[RequestOutput]:
        """Samples ``params.n`` completions of every prompt; returns one RequestOutput per prompt, in
        order. ``on_done(prompt_index, output)`` is called as each sample ends (the CLI writes it).
        ValueError for a bad prompt, key or parameter (before anything runs)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):  # the engine's own class: one sample each
            params = SamplingParams(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if prompt_keys is not None and len(prompt_keys) != len(prompts):
            raise ValueError(f"prompt_keys: expected one per prompt ({len(prompts)}), got {len(prompt_keys)}")
        keys = [None] * len(prompts) if prompt_keys is None else [check_prompt_key(k) for k in prompt_keys]
        ids = [self.encode(p, f"prompt {i}") for i, p in enumerate(prompts)]
        outs = [RequestOutput(i, p, keys[i] or default_prompt_key(p), policy_version) for i, p in enumerate(ids)]
        engine, n = self.engine, params.n
        want_lp = params.logprobs is not None
        reqs: list[tuple[int, int, Request]] = []
        run = next(_runs)
        t0 = time.monotonic()
        try:
            for i, p in enumerate(ids):
                # An explicit key groups its live requests in the corpus; the default key does not,
                # so the n samples of a prompt without one form a group of their own.
                group = None if keys[i] is not None else f"gen-{run}-{i}"
                for s in range(n):
                    sp = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i * n + s) % 2**63)
                    reqs.append((i, s, engine.add_request(p, sp, group=group if n > 1 else None, prompt_key=keys[i],
                                                          policy_version=policy_version)))
        except ValueError:
            for *_, r in reqs:
                engine.abort(r.req_id)
            while engine.has_work():
                engine.step()
            raise
        summary = RunSummary(prompts=len(prompts), completions=len(reqs))
        bar = _progress(len(reqs), use_tqdm)
        pending = {r.req_id: (i, s, r) for i, s, r in reqs}
        ends = []
        try:
            while pending:
                for done in engine.step():  # the requests that got tokens or finished
                    if not done.finished or done.req_id not in pending:
                        continue
                    i, s, r = pending.pop(done.req_id)
                    ends.append(time.monotonic() - t0)
                    out = CompletionOutput(
                        s, list(r.output_ids), r.text, r.finish_reason or "error",
                        [t.logprob for t in r.logprobs] if want_lp else None,
                        r.cumulative_logprob if want_lp else None, r.params.seed, r.accepted_tokens, r.verify_steps)
                    outs[i].outputs.append(out)
                    summary.output_tokens += len(r.output_ids)
                    summary.verify_steps += r.verify_steps
                    summary.accepted_draft_tokens += r.accepted_tokens
                    summary.errors += r.finish_reason == "error"
                    if on_done is not None:
                        on_done(i, out)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{summary.output_tokens / max(1e-9, time.monotonic() - t0):.0f}",
                                        refresh=False)
        finally:
            if bar is not None:
                bar.close()
            for _, _, r in pending.values():  # interrupted: nothing is left running
                engine.abort(r.req_id)
            if pending:
                while engine.has_work():
                    engine.step()
        summary.makespan_s = max(ends, default=0.0)
        summary.mean_completion_s = sum(ends) / len(ends) if ends else 0.0
        self.last_run = summary
        for o in outs:
            o.outputs.sort(key=lambda c: c.index)
        return outs


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="rollouts", smoothing=0.1)
