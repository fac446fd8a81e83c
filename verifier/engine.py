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
from dataclasses import dataclass

import numpy as np
import torch

from . import kernels
from .budget import BudgetPolicy, CostModel
from .cost_probe import measure_cost_model
from .drafter import Drafter
from .grammar import GrammarCompiler, finish_if_complete, mask_logits, prune_drafts, settle
from .logprobs import row_logprobs
from .model import ForwardBatch, KVCache, TextCodec, Transformer
from .model.cuda_graphs import GraphRunner
from .numerics import error_message, nonfinite_rows
from .penalties import process_logits
from .request import Request, Status, append_tokens
from .sampling import SamplingParams, sample, target_probs
from .scheduler import Scheduler
from .tree_batch import build_tree_batch, prune_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch: int = 8  # KV-cache slots = requests decoded together
    max_len: int = 2048  # tokens per request (prompt + output + draft nodes)
    budget: int | None = None  # draft nodes per request; None = adaptive (cost model + acceptance)
    max_budget: int = 15
    cost_probe_s: float = 10.0  # start-up time allowed for measuring the cost model
    cuda_graphs: bool = True  # replay captured graphs for decode/verify forwards (CUDA only)

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 4096:
            raise ValueError(f"max_batch: expected 1..4096, got {self.max_batch}")
        if not 16 <= self.max_len <= 1 << 20:
            raise ValueError(f"max_len: expected 16..2^20, got {self.max_len}")
        if not 1 <= self.max_budget <= kernels.MAX_NODES - 1:
            raise ValueError(f"max_budget: expected 1..{kernels.MAX_NODES - 1}, got {self.max_budget}")
        if self.budget is not None and not 0 <= self.budget <= self.max_budget:
            raise ValueError(f"budget: expected 0..max_budget ({self.max_budget}) or None (adaptive), got {self.budget}")


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0  # draft nodes verified
    accepted_tokens: int = 0
    spec_steps: int = 0  # request-steps that verified at least one draft node


