"""The speculative decoding engine: continuous batching over a preallocated KV cache; each step
drafts trees from the corpus, verifies them in one forward, commits the accepted path plus one
bonus token, and streams the committed tokens back to the corpus.

Plain decoding is the same step with no draft nodes (K = 1), so speculative and plain greedy run
the same code and produce the same tokens.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from corpus_service import check_policy_version, check_prompt_key

from .. import kernels
from ..budget.cost_probe import measure_cost_model
from ..budget.makespan import MakespanClock, MakespanConfig, critical_acceptance, expected_length
from ..budget.policy import BudgetPolicy, BudgetStats, CostModel
from ..draft.drafter import Drafter
from ..model import ForwardBatch, KVCache, TextCodec, Transformer
from ..model import fusion
from ..step import _native
from ..step.cuda_graphs import (GraphRunner, GreedyStepResult, StepForward, StepInput, StepLaunch, forward_part,
                                 greedy_tail, keep_accepted, probe_native_linear)
from ..step.grammar import GrammarCompiler, finish_if_complete, mask_logits, settle
from ..step.logprobs import row_logprobs
from ..step.numerics import error_message, nonfinite_rows
from ..step.penalties import needs_processing, process_logits
from ..step.sampling import SamplingParams, sample, target_probs
from ..step.tree_batch import PackedTrees
from .request import CoinStream, Request, Status, append_run, append_tokens, stop_tokens
from .scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch: int = 8  # KV-cache slots = requests decoded together
    max_len: int = 2048  # tokens per request (prompt + output + draft nodes)
    budget: int | None = None  # draft nodes per request; None = adaptive (cost model + acceptance)
    max_budget: int = 15
    # Verifier processes sharing this GPU (MPS or time-sliced; verifier/budget/policy.py, gpu_share).
    gpu_share: int = 1
    cost_probe_s: float = 10.0  # start-up time allowed for measuring the cost model
    cuda_graphs: bool = True  # replay captured graphs for decode/verify steps (CUDA only)
    compile: bool = True  # torch.compile the layers' elementwise ops into fused kernels (CUDA only)
    capture_at_start: bool = True  # capture the greedy-step and forward graphs of every bucket at start-up (CUDA graphs)
    prefill_tokens: int = 8192  # prompt tokens (padding included) per batched prefill forward
    emulate_graphs: bool = False  # tests: the graph path (padded buckets, one-graph greedy step) run eagerly on any device
    # Steps through kernels.norm_linear (norms and SwiGLU fused into the matmuls), where every step
    # fits it (max_batch * (max_budget + 1) <= kernels.NORM_LINEAR_MAX_ROWS): "auto" = whichever
    # replays a decode step faster, timed at start-up (CUDA graphs; it wins on a small model, whose
    # steps are bound by kernel count, and can lose to cuBLAS on a large one); "on"; "off".
    native_linear: str = "auto"
    # Waiting requests join a running batch once this many slots are free (or all fit), or after
    # scheduler.MAX_REFILL_WAIT_STEPS steps: fewer prefill forwards (verifier/engine/scheduler.py).
    # 0 = max_batch // 8 (at least 1: every refill at once up to batch 15).
    refill_group: int = 0
    # Plain decoding (no drafter) launches each step before committing the previous one's tokens:
    # the next step's input tokens come from the previous step's predictions on the device, so the
    # host's per-step work (commits, stops, streaming) overlaps the GPU's instead of adding to it.
    # Applies to greedy steps replayed as graphs (no penalties, grammars or logprobs). Measured on
    # the H200 (SmolLM2, docs/history/2026-12.md): plain decoding 895 -> 1,024 tok/s at batch 1, 8% faster
    # at batch 8 and 64; outputs are identical (tests/verifier/engine/test_overlap_plain.py).
    overlap_plain: bool = True
    # The same for a speculative engine's plain steps (the budget policy drafts nothing that step:
    # large batches, or drafting that does not pay); a drafting step first commits the step in
    # flight, and its tokens count as plain decoding's in the policy. Measured on the H200
    # (docs/history/2026-12.md): plain steps of a speculative engine at batch 1 delivered 943 tok/s
    # instead of 858, speculation at batch 8 with 64 new tokens 1.04x -> 1.15x plain.
    overlap_spec_plain: bool = True
    # Batches that end together (RL rollouts): deeper drafts in the batch's tail, longest expected
    # requests admitted first, from the corpus' prompt history (verifier/budget/makespan.py). Off by default.
    makespan: MakespanConfig = MakespanConfig()

    @property
    def refill_slots(self) -> int:
        return self.refill_group or max(1, self.max_batch // 8)

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 4096:
            raise ValueError(f"max_batch: expected 1..4096, got {self.max_batch}")
        if not 16 <= self.max_len <= 1 << 20:
            raise ValueError(f"max_len: expected 16..2^20, got {self.max_len}")
        if not 1 <= self.max_budget <= kernels.MAX_NODES - 1:
            raise ValueError(f"max_budget: expected 1..{kernels.MAX_NODES - 1}, got {self.max_budget}")
        if isinstance(self.gpu_share, bool) or not isinstance(self.gpu_share, int) or not 1 <= self.gpu_share <= 64:
            raise ValueError(f"gpu_share: expected an int 1..64, got {self.gpu_share!r}")
        if not 1 <= self.prefill_tokens <= 1 << 20:
            raise ValueError(f"prefill_tokens: expected 1..2^20, got {self.prefill_tokens}")
        if not 0 <= self.refill_group <= self.max_batch:
            raise ValueError(f"refill_group: expected 0 (auto) or 1..max_batch ({self.max_batch}), got {self.refill_group}")
        if self.native_linear not in ("auto", "on", "off"):
            raise ValueError(f"native_linear: expected 'auto', 'on' or 'off', got {self.native_linear!r}")
        if not isinstance(self.makespan, MakespanConfig):
            raise ValueError(f"makespan: expected a MakespanConfig, got {type(self.makespan).__name__}")
        if self.makespan.tail_budget > self.max_budget:
            raise ValueError(f"tail_budget: expected 0..max_budget ({self.max_budget}), got {self.makespan.tail_budget}")
        if self.budget is not None and not 0 <= self.budget <= self.max_budget:
            raise ValueError(f"budget: expected 0..max_budget ({self.max_budget}) or None (adaptive), got {self.budget}")




@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0  # wall time of step(), prefills included
    prefills: int = 0  # prefill forwards (a batch of prompts admitted together is one)
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0  # draft nodes verified
    accepted_tokens: int = 0
    spec_steps: int = 0  # request-steps that verified at least one draft node
    # Host time of the engine thread in drafter calls (drafts, commits, hand-offs to a remote
    # client): what the corpus costs a step beyond the GPU's work.
    corpus_seconds: float = 0.0
    # Verify steps' phases on the host (bench/e2e.py reports them): choosing, pruning and packing
    # the drafts (drafting included), the forward call (launch, the corpus hand-off while the GPU
    # runs, the wait for its results), and committing the accepted tokens.
    pack_seconds: float = 0.0
    forward_seconds: float = 0.0
    commit_seconds: float = 0.0
    # The adaptive budget's switches to plain decoding by reason, and its cost model's refreshes
    # (verifier/budget/policy.py): the policy's own counters, shared.
    budget: BudgetStats = field(default_factory=BudgetStats)


@dataclass
class _Inflight:
    """An overlapped plain step launched on the device whose tokens are not committed yet."""

    reqs: list[Request]
    launch: StepLaunch
    prefix: list[int]  # each request's root row (cache_len as of the step)


def prefill_chunks(reqs: list[Request], max_tokens: int) -> list[list[Request]]:
    """Admitted requests grouped for batched prefill: by prompt length, so that each group's
    padded size (count x longest) stays within ``max_tokens`` (a longer prompt goes alone) and
    padding adds at most a quarter to the real tokens."""
    out: list[list[Request]] = []
    group: list[Request] = []
    real = 0
    for r in sorted(reqs, key=lambda r: len(r.prompt_ids)):
        n = len(r.prompt_ids)  # the longest so far (sorted)
        if group and ((len(group) + 1) * n > max_tokens or (len(group) + 1) * n > 1.25 * (real + n)):
            out.append(group)
            group, real = [], 0
        group.append(r)
        real += n
    if group:
        out.append(group)
    return out


def graph_prefill_chunks(reqs: list[Request], graphs: GraphRunner, max_tokens: int) -> list[list[Request]]:
    """Admitted requests grouped for prefill graphs: by length bucket, as many per group as one
    graph of that bucket takes (``GraphRunner.max_prefill_prompts``); prompts longer than the
    largest bucket are grouped for eager prefill (``prefill_chunks``)."""
    by_bucket: dict[int, list[Request]] = {}
    eager: list[Request] = []
    for r in reqs:
        Tb = graphs.prefill_bucket(len(r.prompt_ids))
        if Tb is None:
            eager.append(r)
        else:
            by_bucket.setdefault(Tb, []).append(r)
    out: list[list[Request]] = []
    for Tb, group in sorted(by_bucket.items()):
        n = graphs.max_prefill_prompts(Tb)
        out.extend(group[i:i + n] for i in range(0, len(group), n))
    return out + prefill_chunks(eager, max_tokens)


class Engine:
    def __init__(self, model: Transformer, codec: TextCodec, drafter: Drafter | None,
                 config: EngineConfig = EngineConfig(), cost: CostModel | None = None) -> None:
        self.model, self.codec, self.drafter, self.config = model, codec, drafter, config
        mc = model.config
        self.device = model.device
        on_cuda = self.device.type == "cuda"
        use_graphs = (config.cuda_graphs and on_cuda) or config.emulate_graphs
        # With graphs, one extra slot takes the K/V of the padding rows of a batch bucket.
        self.cache = KVCache(mc.num_layers, config.max_batch + use_graphs, config.max_len, mc.num_kv_heads,
                             mc.head_dim, self.device, model.dtype)
        self.graphs = None
        if use_graphs:
            self.graphs = GraphRunner(model, self.cache, config.max_batch, config.max_batch,
                                      max_nodes=config.max_budget + 1, capture=on_cuda and config.cuda_graphs,
                                      prefill_tokens=config.prefill_tokens)
        if config.compile and on_cuda:
            self._compile_fusions()
        self.linear_probe: dict[str, float] | None = None
        # A token must compute the same in every step of this engine (plain or verify, alone or in
        # a batch: greedy speculative output equals plain decoding), so either every step's shape
        # fits kernels.norm_linear or no step uses it.
        every_step_fits = config.max_batch * (config.max_budget + 1) <= kernels.NORM_LINEAR_MAX_ROWS
        if config.native_linear == "off" or not every_step_fits:
            model.native_linear = False
        elif config.native_linear == "on" or not (self.graphs is not None and self.graphs.capture):
            model.native_linear = True
        else:
            self.linear_probe = probe_native_linear(model, self.cache, self.graphs.scratch)
            log.info("decode step with kernels.norm_linear %.3f ms, with torch's matmuls %.3f ms: %s",
                     self.linear_probe["native_ms"], self.linear_probe["torch_ms"],
                     "native" if model.native_linear else "torch")
        if self.graphs is not None and self.graphs.capture and config.capture_at_start:
            t = time.perf_counter()
            buckets = None if drafter is not None else (1,)
            n = self.graphs.capture_greedy_steps(buckets)
            n += self.graphs.capture_forward_steps(buckets)  # sampled and processed steps
            n += self.graphs.capture_prefills()
            log.info("captured %d greedy-step, forward and prefill graphs in %.1f s", n, time.perf_counter() - t)
        self.scheduler = Scheduler(config.max_batch, config.refill_slots,
                                   longest_first=config.makespan.longest_first and drafter is not None)
        self.makespan = MakespanClock()
        self.eos_ids = tuple(codec.eos_token_ids or mc.eos_token_ids)
        self._stop_sets: dict[tuple, frozenset[int]] = {}  # (ignore_eos, stop_token_ids) -> stop_tokens
        self.grammars = GrammarCompiler(codec.tokenizer, mc.vocab_size, self.eos_ids)  # lazy: structured output
        fixed = 0 if drafter is None else config.budget
        if fixed is None and cost is None:
            cost = measure_cost_model(model, self.cache, config.max_batch, config.max_budget + 1,
                                      time_budget_s=config.cost_probe_s,
                                      forward=None if self.graphs is None else self.graphs.forward_step)
        self.policy = BudgetPolicy(config.max_budget, fixed, cost)
        self.policy.gpu_share = config.gpu_share
        if self.graphs is not None:
            self.policy.node_bucket = lambda k: self.graphs.nodes_bucket(k, config.max_len)
        if self.graphs is not None and config.overlap_plain and config.overlap_spec_plain:
            # Plain steps run overlapped (one step ahead of the host): the policy explores them in
            # runs, whose steady state it can see (BudgetPolicy.explore_run).
            self.policy.explore_run = 3
        self.stats = EngineStats(budget=self.policy.stats)
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._live: dict[str, Request] = {}
        self._extends: list[tuple[str, list[int]]] = []  # this step's committed tokens for the drafter
        self._drafted = False  # whether this step asked the corpus for drafts (BudgetPolicy.observe_delivered)
        self._budget_now: tuple[int, int] | None = None  # (batch size, budget) decided by _overlaps
        self._committed_launched = 0  # requests the last committed overlapped step gave a token
        self._inflight: _Inflight | None = None  # overlap_plain: the step launched ahead of the host

    def _compile_fusions(self) -> None:
        """Compiles the layers' elementwise ops (verifier.model.fusion) for every shape class a
        step can bring (inductor specializes sizes 0 and 1: batch 1 or more, one token or more,
        causal prefill or masked verify), so no compilation lands inside a request's step. The
        forwards write into a slot no request owns yet; the model stays eager if any fails."""
        if not fusion.enable_compile():
            return
        dev = self.device
        slot = self.config.max_batch if self.graphs is not None else 0
        t = time.perf_counter()
        try:
            for bs, T, masked in itertools.product((1, 2), (1, 4), (False, True)):
                rows = torch.arange(T, device=dev).expand(bs, T)
                mask = torch.ones(bs, T, T, dtype=torch.bool, device=dev).tril() if masked else None
                self.model(torch.zeros(bs, T, dtype=torch.int64, device=dev), self.cache,
                           ForwardBatch(rows, rows, torch.full((bs,), slot, device=dev), T, mask),
                           last_index=None if masked else torch.full((bs,), T - 1, device=dev))
        except Exception as e:  # noqa: BLE001  (inductor/triton failures vary by machine)
            log.warning("torch.compile of the elementwise ops failed, running them eagerly: %s", e)
            fusion.disable_compile()
        else:
            log.info("compiled the elementwise ops in %.1f s", time.perf_counter() - t)
        self.cache.clear(slot)

    # ------------------------------------------------------------------ requests (thread-safe)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, req_id: str | None = None,
                    on_update=None, group: str | None = None, prompt_key: str | None = None,
                    policy_version: int | None = None) -> Request:
        """Validates and queues a request; ValueError says what is wrong with it. ``prompt_key`` and
        ``policy_version`` go to the corpus with the request (its prompt history)."""
        try:
            prompt_key, version = check_prompt_key(prompt_key), check_policy_version(policy_version)
        except TypeError as e:
            raise ValueError(str(e)) from None
        policy_version = None if version < 0 else version
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt: expected a non-empty list of token ids")
        V = self.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < V for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {V})")
        need = len(prompt_ids) + params.max_tokens + 1
        if need > self.config.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model length of this server ({self.config.max_len - 1} tokens)")
        req = Request(req_id or f"req-{next(self._ids)}", [int(t) for t in prompt_ids], params, on_update, group=group,
                      prompt_key=prompt_key, policy_version=policy_version)
        if self.scheduler.longest_first:
            req.expected_len = expected_length(self.drafter.local, req.prompt_ids, prompt_key)
        if params.grammar is not None:
            req.grammar = self.grammars.matcher(params.grammar)
        if params.temperature > 0:
            req.coins = CoinStream(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        with self._lock:
            if req.req_id in self._live:
                raise ValueError(f"request id '{req.req_id}' is already live")
            self._live[req.req_id] = req
            self._inbox.append(req)
        return req

    def abort(self, req_id: str) -> None:
        with self._lock:
            self._aborts.append(req_id)

    def quiesce(self) -> None:
        """With no request running (the engine thread, between steps): retires the plain step launched
        ahead for requests that have all finished since, and waits for the device, so that nothing
        reads the model's weights while they are replaced."""
        self._drain()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts) or self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Request]:
        """One engine step: admit + prefill newcomers, then one verify step over the running batch.
        Returns the requests that got tokens or finished."""
        t0 = time.perf_counter()
        updated = self._take_inbox()
        if self.scheduler.num_unfinished:
            self.makespan.start()
        if self._inflight is not None and updated:
            updated.extend(self._drain())  # aborts: the step ahead's tokens first, none for the aborted
        # (Newcomers prefill while a step is in flight: the stream orders their prefill after it, and
        # the batch change makes the next step drain it and start from the host's tokens.)
        admitted = self.scheduler.admit()
        stepped = False
        if admitted:
            t = time.perf_counter()
            chunks = (prefill_chunks(admitted, self.config.prefill_tokens) if self.graphs is None
                      else graph_prefill_chunks(admitted, self.graphs, self.config.prefill_tokens))
            for chunk in chunks:
                self._prefill(chunk)
                self.stats.prefills += 1
            self.stats.prefill_seconds += time.perf_counter() - t
        updated.extend(admitted)
        running = [r for r in self.scheduler.running if not r.finished]
        if running and self._overlaps(running):
            t, self._committed_launched = time.perf_counter(), 0
            steady = self._inflight is not None  # not the step that restarts the pipeline
            updated.extend(self._overlapped_step(running))
            if self.drafter is not None and steady:  # a plain step of a speculative engine: what it delivered
                self.policy.observe_delivered(len(running), False, time.perf_counter() - t, self._committed_launched)
        elif running:
            if self._inflight is not None:
                # A drafting step after overlapped plain ones: the step in flight commits first. The
                # policy sees neither this wait nor the step that restarted the pipeline: plain
                # decoding's figure is its steady state (BudgetPolicy.explore_run).
                updated.extend(self._drain())
                running = [r for r in running if not r.finished]
            if running:
                self._verify_step(running)
                updated.extend(running)
                stepped = True
        for req in self.scheduler.release_finished():
            if self.drafter is not None:  # an aborted or failed output stays out of the prompt history
                self._corpus_call(self.drafter.finish, req.req_id, req.finish_reason in ("stop", "length"))
        if not (stepped and self.scheduler.running):
            # This step's commits and finishes reach the corpus now if no verify step follows at
            # once; otherwise the next one hands them over while its GPU work runs, off the host's
            # critical path between two drafting steps (a pipe write of ~10 us at batch 1, more at 64).
            self._dispatch(hold=bool(self.scheduler.running))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.makespan.busy(self.scheduler.num_unfinished > 0)
        seen = set()
        out = [r for r in updated if not (r.req_id in seen or seen.add(r.req_id))]
        with self._lock:
            for r in out:
                if r.finished:
                    self._live.pop(r.req_id, None)
        for r in out:
            if r.on_update is not None:
                r.on_update(r)
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Runs the given prompts to completion (continuous batching when there are more than slots)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        i = 0  # reqs[:i] are finished (for good): each step checks from the first one that is not
        while True:
            while i < len(reqs) and reqs[i].finished:
                i += 1
            if i == len(reqs):
                return reqs
            self.step()

    def fail_all(self, error: str) -> None:
        """After an internal error: finish every live request with finish_reason "error"."""
        self._inflight = None  # whatever it computed is not committed
        self._take_inbox()
        reqs = list(self.scheduler.waiting) + self.scheduler.running
        self.scheduler.waiting.clear()
        for req in reqs:
            if not req.finished:
                req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
        for req in self.scheduler.release_finished():
            if self.drafter is not None:
                self.drafter.finish(req.req_id, rollout=False)
        self._dispatch()
        with self._lock:
            for req in reqs:
                self._live.pop(req.req_id, None)
        for req in reqs:
            if req.on_update is not None:
                req.on_update(req)

    def _take_inbox(self) -> list[Request]:
        """New requests into the queue; aborted ones finished (their requests returned)."""
        with self._lock:
            if not (self._inbox or self._aborts):
                # Most steps: nothing arrived. Scanning the queue anyway cost every step time in
                # proportion to the requests waiting (13 us behind 100 waiting ones on a 2-core dev machine).
                return []
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = set(self._aborts), deque()
        for req in new:
            self.scheduler.add(req)
        if not aborts:  # only an abort finishes a waiting request (fail_all empties the queue)
            return []
        done = []
        for req in list(self.scheduler.waiting) + self.scheduler.running:
            if req.req_id in aborts and not req.finished:
                req.status, req.finish_reason, req.finished_at = Status.FINISHED, "abort", time.monotonic()
                done.append(req)
        self.scheduler.waiting = deque(r for r in self.scheduler.waiting if not r.finished)
        return done

    def _prefill(self, reqs: list[Request]) -> None:
        """One causal forward over the prompts of ``reqs``, right-padded to the longest (replayed
        as a prefill graph where one fits), then each request's first token from its last prompt
        position. The padding rows' K/V land past each prompt, where masks never look and decoding
        overwrites them; they repeat the prompt's last token, so they are finite where the prompt
        is (a masked NaN still poisons attention: 0 * NaN)."""
        dev = self.device
        lens = [len(r.prompt_ids) for r in reqs]
        T = max(lens)
        Tb = None if self.graphs is None else self.graphs.prefill_bucket(T)
        if Tb is not None and len(reqs) <= self.graphs.max_prefill_prompts(Tb):
            logits = self.graphs.prefill([r.prompt_ids for r in reqs], [r.slot for r in reqs])
        else:
            ids = np.empty((len(reqs), T), dtype=np.int64)
            for i, r in enumerate(reqs):
                ids[i, :lens[i]] = r.prompt_ids
                ids[i, lens[i]:] = r.prompt_ids[-1]
            rows = torch.arange(T, device=dev).expand(len(reqs), T)
            fb = ForwardBatch(rows, rows, torch.tensor([r.slot for r in reqs], device=dev), T, None)
            last = torch.tensor(lens, device=dev) - 1
            logits = self.model(torch.from_numpy(ids).to(dev), self.cache, fb, last_index=last)[:, 0]
        if self.drafter is not None:
            # The corpus indexes the prompts while the GPU runs the prefill (its kernels are queued;
            # the first read of the logits waits): about 0.1 ms of host work per prompt, 6 ms for
            # the 64 prompts that start a batch-64 run, which would otherwise follow the forward.
            for req in reqs:
                self._corpus_call(self.drafter.start_request, req.req_id, req.prompt_ids, group=req.group,
                                  prompt_key=req.prompt_key, policy_version=req.policy_version)
        bad = nonfinite_rows(logits)  # before penalties: min_tokens puts -inf in on purpose
        for i, req in enumerate(reqs):
            if needs_processing(req):
                process_logits(logits[i:i + 1, None], [req], logits.new_zeros(1, 1, dtype=torch.int64),
                               torch.ones(1, 1, 1, dtype=torch.bool, device=dev), self.eos_ids)
        mask_logits(reqs, None, logits)
        # The greedy requests' first tokens and every row's non-finite flag: one copy to the host.
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        chosen = logits if len(greedy) == len(reqs) else logits[greedy]
        host = torch.cat([chosen.argmax(-1), bad.long()]).tolist()
        first, bad = dict(zip(greedy, host[:len(greedy)])), host[len(greedy):]
        for i, req in enumerate(reqs):
            tok = first[i] if i in first else self._sample_one(logits[i:i + 1], [req])
            req.cache_len = lens[i]
            self.stats.prefill_tokens += lens[i]
            self._commit_path(req, [tok], logits[i:i + 1], [0], [bool(bad[i])])
            if bad[i]:
                self.cache.clear(req.slot)
        self._flush_extends()

    def _sample_one(self, logits: torch.Tensor, reqs: list[Request]) -> int:
        req = reqs[0]
        p = req.params
        if p.greedy:
            return int(logits[0].argmax())
        probs = target_probs(logits, *self._param_tensors([req], 1))
        return int(sample(probs, torch.from_numpy(req.coins.take(1).copy()).to(probs.device))[0])

    def _param_tensors(self, reqs: list[Request], K: int):
        """target_probs' per-row arguments, and whether any request truncates (known here, on the host)."""
        dev, V = self.device, self.model.config.vocab_size
        temp = torch.tensor([max(r.params.temperature, 1e-6) for r in reqs], device=dev).repeat_interleave(K)
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev).repeat_interleave(K)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev).repeat_interleave(K)
        truncated = any(0 < r.params.top_k < V or r.params.top_p < 1.0 for r in reqs)
        return temp, top_k, top_p, truncated

    def _commit_path(self, req: Request, tokens: list[int], logits: torch.Tensor | None, path: list[int], bad: list[bool]) -> int:
        """Commits tokens chosen from logits [K, V] rows ``path`` (one each) up to the first
        non-finite row, which fails the request (``verifier.step.numerics``); returns how many were committed."""
        m = bad.index(True) if True in bad else len(tokens)
        lps = [] if req.params.logprobs is None else row_logprobs(logits[path[:m]], tokens[:m], [req.params.logprobs] * m)
        committed = self._commit(req, tokens[:m], lps)
        if m < len(tokens) and not req.finished:
            req.status, req.finish_reason, req.finished_at = Status.FINISHED, "error", time.monotonic()
            req.error = error_message(len(req.output_ids))
            log.warning("request %s: %s", req.req_id, req.error)
        return committed

    @staticmethod
    def _commits_as_run(req: Request) -> bool:
        """Whether ``_commit_run`` may commit this request's tokens: no stop strings, grammar or logprobs."""
        p = req.params
        return p.logprobs is None and req.grammar is None and not p.stop

    def _commit_run(self, req: Request, tokens: list[int]) -> int:
        """``_commit`` for a request that ``_commits_as_run`` (``append_run``)."""
        p = req.params
        key = (p.ignore_eos, p.stop_token_ids)
        stops = self._stop_sets.get(key)
        if stops is None:
            stops = self._stop_sets[key] = stop_tokens(p, self.eos_ids)
        m = append_run(req, tokens, stops, self.codec.decode)
        if m:
            self.stats.generated_tokens += m
            if self.drafter is not None:
                self._extends.append((req.req_id, tokens[:m]))  # sent in one batch: _flush_extends
        return m

    def _commit(self, req: Request, tokens: list[int], logprobs: list | None = None) -> int:
        """Appends tokens up to a stop; returns how many were committed."""
        before = len(req.output_ids)
        append_tokens(req, settle(req, tokens), self.eos_ids, self.codec.decode)
        finish_if_complete(req, self.codec.decode)
        committed = req.output_ids[before:]
        req.logprobs.extend((logprobs or [])[:len(committed)])
        self.stats.generated_tokens += len(committed)
        if self.drafter is not None and committed:
            self._extends.append((req.req_id, committed))  # sent in one batch: _flush_extends
        return len(committed)

    def _corpus_call(self, method, *args, **kwargs):
        """A drafter call, its time counted in stats.corpus_seconds."""
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.stats.corpus_seconds += time.perf_counter() - t

    def _await_remote(self) -> bool:
        """While the GPU runs a step: the remote corpus' answer for the next step taken in (see
        Drafter.await_ahead). Its time is the GPU wait's, not the corpus': it only fills that wait."""
        return self.drafter.await_ahead()

    def _dispatch(self, hold: bool = False) -> None:
        """The drafter's held corpus calls and next draft request to its client (Drafter.dispatch);
        ``hold``: more steps follow soon, so calls no draft request needs may wait for one of them."""
        if self.drafter is not None:
            self._corpus_call(self.drafter.dispatch, hold)

    def _flush_extends(self) -> None:
        if self._extends:
            extends, self._extends = self._extends, []
            self._corpus_call(self.drafter.extend_many, extends)

    def _overlaps(self, running: list[Request]) -> bool:
        """Whether this step runs plain and overlapped: no drafter, or the budget policy does not
        draft this step (its decision is kept for the step: deciding has side effects)."""
        if not (self.config.overlap_plain and self._fast_greedy(running)
                and all(r.params.logprobs is None for r in running)):
            return False
        if self.drafter is None:
            return True
        if not self.config.overlap_spec_plain:
            return False
        budget = self._decide_budget(running)
        self._budget_now = (len(running), budget)
        return budget == 0

    def _step_budget(self, running: list[Request]) -> int:
        """The step's draft budget: the one _overlaps decided for this batch size, or the policy's."""
        decided, self._budget_now = self._budget_now, None
        if decided is not None and decided[0] == len(running):
            return decided[1]
        return self._decide_budget(running) if self.drafter is not None else 0

    def _decide_budget(self, running: list[Request]) -> int:
        """The policy's budget for this step, raised in a batch's tail (EngineConfig.makespan)."""
        bs = len(running)
        critical = None
        if self.config.makespan.critical_path and self.policy.fixed is None:
            critical = critical_acceptance(running, self.policy.acceptance(bs, True))
        budget = self.policy.draft_budget(bs, critical=critical)
        tail = self.config.makespan.tail_requests
        if tail and bs <= tail and not self.scheduler.waiting and self.config.budget != 0:
            # The batch's tail: a step costs about the same whatever its tree size (verifier/budget/makespan.py).
            budget = max(budget, self.config.makespan.tail_budget or self.config.max_budget)
        return budget

    def _overlapped_step(self, running: list[Request]) -> list[Request]:
        """Plain decoding one step ahead of the host: launches this step (its input tokens are the
        predictions of the step in flight, on the device, when the batch is the same), then
        commits the step in flight. Returns the requests that got tokens or finished."""
        prev = self._inflight
        done: list[Request] = []
        if prev is not None and not (len(prev.reqs) == len(running) and all(a is b for a, b in zip(prev.reqs, running))):
            done = self._drain()  # the batch changed: its tokens first, then a step from the host's tokens
            running = [r for r in running if not r.finished]
            prev = None
            if not running:
                return done
        bs = len(running)
        if prev is None:
            prefix, tokens = [r.cache_len for r in running], [r.last_token for r in running]
        else:  # every request commits one token per plain step: its next root row is one further
            prefix, tokens = [p + 1 for p in prev.prefix], [0] * bs  # tokens: from the device
        host = np.concatenate([tokens, [-1] * bs, prefix, [r.slot for r in running]]).astype(np.int64)
        launch = self.graphs.launch_greedy_step(host, bs, 1, max(prefix) + 1,
                                                tokens_from=None if prev is None else prev.launch)
        self._inflight = _Inflight(list(running), launch, prefix)
        if prev is not None:
            done = self._commit_launched(prev)
        return done

    def _drain(self) -> list[Request]:
        inflight, self._inflight = self._inflight, None
        return [] if inflight is None else self._commit_launched(inflight)

    def _commit_launched(self, inflight: _Inflight) -> list[Request]:
        """Commits an overlapped plain step's tokens (one per request). A request that finished or
        was aborted after the step was launched drops its token (its K/V row lies past its end)."""
        r = self.graphs.collect(inflight.launch)
        predicts, bad = r.predicts.tolist(), r.bad[:, 0].tolist()
        self._committed_launched = 0
        for b, req in enumerate(inflight.reqs):
            if req.finished:
                continue
            self._committed_launched += 1
            req.cache_len += 1
            req.verify_steps += 1
            if not bad[b] and self._commits_as_run(req):
                self._commit_run(req, [predicts[b]])
            else:
                self._commit_path(req, [predicts[b]], None, [0], [bad[b]])
            if bad[b]:  # NaN K/V in masked rows would still reach attention (0 * NaN)
                self.cache.clear(req.slot, 0 if req.finish_reason == "error" else req.cache_len)
        self._flush_extends()
        return list(inflight.reqs)

    @staticmethod
    def _greedy_only(running: list[Request]) -> bool:
        """Whether the step is the forward part and the greedy tail alone: greedy requests whose
        logits need no processing (penalties, min_tokens, grammar masks)."""
        return all(r.params.greedy and r.grammar is None and not needs_processing(r) for r in running)

    def _fast_greedy(self, running: list[Request]) -> bool:
        """Whether the whole step can replay as one graph (GraphRunner.greedy_step)."""
        return self.graphs is not None and self._greedy_only(running)

    def _verify_step(self, running: list[Request], plain: frozenset[str] = frozenset()) -> None:
        """One verify step of ``running`` (drafting, unless the policy says not to)."""
        t0 = time.perf_counter()  # the step's wall time, drafting included, feeds the budget policy
        captures = self.graphs.captures if self.graphs is not None else 0
        slots = [r.slot for r in running]
        max_prefix = max(r.cache_len for r in running)
        fast = self._fast_greedy(running)
        packed, inp = self._plan(running, plain, slots, max_prefix, fast)
        bs, K = packed.bs, packed.K
        if fast:
            if self.device.type != "cuda":  # a CPU forward is synchronous: hand over the corpus calls first
                self._dispatch(hold=True)
            t1 = time.perf_counter()
            launch = self.graphs.launch_input(inp, bs)
            self._dispatch(hold=True)  # while the GPU runs the step
            r = self.graphs.collect(launch, idle=self._await_remote if self.drafter is not None and self.drafter.pipelined_remote else None)
        else:
            t1 = time.perf_counter()
            r = self._verify_general(running, packed, inp, max_prefix)
        tokens, num_nodes, predicted = packed.tokens, packed.num_nodes, packed.predicted
        t2 = time.perf_counter()
        self.stats.pack_seconds += t1 - t0
        self.stats.forward_seconds += t2 - t1
        accept_index, num, predicts, bad, logits = r.accept_index, r.accept_token_num, r.predicts, r.bad, r.logits
        captured = self.graphs is not None and self.graphs.captures != captures  # a capture is not a step's cost
        if not captured:
            # The forward phase (launch to results) refreshes the cost model; the whole step, the
            # host overhead the model does not see.
            self.policy.observe_step(K > 1, time.perf_counter() - t0, bs * K, forward_seconds=t2 - t1)
        bad_any = bad.any(-1).tolist()
        # A draft node's NaN K/V reaches every row of its request (masked columns get weight 0, and
        # 0 * NaN = NaN), so such a request verifies the step again without drafts, as plain decoding would.
        retry = frozenset(r.req_id for b, r in enumerate(running) if num_nodes[b] > 1 and bad_any[b])
        if retry:
            for r in running:
                if r.req_id in retry:
                    self.cache.clear(r.slot, r.cache_len)
            return self._verify_step(running, plain | retry)
        accepted_total = 0
        # Each request's committed run (its accepted path's tokens, then the bonus) gathered for the
        # whole batch at once: accept_index holds the path's node indices into the flat [bs * K]
        # trees (-1 past the path), and the bonus is the target's prediction after the last one.
        rows = np.arange(bs)
        path = np.maximum(accept_index, 0)
        runs = np.empty((bs, K), dtype=np.int64)  # n <= K - 1 accepted, so n + 1 <= K tokens
        runs[:, :K - 1] = tokens.reshape(-1)[path[:, 1:]]
        runs[rows, num] = predicts[path[rows, num]]
        # Python lists: indexing them is several times cheaper than numpy scalars, per request per step.
        num, runs = num.tolist(), runs.tolist()
        slow = None  # the general commit's inputs, made once if a request needs them
        for b, req in enumerate(running):
            n = num[b]
            req.cache_len += 1 + n
            req.verify_steps += 1
            nb = num_nodes[b]
            req.draft_tokens += nb - 1
            if nb > 1:
                req.spec_steps += 1
                self.stats.spec_steps += 1
            accepted_total += n
            # Usage counts accepted tokens that were committed (a stop can cut the path short).
            if not bad_any[b] and self._commits_as_run(req):
                req.accepted_tokens += min(n, self._commit_run(req, runs[b][:n + 1]))
                continue
            if slow is None:
                slow = accept_index.tolist(), bad.tolist()
            nodes = [i - b * K for i in slow[0][b][1:1 + n]]
            path_b = [0] + nodes  # emitted token j was chosen from the logits of path node j
            req.accepted_tokens += min(n, self._commit_path(req, runs[b][:n + 1], logits[b] if req.params.logprobs is not None else None,
                                                             path_b, [slow[1][b][i] for i in path_b]))
            if bad_any[b]:  # NaN K/V in masked rows would still reach attention (0 * NaN)
                self.cache.clear(req.slot, 0 if req.finish_reason == "error" else req.cache_len)
        self._flush_extends()
        t3 = time.perf_counter()
        self.stats.commit_seconds += t3 - t2
        # The step's wall time, commits included.
        if not captured and self.drafter is not None:
            self.policy.observe_delivered(bs, self._drafted, t3 - t0, bs + accepted_total)
        self.stats.draft_tokens += sum(num_nodes) - bs
        self.stats.accepted_tokens += accepted_total
        if K > 1:
            self.policy.observe(predicted, accepted_total)

    def _plan(self, running: list[Request], plain: frozenset[str], slots: list[int], max_prefix: int,
              fast: bool) -> tuple[PackedTrees, StepInput | None]:
        """Every step's drafting and plan: the corpus' padded rows (pruned to what each request's
        grammar accepts) summarized for the node choice, then pruned and packed in one native
        pass each (``verifier/step/csrc/step_rows.h``; ``verifier.step.tree_batch`` holds the numpy
        form, whose ~25 calls cost more than the work at batch 1). With graphs the plan is written
        straight into the pinned input of the step's graph (a greedy step's where ``fast``, else a
        forward graph's) at its buckets; without, at the step's exact shape (no padding to add
        compute on the CPU). Requests in ``plain`` verify no draft (a retry after non-finite logits)."""
        bs = len(running)
        budget = self._step_budget(running)
        spec = [i for i, r in enumerate(running) if r.params.speculate and r.req_id not in plain]
        self._drafted = budget > 0 and bool(spec)
        room = self.config.max_len - max_prefix
        k = nodes = 0
        best_first = True
        if budget > 0 and spec:
            batch = self._corpus_call(self.drafter.draft, [running[i].req_id for i in spec], budget)
            tokens, parents, probs, counts = batch.tokens, batch.parents, batch.probs, batch.counts
            grammar = [i for i in spec if running[i].grammar is not None]
            if len(spec) < bs or grammar:  # rows of their own: empty ones for requests that do not speculate
                W = tokens.shape[1]
                tokens, parents = np.zeros((bs, W), np.int32), np.full((bs, W), -1, np.int32)
                probs, counts = np.zeros((bs, W), np.float32), np.zeros(bs, np.int32)
                tokens[spec], parents[spec], probs[spec], counts[spec] = batch.tokens, batch.parents, batch.probs, batch.counts
                for i in grammar:  # structured output: nodes the grammar rejects cost nothing
                    n = int(counts[i])
                    t, p, q = running[i].grammar.prune_draft(tokens[i, :n], parents[i, :n], probs[i, :n])
                    m = len(t)
                    tokens[i, :m], parents[i, :m], probs[i, :m], counts[i] = t, p, q, m
                    tokens[i, m:], parents[i, m:], probs[i, m:] = 0, -1, 0.0
            nodes, best_first, sums = _native.summarize_rows(probs, counts)
            k = self.policy.choose_nodes_summary(bs, nodes, sums)
            k = max(0, min(k, room - 1))  # rows prefix .. prefix + K - 1
        else:
            tokens = parents = np.zeros((bs, 0), np.int32)
            probs, counts = np.zeros((bs, 0), np.float32), np.zeros(bs, np.int32)
        inp = None
        if self.graphs is None:
            K, rows, scratch, out = 1, 0, 0, None
        else:
            K = self.graphs.nodes_bucket(1 + min(nodes, k), room)
            inp = self.graphs.step_input(bs, K, max_prefix + K, forward_only=not fast)
            rows, scratch, out = inp.B, self.graphs.scratch, inp.host
        host, K, num_nodes, predicted = _native.pack_plan(
            [r.last_token for r in running], tokens, parents, probs, counts, k, best_first,
            [r.cache_len for r in running], slots, K, rows=rows, scratch=scratch, out=out)
        return PackedTrees(host, bs, K, num_nodes, predicted, rows=rows), inp

    def _verify_general(self, running: list[Request], packed: PackedTrees, inp: StepInput | None, max_prefix: int):
        """A step that is not one greedy-step graph: the forward part replayed as a forward graph
        where there are graphs (``inp``), else run eagerly at the step's shape; then either the
        greedy tail (greedy requests without logit processing, no graphs), or tree rejection
        sampling straight from the logits (``_raw_targets``: no processing, no truncation), or the
        logits processed on the way (penalties, grammar masks, top-k/top-p) and verified greedily
        or by tree rejection sampling, eagerly. Returns the results on the host as greedy_step does."""
        bs, K = packed.bs, packed.K
        if self.device.type != "cuda":  # a CPU forward is synchronous: hand over the corpus calls first
            self._dispatch(hold=True)
        greedy_only = inp is None and self._greedy_only(running)
        raw = not greedy_only and self._raw_targets(running)
        if inp is not None:  # (a forward graph's logits are in the model's dtype)
            f = self.graphs.launch_forward(inp, bs)
        else:
            slots = packed.slots.tolist()
            consecutive = slots == list(range(slots[0], slots[0] + bs))
            # Logits in the model's dtype for the greedy tail and the raw sampling (as a graph gives them).
            f = forward_part(self.model, self.cache, torch.from_numpy(packed.host).to(self.device), bs, K,
                             max_prefix + K, float_logits=not (greedy_only or raw),
                             slot_range=(slots[0], bs) if consecutive else None)
        self._dispatch(hold=True)  # while the GPU runs the forward
        if greedy_only:
            return GreedyStepResult.unpack(greedy_tail(self.cache, f).cpu().numpy(), bs, K, bs, f.logits)
        if raw:
            res, bad = self._verify_raw(running, f)
            logits = f.logits
        else:
            # Processing writes into the logits: a float32 copy of a graph's 16-bit buffer.
            logits = f.logits if f.logits.dtype == torch.float32 else f.logits.float()
            bad = nonfinite_rows(logits)  # before penalties: min_tokens puts -inf in on purpose
            process_logits(logits, running, f.tokens, f.tree_mask, self.eos_ids)
            if any(r.grammar is not None for r in running):  # structured output: each node's grammar mask
                n, tok, par = packed.num_nodes, packed.tokens, packed.parents
                mask_logits(running, [(tok[b, 1:n[b]], par[b, 1:n[b]] - 1) for b in range(bs)], logits)
            idx = f.idx
            if all(r.params.greedy for r in running):
                res = kernels.verify_tree_greedy(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                                 idx.retrive_next_sibling, logits.argmax(-1), K)
            else:
                res = self._verify_sampled(running, f, logits)
        keep_accepted(self.cache, f, res)
        # One device-to-host copy (each copy is a sync).
        flat = GreedyStepResult.pack(res.accept_index, res.accept_token_num, res.predicts, bad).cpu().numpy()
        return GreedyStepResult.unpack(flat, bs, K, bs, logits)

    def _raw_targets(self, running: list[Request]) -> bool:
        """Whether every request's target is the softmax of its logits as the model gave them (or
        their argmax): no penalties or min_tokens, grammar, logprobs, top-k or top-p. Such a step
        verifies from the logits (``kernels.tree_sampling_logits``), without a [bs, K, V]
        distribution (at 134 requests x 16 nodes, ~0.65 ms of the H200's time per step)."""
        V = self.model.config.vocab_size
        return all(not needs_processing(r) and r.grammar is None and r.params.logprobs is None
                   and not 0 < r.params.top_k < V and r.params.top_p >= 1.0 for r in running)

    def _coins(self, running: list[Request], K: int, extra: np.ndarray | None = None):
        """Each request's K node coins [bs, K] and bonus coin [bs] on the device, from its own stream
        (zeros for greedy requests), and ``extra`` (float32) with them: one host array, one copy."""
        bs = len(running)
        n = bs * (K + 1)
        host = np.zeros(n + (len(extra) if extra is not None else 0), dtype=np.float32)
        for b, r in enumerate(running):
            if r.coins is not None:
                host[b * (K + 1):(b + 1) * (K + 1)] = r.coins.take(K + 1)
        if extra is not None:
            host[n:] = extra
        dev = torch.from_numpy(host).to(self.device)
        draws = dev[:n].view(bs, K + 1)
        return draws[:, :K].contiguous(), draws[:, K].contiguous(), dev[n:]

    def _verify_raw(self, running: list[Request], f: StepForward):
        """Tree rejection sampling of a ``_raw_targets`` step straight from its logits; greedy rows
        (temperature 0) have one-hot targets, as in ``_verify_sampled``. Returns (result, bad)."""
        bs, K = f.tokens.shape
        temps = np.repeat(np.array([r.params.temperature for r in running], dtype=np.float32), K)
        coins, final, temps = self._coins(running, K, temps)
        idx = f.idx
        return kernels.tree_sampling_logits(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                            idx.retrive_next_sibling, coins, final, f.logits, temps, K)

    def _verify_sampled(self, running: list[Request], f: StepForward, logits: torch.Tensor):
        """Exact tree rejection sampling of processed ``logits`` [bs, K, V] float32; greedy rows use
        one-hot targets (the same as greedy)."""
        bs, K, V = logits.shape
        flat = logits.reshape(bs * K, V)
        probs = target_probs(flat, *self._param_tensors(running, K))
        if any(r.params.greedy for r in running):  # (else no [bs * K, V] one-hot to build and merge)
            greedy = torch.tensor([r.params.greedy for r in running], device=self.device).repeat_interleave(K)
            one_hot = torch.zeros_like(probs).scatter_(1, flat.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy[:, None], one_hot, probs)
        probs = probs.view(bs, K, V)
        coins, final, _ = self._coins(running, K)
        idx = f.idx
        return kernels.tree_speculative_sampling(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                                 idx.retrive_next_sibling, coins, final, probs, K)
