"""The speculative decoding engine: continuous batching over a preallocated KV cache; each step
drafts trees from the corpus, verifies them in one forward, commits the accepted path plus one
bonus token, and streams the committed tokens back to the corpus.

Plain decoding is the same step with no draft nodes (K = 1), so speculative and plain greedy run
the same code and produce the same tokens.

This module owns the engine's state, its thread-safe request API and the step loop; the parts of a
step live beside it: ``prefill.py`` (admitted prompts' forwards), ``verify.py`` (the draft budget,
drafting, packing and greedy verification), ``sampled.py`` (tree rejection sampling),
``commit.py`` (accepted tokens appended up to stops, and handed to the corpus), ``overlap.py``
(plain steps run one ahead of the host). ``config.py`` holds ``EngineConfig`` and ``EngineStats``,
re-exported here.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from corpus_service import check_policy_version, check_prompt_key

from .. import kernels
from ..budget.cost_probe import measure_cost_model
from ..budget.makespan import MakespanClock, expected_length
from ..budget.policy import BudgetPolicy, CostModel
from ..draft.drafter import Drafter
from ..model import ForwardBatch, KVCache, TextCodec, Transformer
from ..model import fusion
from ..step.cuda_graphs import GraphRunner, probe_native_linear
from ..step.grammar import GrammarCompiler
from ..step.penalties import PenaltyCounts
from ..step.sampling import SamplingParams
from .commit import Commits
from .config import EngineConfig, EngineStats
from .overlap import Overlap, _Inflight
from .prefill import Prefill, graph_prefill_chunks, prefill_chunks
from .request import CoinStream, Request, Status, stop_tokens
from .sampled import Sampled
from .scheduler import Scheduler
from .verify import Verify

__all__ = ["Engine", "EngineConfig", "EngineStats", "graph_prefill_chunks", "prefill_chunks"]

log = logging.getLogger(__name__)

CPU_PREFILL_TOKENS = 512


class Engine(Prefill, Verify, Sampled, Commits, Overlap):
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
        # This engine's choice. The flag lives on the model, which other engines may share (benchmarks
        # build a plain engine and speculative ones on one model, each choosing at its start): step()
        # sets it back, so this engine's lazily captured graphs and eager forwards keep its choice.
        self.native_linear: bool = model.native_linear
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
        self.penalty_counts = PenaltyCounts(config.max_batch)  # penalized requests' token counts, per slot
        self.grammars = GrammarCompiler(codec.tokenizer, mc.vocab_size, self.eos_ids)  # lazy: structured output
        fixed = 0 if drafter is None else config.budget
        if fixed is None and cost is None:
            cost = measure_cost_model(model, self.cache, config.max_batch, config.max_budget + 1,
                                      time_budget_s=config.cost_probe_s,
                                      forward=None if self.graphs is None else self.graphs.forward_step)
        self.policy = BudgetPolicy(config.max_budget, fixed, cost)
        self.policy.gpu_share = config.gpu_share
        if self.graphs is not None:
            # Not a closure over self: an engine in a reference cycle outlives its last reference
            # until a full garbage collection, which then frees its graphs and device memory in the
            # middle of whatever runs (another engine's step).
            self.policy.node_bucket = functools.partial(self.graphs.nodes_bucket, room=config.max_len)
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
        # Requests queued and not yet running, and their tokens (prompt + max_tokens each): what the
        # HTTP API bounds admission by (verifier/api/lifecycle.py). Under _lock: the API's thread adds.
        self._waiting = self._waiting_tokens = 0
        self._extends: list[tuple[str, list[int]]] = []  # this step's committed tokens for the drafter
        self._told: list[tuple] = []  # the last verify step's observations for the policy: (method, args)
        # Requests whose on_update waits for the next launch (a speculative engine: Commits._settle),
        # and what runs once after a step's on_update calls (EngineLoop: one event-loop wake-up).
        self._updates: list[Request] = []
        self.after_updates: Callable[[], None] | None = None
        self._drafted = False  # whether this step asked the corpus for drafts (BudgetPolicy.observe_delivered)
        self._budget_now: tuple[int, int] | None = None  # (batch size, budget) decided by _overlaps
        self._committed_launched = 0  # requests the last committed overlapped step gave a token
        self._inflight: _Inflight | None = None  # overlap_plain: the step launched ahead of the host
        # Eager prefill forwards on a CPU hold at most CPU_PREFILL_TOKENS: an abort takes effect
        # between forwards, and one of 8 x 500 tokens of SmolLM2 took ~20 s on 2 cores (batching
        # prompts buys a CPU little: its forward's time grows with its tokens).
        self._prefill_tokens = config.prefill_tokens if on_cuda else min(config.prefill_tokens, CPU_PREFILL_TOKENS)

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
        req.as_run = params.logprobs is None and req.grammar is None and not params.stop
        req.stops = stop_tokens(params, self.eos_ids)
        req.plain_greedy = params.greedy and req.grammar is None and not params.penalized
        if params.temperature > 0:
            req.coins = CoinStream(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        with self._lock:
            if req.req_id in self._live:
                raise ValueError(f"request id '{req.req_id}' is already live")
            self._live[req.req_id] = req
            self._inbox.append(req)
            self._waiting += 1
            self._waiting_tokens += _waiting_cost(req)
        return req

    def abort(self, req_id: str) -> None:
        """Finishes the request (finish_reason "abort") at the next step: a waiting one leaves the
        queue without a prefill, a running one frees its slot. Unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.append(req_id)

    def abort_all(self) -> int:
        """Aborts every live request (a shutdown's deadline); returns how many."""
        with self._lock:
            self._aborts.extend(self._live)
            return len(self._live)

    def waiting_load(self) -> tuple[int, int]:
        """(requests queued and not running yet, their tokens: prompt + max_tokens each)."""
        with self._lock:
            return self._waiting, self._waiting_tokens

    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

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
        self.model.native_linear = self.native_linear  # (see __init__: the model may be shared)
        updated = self._take_inbox()
        if self.scheduler.num_unfinished:
            self.makespan.start()
        if self._inflight is not None and updated:
            updated.extend(self._drain())  # aborts: the step ahead's tokens first, none for the aborted
        # (Newcomers prefill while a step is in flight: the stream orders their prefill after it, and
        # the batch change makes the next step drain it and start from the host's tokens.)
        admitted = self.scheduler.admit()
        self._left_waiting(admitted)
        stepped = False
        if admitted:
            t = time.perf_counter()
            chunks = (prefill_chunks(admitted, self._prefill_tokens) if self.graphs is None
                      else graph_prefill_chunks(admitted, self.graphs, self.config.prefill_tokens))
            for chunk in chunks:
                # A client that left while an earlier forward ran costs no forward of its own.
                if chunk := self._abort_unprefilled(chunk):
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
        finished = self.scheduler.release_finished()
        if finished and self.drafter is not None:
            self._flush_extends()  # their last tokens before their finishes
        for req in finished:
            if self.drafter is not None:  # an aborted or failed output stays out of the prompt history
                self._corpus_call(self.drafter.finish, req.req_id, req.finish_reason in ("stop", "length"))
        seen = set()
        out = [r for r in updated if not (r.req_id in seen or seen.add(r.req_id))]
        with self._lock:
            for r in out:
                if r.finished:
                    self._live.pop(r.req_id, None)
        self._updates.extend(r for r in out if r.on_update is not None)
        if not (stepped and self.scheduler.running):
            # This step's commits, finishes and updates reach the corpus and the callers now if no
            # verify step follows at once; otherwise the next one hands them over while its GPU
            # work runs, off the host's critical path between two drafting steps (a pipe write of
            # ~10 us at batch 1, more at 64; an update: a snapshot of the request's output).
            self._dispatch(hold=bool(self.scheduler.running))
        if self.drafter is None:  # (a plain engine's steps commit after their launch already)
            self._send_updates()
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.makespan.busy(self.scheduler.num_unfinished > 0)
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
        self._send_updates()  # the steps before the failure's, first
        self._inflight = None  # whatever it computed is not committed
        self._take_inbox()
        reqs = list(self.scheduler.waiting) + self.scheduler.running
        self._left_waiting([r for r in self.scheduler.waiting if not r.finished])
        self.scheduler.waiting.clear()
        for req in reqs:
            if not req.finished:
                req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
        finished = self.scheduler.release_finished()
        if finished and self.drafter is not None:
            self._flush_extends()
        for req in finished:
            if self.drafter is not None:
                self.drafter.finish(req.req_id, rollout=False)
        self._dispatch()
        with self._lock:
            for req in reqs:
                self._live.pop(req.req_id, None)
        self._updates.extend(r for r in reqs if r.on_update is not None)
        self._send_updates()

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
        self._left_waiting([r for r in done if r.slot < 0])  # (a running request holds a slot)
        self.scheduler.waiting = deque(r for r in self.scheduler.waiting if not r.finished)
        return done

    def _abort_unprefilled(self, chunk: list[Request]) -> list[Request]:
        """``chunk`` less the requests aborted since the step began, finished here (their slots are
        released with the step's finished requests; the next step's _take_inbox finds them done)."""
        with self._lock:
            if not self._aborts:
                return chunk
            pending = set(self._aborts)
        keep = []
        for req in chunk:
            if req.req_id in pending:
                req.status, req.finish_reason, req.finished_at = Status.FINISHED, "abort", time.monotonic()
            else:
                keep.append(req)
        return keep

    def _left_waiting(self, reqs: list[Request]) -> None:
        """``reqs`` left the queue (admitted, aborted or failed while waiting): waiting_load drops."""
        if reqs:
            tokens = sum(_waiting_cost(r) for r in reqs)
            with self._lock:
                self._waiting -= len(reqs)
                self._waiting_tokens -= tokens


def _waiting_cost(req: Request) -> int:
    """A queued request's tokens in waiting_load: its prompt to prefill and the output it may ask for."""
    return len(req.prompt_ids) + req.params.max_tokens