class Engine:
    def __init__(self, model: Transformer, codec: TextCodec, drafter: Drafter | None,
                 config: EngineConfig = EngineConfig(), cost: CostModel | None = None) -> None:
        self.model, self.codec, self.drafter, self.config = model, codec, drafter, config
        mc = model.config
        self.device = model.device
        use_graphs = config.cuda_graphs and self.device.type == "cuda"
        # With graphs, one extra slot takes the K/V of the padding rows of a batch bucket.
        self.cache = KVCache(mc.num_layers, config.max_batch + use_graphs, config.max_len, mc.num_kv_heads,
                             mc.head_dim, self.device, model.dtype)
        self.graphs = None
        if use_graphs:
            self.graphs = GraphRunner(model, self.cache, config.max_batch, config.max_batch,
                                      max_nodes=config.max_budget + 1)
        self.scheduler = Scheduler(config.max_batch)
        self.eos_ids = tuple(codec.eos_token_ids or mc.eos_token_ids)
        self.grammars = GrammarCompiler(codec.tokenizer, mc.vocab_size, self.eos_ids)  # lazy: structured output
        fixed = 0 if drafter is None else config.budget
        if fixed is None and cost is None:
            cost = measure_cost_model(model, self.cache, config.max_batch, config.max_budget + 1,
                                      time_budget_s=config.cost_probe_s,
                                      forward=None if self.graphs is None else self.graphs.forward)
        self.policy = BudgetPolicy(config.max_budget, fixed, cost)
        if self.graphs is not None:
            self.policy.node_bucket = lambda k: self.graphs.nodes_bucket(k, config.max_len)
        self.stats = EngineStats()
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._live: dict[str, Request] = {}

    # ------------------------------------------------------------------ requests (thread-safe)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, req_id: str | None = None,
                    on_update=None, group: str | None = None) -> Request:
        """Validates and queues a request; ValueError says what is wrong with it."""
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt: expected a non-empty list of token ids")
        V = self.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < V for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be ints in [0, {V})")
        need = len(prompt_ids) + params.max_tokens + 1
        if need > self.config.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model length of this server ({self.config.max_len - 1} tokens)")
        req = Request(req_id or f"req-{next(self._ids)}", [int(t) for t in prompt_ids], params, on_update, group=group)
        if params.grammar is not None:
            req.grammar = self.grammars.matcher(params.grammar)
        if params.temperature > 0:
            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        with self._lock:
            if req.req_id in self._live:
                raise ValueError(f"request id '{req.req_id}' is already live")
            self._live[req.req_id] = req
            self._inbox.append(req)
        return req

    def abort(self, req_id: str) -> None:
        with self._lock:
            self._aborts.append(req_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts) or self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Request]:
        """One engine step: admit + prefill newcomers, then one verify step over the running batch.
        Returns the requests that got tokens or finished."""
        t0 = time.perf_counter()
        updated = self._take_inbox()
        for req in self.scheduler.admit():
            self._prefill(req)
            updated.append(req)
        running = [r for r in self.scheduler.running if not r.finished]
        if running:
            self._verify_step(running)
            updated.extend(running)
        for req in self.scheduler.release_finished():
            if self.drafter is not None:
                self.drafter.finish(req.req_id)
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
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
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    def fail_all(self, error: str) -> None:
        """After an internal error: finish every live request with finish_reason "error"."""
        self._take_inbox()
        reqs = list(self.scheduler.waiting) + self.scheduler.running
        self.scheduler.waiting.clear()
        for req in reqs:
            if not req.finished:
                req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
        for req in self.scheduler.release_finished():
            if self.drafter is not None:
                self.drafter.finish(req.req_id)
        with self._lock:
            for req in reqs:
                self._live.pop(req.req_id, None)
        for req in reqs:
            if req.on_update is not None:
                req.on_update(req)

    def _take_inbox(self) -> list[Request]:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = set(self._aborts), deque()
        for req in new:
            self.scheduler.add(req)
        done = []
        for req in list(self.scheduler.waiting) + self.scheduler.running:
            if req.req_id in aborts and not req.finished:
                req.status, req.finish_reason, req.finished_at = Status.FINISHED, "abort", time.monotonic()
                done.append(req)
        self.scheduler.waiting = deque(r for r in self.scheduler.waiting if not r.finished)
        return done

    def _prefill(self, req: Request) -> None:
        n = len(req.prompt_ids)
        dev = self.device
        rows = torch.arange(n, device=dev)[None]
        fb = ForwardBatch(rows, rows, torch.tensor([req.slot], device=dev), n, None, (req.slot, 1))
        logits = self.model(torch.tensor([req.prompt_ids], device=dev), self.cache, fb, last_only=True)[:, 0]
        bad = nonfinite_rows(logits)
        process_logits(logits[:, None], [req], logits.new_zeros(1, 1, dtype=torch.int64),
                       torch.ones(1, 1, 1, dtype=torch.bool, device=dev), self.eos_ids)
        mask_logits([req], None, logits)
        first = self._sample_one(logits, [req])
        req.cache_len = n
        self.stats.prefill_tokens += n
        if self.drafter is not None:
            self.drafter.start_request(req.req_id, req.prompt_ids, group=req.group)
        self._commit_path(req, [first], logits, [0], bad.tolist())
        if bad.any():
            self.cache.clear(req.slot)

    def _sample_one(self, logits: torch.Tensor, reqs: list[Request]) -> int:
        req = reqs[0]
        p = req.params
        if p.greedy:
            return int(logits[0].argmax())
        probs = target_probs(logits, *self._param_tensors([req], 1))
        return int(sample(probs, torch.rand(1, generator=req.generator).to(probs.device))[0])

    def _param_tensors(self, reqs: list[Request], K: int):
        dev = self.device
        temp = torch.tensor([max(r.params.temperature, 1e-6) for r in reqs], device=dev).repeat_interleave(K)
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev).repeat_interleave(K)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev).repeat_interleave(K)
        return temp, top_k, top_p

    def _commit_path(self, req: Request, tokens: list[int], logits: torch.Tensor, path: list[int], bad: list[bool]) -> int:
        """Commits tokens chosen from logits [K, V] rows ``path`` (one each) up to the first
        non-finite row, which fails the request (``verifier.numerics``); returns how many were committed."""
        m = bad.index(True) if True in bad else len(tokens)
        lps = [] if req.params.logprobs is None else row_logprobs(logits[path[:m]], tokens[:m], [req.params.logprobs] * m)
        committed = self._commit(req, tokens[:m], lps)
        if m < len(tokens) and not req.finished:
            req.status, req.finish_reason, req.finished_at = Status.FINISHED, "error", time.monotonic()
            req.error = error_message(len(req.output_ids))
            log.warning("request %s: %s", req.req_id, req.error)
        return committed

    def _commit(self, req: Request, tokens: list[int], logprobs: list | None = None) -> int:
        """Appends tokens up to a stop; returns how many were committed."""
        before = len(req.output_ids)
        append_tokens(req, settle(req, tokens), self.eos_ids, self.codec.decode)
        finish_if_complete(req, self.codec.decode)
        committed = req.output_ids[before:]
        req.logprobs.extend((logprobs or [])[:len(committed)])
        self.stats.generated_tokens += len(committed)
        if self.drafter is not None:
            self.drafter.extend(req.req_id, committed)
        return len(committed)

    def _drafts(self, running: list[Request]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
        drafts = [empty] * len(running)
        budget = self.policy.draft_budget(len(running)) if self.drafter is not None else 0
        spec = [i for i, r in enumerate(running) if r.params.speculate]
        if budget <= 0 or not spec:
            return drafts
        batch = self.drafter.draft([running[i].req_id for i in spec], budget)
        for j, i in enumerate(spec):
            n = int(batch.counts[j])
            drafts[i] = (batch.tokens[j, :n].astype(np.int64), batch.parents[j, :n].astype(np.int64), batch.probs[j, :n])
        drafts = prune_drafts(running, drafts)  # structured output: nodes the grammar rejects cost nothing
        k = self.policy.choose_nodes([d[2] for d in drafts])
        room = min(self.config.max_len - r.cache_len - 1 for r in running)  # rows prefix .. prefix + K - 1
        return [prune_tree(*d, max(0, min(k, room))) for d in drafts]

    def _verify_step(self, running: list[Request], plain: frozenset[str] = frozenset()) -> None:
        dev = self.device
        t0 = time.perf_counter()  # the step's wall time, drafting included, feeds the budget policy
        drafts = self._drafts(running)
        if plain:  # a retry after non-finite logits: these requests verify no draft this step
            drafts = [(d[0][:0], d[1][:0], d[2][:0]) if r.req_id in plain else d for r, d in zip(running, drafts)]
        slots = [r.slot for r in running]
        K_min = 1
        if self.graphs is not None:  # pad to the graph bucket where the padding rows fit
            K_min = self.graphs.nodes_bucket(1 + max(len(d[0]) for d in drafts),
                                             self.config.max_len - max(r.cache_len for r in running))
        tb = build_tree_batch([r.last_token for r in running], drafts, [r.cache_len for r in running], dev, slots,
                              K_min)
        bs, K = tb.tokens.shape
        consecutive = slots == list(range(slots[0], slots[0] + bs))
        write_rows = tb.prefix_lens[:, None] + torch.arange(K, device=dev)
        kv_len = max(r.cache_len for r in running) + K
        if self.graphs is not None:
            kv_len = self.graphs.kv_bucket(kv_len)
        fb = ForwardBatch(tb.indices.positions.view(bs, K), write_rows, tb.slots, kv_len,
                          kernels.tree_attention_mask(tb.mask, tb.prefix_lens, kv_len),
                          (slots[0], bs) if consecutive else None)
        logits = self.model(tb.tokens, self.cache, fb) if self.graphs is None else self.graphs.forward(tb.tokens, fb)
        bad = nonfinite_rows(logits)  # before penalties: min_tokens puts -inf in on purpose
        process_logits(logits, running, tb.tokens, tb.mask, self.eos_ids)
        mask_logits(running, drafts, logits)  # structured output: each node's grammar mask
        idx = tb.indices
        if all(r.params.greedy for r in running):
            res = kernels.verify_tree_greedy(tb.tokens, idx.retrive_index, idx.retrive_next_token,
                                             idx.retrive_next_sibling, logits.argmax(-1), K)
        else:
            res = self._verify_sampled(running, tb, logits)
        if K > 1:  # with the root alone there is nothing to move
            self.cache.keep_accepted(fb.slots, tb.prefix_lens, K, res.accept_index, res.accept_token_num)
        # One device-to-host copy (each copy is a sync): accept_index [bs, K], num [bs], predicts [bs*K], bad [bs, K].
        parts = (res.accept_index, res.accept_token_num, res.predicts, bad)
        host = torch.cat([t.reshape(-1).long() for t in parts]).cpu().split([t.numel() for t in parts])
        accept_index, num, predicts = host[0].view(res.accept_index.shape), host[1], host[2]
        bad = host[3].view(bs, K).bool()
        tokens = tb.tokens_host
        self.policy.observe_step(K > 1, time.perf_counter() - t0, bs * K)
        bad_any = bad.any(-1).tolist()
        # A draft node's NaN K/V reaches every row of its request (masked columns get weight 0, and
        # 0 * NaN = NaN), so such a request verifies the step again without drafts, as plain decoding would.
        retry = frozenset(r.req_id for b, r in enumerate(running) if tb.num_nodes[b] > 1 and bad_any[b])
        if retry:
            for r in running:
                if r.req_id in retry:
                    self.cache.clear(r.slot, r.cache_len)
            return self._verify_step(running, plain | retry)
        accepted_total = 0
        for b, req in enumerate(running):
            n = int(num[b])
            nodes = (accept_index[b, 1:1 + n].long() - b * K).tolist()
            new = [int(tokens[b, i]) for i in nodes] + [int(predicts[int(accept_index[b, n])])]
            path = [0] + nodes  # emitted token j was chosen from the logits of path node j
            req.cache_len += 1 + n
            req.verify_steps += 1
            req.draft_tokens += tb.num_nodes[b] - 1
            accepted_total += n
            self.stats.spec_steps += tb.num_nodes[b] > 1
            # Usage counts accepted tokens that were committed (a stop can cut the path short).
            req.accepted_tokens += min(n, self._commit_path(req, new, logits[b], path, bad[b, path].tolist()))
            if bad_any[b]:  # NaN K/V in masked rows would still reach attention (0 * NaN)
                self.cache.clear(req.slot, 0 if req.finish_reason == "error" else req.cache_len)
        self.stats.draft_tokens += sum(tb.num_nodes) - bs
        self.stats.accepted_tokens += accepted_total
        if K > 1:
            self.policy.observe(tb.predicted, accepted_total)

    def _verify_sampled(self, running: list[Request], tb, logits: torch.Tensor):
        """Exact tree rejection sampling; greedy rows use one-hot targets (the same as greedy)."""
        bs, K, V = logits.shape
        flat = logits.reshape(bs * K, V)
        probs = target_probs(flat, *self._param_tensors(running, K))
        greedy = torch.tensor([r.params.greedy for r in running], device=self.device).repeat_interleave(K)
        one_hot = torch.zeros_like(probs).scatter_(1, flat.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs).view(bs, K, V)
        coins, final = [], []
        for r in running:
            g = r.generator
            coins.append(torch.rand(K, generator=g) if g is not None else torch.zeros(K))
            final.append(torch.rand(1, generator=g) if g is not None else torch.zeros(1))
        idx = tb.indices
        return kernels.tree_speculative_sampling(
            tb.tokens, idx.retrive_index, idx.retrive_next_token, idx.retrive_next_sibling,
            torch.stack(coins).to(self.device), torch.cat(final).to(self.device), probs, K)
