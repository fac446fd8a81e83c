"""CUDA graphs for decode/verify forwards: one graph per (batch bucket, nodes per request, KV bucket).

An eager forward of a small model is bound by the host, not the GPU: every layer launches a
dozen kernels from Python, so SmolLM2-135M (30 layers) costs tens of milliseconds per step while
its weights take about 0.1 ms to read. Replaying a captured graph launches the whole forward at
once.

A graph has fixed shapes, so a step is padded to its bucket:
- batch rows: padded to the next bucket (1, 2, 4, ... up to max_batch); padding rows write their
  K/V into a scratch slot that no request owns (the cache has one slot more than max_batch) and
  attend only to themselves, so they never touch a request's rows;
- nodes per request K: the next node bucket (1, 2, 4, 8, 16, ...; the engine pads the tree with
  isolated nodes, never verified, written to the request's own rows past its tree), or exact
  near the end of max_len where the padding rows would not fit;
- attended cache rows: the next KV bucket (powers of two from ``min_kv``, capped at max_len); the
  step's mask is False beyond its real rows, so the extra rows cost bandwidth, never correctness.

Graphs are captured lazily, the first time their shape is seen (tens of milliseconds each; the
node buckets keep the number of shapes small), and share one memory pool. (Capturing every bucket
at engine start, before any eager forward, failed once on the device: "operation failed due to a
previous error during capture"; see ``_capture``.)

Prefills replay graphs too, one per (prompts, length) bucket: up to N prompts (a power of two) of
at most T tokens each (a power of two up to ``max_prefill``), N x T within ``prefill_tokens``. An
eager prefill of SmolLM2 costs ~21 ms of kernel launches from Python whatever its size (measured on
the H200 host), against 1.2-2.6 ms of GPU work for up to 8,192 tokens; a prompt longer than the
largest bucket still prefills eagerly.

Every verify step runs through the same two parts (module functions below), whatever its path:
- ``forward_part``: the packed step input (``verifier.step._native.pack_plan``'s layout: tokens,
  parents, prefix lens, cache slots) -> tree indices, attention mask, forward -> logits;
- ``greedy_tail``: argmax and non-finite check, greedy tree verification, KV compaction, the
  results packed for one copy to the host.
A greedy step whose logits need no processing is both parts captured as one graph; any other step
(penalties, grammar masks, logprobs' processing, sampling) replays the forward part as a graph and
processes the logits eagerly. Without capture (the CPU, tests) the runner runs the same functions
eagerly on the same padded input, and an engine without a runner calls them on its exact shapes.

A step's input is packed by the host straight into its graph's pinned staging buffer
(``step_input``, then ``launch_input`` or ``launch_forward``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

import numpy as np

from .. import kernels
from ..model.kv_cache import KVCache
from ..model.transformer import ForwardBatch, Transformer
from . import reference

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool):
    """A capture that nothing else can invalidate: the garbage collector stays off inside it (a
    collected engine's graphs and pools free device memory, which is illegal mid-capture; this
    broke captures on the device once earlier engines of the same process became garbage), and
    other threads' CUDA calls do not count against it (capture_error_mode="thread_local")."""
    enabled = gc.isenabled()
    gc.disable()  # torch.cuda.graph itself collects once before it begins capturing
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


def next_bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclass
class StepForward:
    """The forward part's outputs for B rows of K nodes (``forward_part``); a forward graph's
    buffers, valid until its next replay."""

    tokens: Tensor  # [B, K] int64
    prefix: Tensor  # [B] int64 cache rows before each tree
    slots: Tensor  # [B] int64
    tree_mask: Tensor  # [B, K, K] bool ancestor-or-self
    idx: kernels.TreeIndices
    logits: Tensor  # [B, K, V]

    def rows(self, bs: int) -> "StepForward":
        """The first bs rows (a graph bucket's padding rows left out)."""
        if bs == self.tokens.shape[0]:
            return self
        i = self.idx
        return StepForward(self.tokens[:bs], self.prefix[:bs], self.slots[:bs], self.tree_mask[:bs],
                           kernels.TreeIndices(i.positions.view(self.tokens.shape)[:bs].reshape(-1),
                                               *(t[:bs] for t in i[1:])), self.logits[:bs])


@torch.inference_mode()
def forward_part(model: Transformer, cache: KVCache, inp: Tensor, B: int, K: int, L: int, float_logits: bool = True,
                 slot_range: tuple[int, int] | None = None) -> StepForward:
    """A verify step's forward from its packed input ``inp`` [2 B K + 2 B] (tokens, parents,
    prefix lens, slots; ``tree_batch.PackedTrees``' layout): tree indices and mask, then the
    forward attending L cache rows. ``float_logits``: float32 logits (processing and sampling
    read them); the greedy tail reads the model's dtype as it is. ``slot_range``: the slots are
    consecutive (a view instead of a gather; eager steps only, a graph's slots are data)."""
    m = B * K
    tokens, parents = inp[:m].view(B, K), inp[m:2 * m].view(B, K)
    prefix, slots = inp[2 * m:2 * m + B], inp[2 * m + B:2 * m + 2 * B]
    tree_mask, idx = kernels.tree_indices_from_parents(parents, prefix)
    write_rows = prefix[:, None] + torch.arange(K, device=prefix.device)
    # No node attends past its tree (prefix + K rows): the attention reads a short request's own
    # rows, not the KV bucket its batch's longest request sets.
    fb = ForwardBatch(idx.positions.view(B, K), write_rows, slots, L, kernels.tree_attention_mask(tree_mask, prefix, L),
                      slot_range, kv_lens=prefix + K)
    logits = model(tokens, cache, fb, float_logits=float_logits)
    return StepForward(tokens, prefix, slots, tree_mask, idx, logits)


def keep_accepted(cache: KVCache, f: StepForward, res) -> None:
    """The accepted path's K/V moved to the rows after each prefix (``KVCache.keep_accepted``)."""
    K = f.tokens.shape[1]
    if K > 1:  # with the root alone there is nothing to move
        cache.keep_accepted(f.slots, f.prefix, K, res.accept_index, res.accept_token_num)


@torch.inference_mode()
def greedy_tail(cache: KVCache, f: StepForward) -> Tensor:
    """A greedy step after its forward part: argmax and non-finite check (one kernel on CUDA; the
    reference on the CPU, or without the library), tree verification and KV compaction; returns
    the results packed (``GreedyStepResult.pack``)."""
    K = f.tokens.shape[1]
    native = not f.logits.is_cuda or kernels.native_available()
    predict, bad = kernels.argmax_rows(f.logits) if native else reference.argmax_rows(f.logits)
    i = f.idx
    res = kernels.verify_tree_greedy(f.tokens, i.retrive_index, i.retrive_next_token, i.retrive_next_sibling, predict, K)
    keep_accepted(cache, f, res)
    return GreedyStepResult.pack(res.accept_index, res.accept_token_num, res.predicts, bad)


@dataclass
class _StepGraph:
    """A verify step's graph: packed trees in; a greedy step's verification results out (the
    forward part and the greedy tail), or a forward graph's ``StepForward`` (the forward part)."""

    graph: torch.cuda.CUDAGraph | None
    inp: Tensor  # [2 B K + 2 B] int64: tokens, parents, prefix lens, slots (tree_batch.PackedTrees)
    # The same on the host (pinned with CUDA): the step's one host-to-device copy. Two, used in
    # turn: with overlapped steps the host fills the next step's input while the previous copy
    # from the other one may still be queued.
    staging: list[Tensor]
    out: Tensor | None = None  # [3 B K + B] int64: accept_index, accept_token_num, predicts, bad
    logits: Tensor | None = None  # [B, K, V] in the model's dtype
    host_out: list[Tensor] | None = None  # CUDA: two pinned copies of ``out``, used in turn
    fwd: StepForward | None = None  # a forward graph's outputs (float32 logits)


@dataclass
class StepLaunch:
    """A greedy step enqueued on the device (``GraphRunner.launch_greedy_step``) whose results
    have not been read yet (``GraphRunner.collect``)."""

    B: int
    K: int
    bs: int
    out: Tensor  # the results: a pinned host copy, complete once ``event`` is (CUDA), or on the CPU
    event: torch.cuda.Event | None
    logits: Tensor  # [B, K, V]: the graph's buffer, overwritten by its next replay
    dev_out: Tensor  # the results on the device: a later step's input tokens can come from them


@dataclass
class StepInput:
    """A step's pinned input buffer (``GraphRunner.step_input``), filled by the host before
    ``GraphRunner.launch_input`` (a greedy step) or ``launch_forward`` (a forward graph):
    ``host`` = tokens [B, K], parents [B, K], prefix lens [B], cache slots [B]
    (``tree_batch.PackedTrees``' layout for the bucket's B rows; rows past the batch are padding)."""

    B: int
    K: int
    L: int
    host: np.ndarray
    graph: "_StepGraph"
    turn: int
    forward_only: bool = False


@dataclass
class _PrefillGraph:
    """A causal prefill of up to N prompts right-padded to a length bucket T: ids in, each
    prompt's last position's logits out. Rows past the real prompts write the scratch slot."""

    graph: torch.cuda.CUDAGraph | None
    inp: Tensor  # [N T + 2 N] int64: the prompts (each padded with its last token), their slots, their last indices
    staging: Tensor  # the same on the host (pinned with CUDA)
    logits: Tensor | None = None  # [N, V] float32


@dataclass
class GreedyStepResult:
    accept_index: np.ndarray  # [bs, K] flat node indices b * K + i of the accepted path (root first)
    accept_token_num: np.ndarray  # [bs] accepted draft tokens
    predicts: np.ndarray  # [bs * K] the target's token after each node
    bad: np.ndarray  # [bs, K] bool: that node's logits had a NaN or inf (zeroed)
    logits: Tensor  # [bs, K, V] float32 (a greedy step graph's: the model's dtype), valid until the next forward

    @staticmethod
    def pack(accept_index: Tensor, accept_token_num: Tensor, predicts: Tensor, bad: Tensor) -> Tensor:
        """The verification results of B rows as one int64 tensor (one copy to the host)."""
        return torch.cat([accept_index.reshape(-1).long(), accept_token_num.reshape(-1).long(),
                          predicts.reshape(-1).long(), bad.reshape(-1).long()])

    @classmethod
    def unpack(cls, flat: np.ndarray, B: int, K: int, bs: int, logits: Tensor) -> "GreedyStepResult":
        """``pack``'s layout on the host, first ``bs`` of its B rows."""
        n = B * K
        return cls(flat[:n].reshape(B, K)[:bs], flat[n:n + B][:bs], flat[n + B:2 * n + B][:bs * K],
                   flat[2 * n + B:].reshape(B, K)[:bs].astype(bool), logits[:bs])


class GraphRunner:
    """Replays captured decode/verify steps (greedy steps and forward graphs, both from packed
    step input) and prefills."""

    def __init__(self, model: Transformer, cache: KVCache, max_batch: int, scratch_slot: int,
                 min_kv: int = 256, capture: bool = True, max_nodes: int = 16, max_prefill: int = 2048,
                 prefill_tokens: int = 8192) -> None:
        if not 0 <= scratch_slot < cache.num_slots:
            raise ValueError(f"scratch_slot: expected a cache slot in [0, {cache.num_slots}), got {scratch_slot}")
        self.model, self.cache, self.scratch = model, cache, scratch_slot
        self.upload_at_capture = True  # see _capture (bench/step_profile.py can turn it off to compare)
        self.capture = capture and model.device.type == "cuda"
        self.batch_buckets = pow2_buckets(1, max_batch)
        self.kv_buckets = pow2_buckets(min(min_kv, cache.max_len), cache.max_len)
        self.node_buckets = pow2_buckets(1, max_nodes)
        self._steps: dict[tuple[int, int, int], _StepGraph] = {}  # greedy steps
        self._forwards: dict[tuple[int, int, int], _StepGraph] = {}  # forward graphs (logits processed eagerly)
        self._prefills: dict[tuple[int, int], _PrefillGraph] = {}
        # Prefills replay as graphs up to this many tokens per prompt (the bucket's): an eager
        # prefill of a small model is bound by launching ~450 kernels from Python (21-25 ms for
        # SmolLM2 on the H200 host), its GPU work by far less.
        self.prefill_buckets = pow2_buckets(min(16, cache.max_len), min(max_prefill, cache.max_len))
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens: expected >= 1, got {prefill_tokens}")
        self.prefill_tokens = prefill_tokens
        self.max_batch = max_batch
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._warmed = False
        self._launches = 0  # greedy-step launches: they take the two staging/result buffers in turn
        self.wait_seconds = 0.0  # host time blocked in collect(): the GPU had not finished the step

    def kv_bucket(self, kv_len: int) -> int:
        return next_bucket(kv_len, self.kv_buckets)

    def nodes_bucket(self, K: int, room: int) -> int:
        """The bucket of K tree nodes when ``room`` cache rows are free after the longest prefix."""
        b = next_bucket(K, self.node_buckets) if K <= self.node_buckets[-1] else K
        return b if b <= room else K

    @property
    def num_graphs(self) -> int:
        return len(self._forwards) + len(self._steps) + len(self._prefills)

    def prefill_bucket(self, T: int) -> int | None:
        """The padded length of a prefill of prompts of at most T tokens, or None: too long for a graph."""
        return next_bucket(T, self.prefill_buckets) if T <= self.prefill_buckets[-1] else None

    def max_prefill_prompts(self, T: int) -> int:
        """How many prompts of length bucket T one prefill graph takes: N x T within
        ``prefill_tokens`` (one at least) and no more than the batch."""
        return max(1, min(self.max_batch, self.prefill_tokens // T))

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (prompts, length) bucket a prefill graph can have."""
        return [(N, T) for T in self.prefill_buckets for N in pow2_buckets(1, self.max_prefill_prompts(T))]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> Tensor:
        """Causal prefill of the prompts into their cache slots, replayed as the graph of their
        (prompts, length) bucket; returns each prompt's last position's logits [n, V] (the graph's
        buffer: valid until the next prefill of that bucket). Rows past a prompt, up to the length
        bucket, get the K/V of padding that repeats its last token (finite where the prompt is):
        masks never look there and decoding overwrites them."""
        n = len(prompts)
        T = max((len(p) for p in prompts), default=0)
        Tb = self.prefill_bucket(T)
        if Tb is None or n == 0 or min(map(len, prompts)) < 1:
            raise ValueError(f"GraphRunner.prefill: expected prompts of 1..{self.prefill_buckets[-1]} tokens, "
                             f"got {n} prompts of up to {T}")
        if n != len(slots) or n > self.max_prefill_prompts(Tb):
            raise ValueError(f"GraphRunner.prefill: expected 1..{self.max_prefill_prompts(Tb)} prompts of "
                             f"{Tb} tokens with one slot each, got {n} prompts and {len(slots)} slots")
        N = next_bucket(n, pow2_buckets(1, self.max_prefill_prompts(Tb)))
        g = self._prefills.get((N, Tb))
        if g is None:
            g = self._prefills[(N, Tb)] = self._build_prefill(N, Tb)
        dst = g.staging.numpy()
        ids = dst[:N * Tb].reshape(N, Tb)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
            ids[i, len(p):] = p[-1]
        ids[n:] = 0  # padding prompts: one token repeated, in the scratch slot
        dst[N * Tb:N * Tb + n] = slots
        dst[N * Tb + n:N * Tb + N] = self.scratch
        dst[N * Tb + N:N * Tb + N + n] = [len(p) - 1 for p in prompts]
        dst[N * Tb + N + n:] = 0
        g.inp.copy_(g.staging, non_blocking=True)
        if g.graph is None:
            g.logits = self._run_prefill(g, N, Tb)
        else:
            g.graph.replay()
        return g.logits[:n]

    @torch.inference_mode()
    def capture_prefills(self) -> int:
        """Captures the prefill graph of every (prompts, length) bucket; returns how many exist."""
        if self.capture:
            for N, Tb in self.prefill_shapes():
                if (N, Tb) not in self._prefills:
                    self._prefills[(N, Tb)] = self._build_prefill(N, Tb)
        return len(self._prefills)

    def _run_prefill(self, g: _PrefillGraph, N: int, Tb: int) -> Tensor:
        ids, slots, last = g.inp[:N * Tb].view(N, Tb), g.inp[N * Tb:N * Tb + N], g.inp[N * Tb + N:]
        rows = torch.arange(Tb, device=ids.device).expand(N, Tb)
        return self.model(ids, self.cache, ForwardBatch(rows, rows, slots, Tb, None), last_index=last)[:, 0]

    def _build_prefill(self, N: int, Tb: int) -> _PrefillGraph:
        staging = torch.zeros(N * Tb + 2 * N, dtype=torch.int64, pin_memory=self.capture)
        staging[N * Tb:N * Tb + N] = self.scratch  # warm-ups and capture write into the scratch slot only
        g = _PrefillGraph(None, staging.to(self.model.device), staging)
        if self.capture:
            g.graph, g.logits = self._capture(lambda: self._run_prefill(g, N, Tb))
            log.debug("captured a prefill graph for %d prompts of %d tokens", N, Tb)
        return g

    @torch.inference_mode()
    def capture_greedy_steps(self, node_buckets: tuple[int, ...] | None = None) -> int:
        """Captures the greedy-step graph of every (batch, nodes, KV) bucket up front, so that no
        step of a request pays for a capture (tens of milliseconds each); returns how many."""
        return self._capture_buckets(self._steps, node_buckets, forward_only=False)

    def capture_forward_steps(self, node_buckets: tuple[int, ...] | None = None) -> int:
        """Captures the forward graph of every (batch, nodes, KV) bucket up front: steps whose
        logits are processed or sampled replay these (``step_input(forward_only=True)``). Captured
        lazily instead, a rollout batch (shrinking batches, growing prefixes, tree sizes chosen per
        step) met a new shape every few dozen steps, each capture ~25-60 ms on the H200 (SmolLM2,
        up to a third of a step's host time); returns how many there are."""
        return self._capture_buckets(self._forwards, node_buckets, forward_only=True)

    def _capture_buckets(self, graphs: dict, node_buckets: tuple[int, ...] | None, forward_only: bool) -> int:
        """Every (batch, nodes, KV) bucket's graph of one kind captured into ``graphs``; their count."""
        if not self.capture:
            return 0
        for B in self.batch_buckets:
            for K in node_buckets or self.node_buckets:
                for L in self.kv_buckets:
                    if K <= L and (B, K, L) not in graphs:
                        graphs[(B, K, L)] = self._build_step(B, K, L, forward_only)
        return len(graphs)

    @property
    def captures(self) -> int:
        """Graphs captured so far (a step that captured one took longer than its replays will)."""
        return len(self._forwards) + len(self._steps) + len(self._prefills)

    @torch.inference_mode()
    def greedy_step(self, host: np.ndarray, bs: int, K: int, kv_len: int, while_busy=None,
                    idle=None) -> GreedyStepResult:
        """A greedy verify step of ``bs`` requests with ``K`` nodes each (``host``: a
        ``tree_batch.PackedTrees.host``): tree indices, attention mask, forward, non-finite check,
        argmax, tree verification and KV compaction replay as one graph, between one copy in and
        one copy out. Per step, the host launches one graph instead of dozens of kernels.
        ``while_busy()``, if given, runs after the launch while the GPU works (before the copy out
        waits); ``idle``: see ``collect``."""
        launch = self.launch_greedy_step(host, bs, K, kv_len)
        if while_busy is not None:
            while_busy()
        return self.collect(launch, idle)

    def launch_greedy_step(self, host: np.ndarray, bs: int, K: int, kv_len: int,
                           tokens_from: StepLaunch | None = None) -> StepLaunch:
        """``greedy_step`` without waiting: the step and the copy of its results to the host are
        enqueued, ``collect`` reads them. ``tokens_from``: an earlier one-node step of the same
        requests whose predicted tokens are this step's input tokens, copied on the device (the
        host's tokens in ``host`` are ignored): plain decoding can run a step ahead of the host.
        Launches must be collected in order, at most one behind."""
        inp = self.step_input(bs, K, kv_len)
        self._load_step(inp, host, bs)
        return self.launch_input(inp, bs, tokens_from)

    def step_input(self, bs: int, K: int, kv_len: int, forward_only: bool = False) -> StepInput:
        """The input buffer of the next step of bs requests with K nodes each (its graph captured
        if it is new), for the host to fill: a greedy step's (``launch_input`` launches it), or
        with ``forward_only`` a forward graph's (``launch_forward``)."""
        B, L = next_bucket(bs, self.batch_buckets), self.kv_bucket(kv_len)
        graphs = self._forwards if forward_only else self._steps
        g = graphs.get((B, K, L))
        if g is None:
            g = graphs[(B, K, L)] = self._build_step(B, K, L, forward_only)
        turn = self._launches % 2
        return StepInput(B, K, L, g.staging[turn].numpy(), g, turn, forward_only)

    @torch.inference_mode()
    def launch_forward(self, inp: StepInput, bs: int) -> StepForward:
        """Runs a filled forward-only ``step_input`` (the forward part of the step); returns its
        first bs rows' outputs, on the device (the graph's buffers: valid until its next replay)."""
        if not inp.forward_only or inp.turn != self._launches % 2:
            raise RuntimeError("launch_forward: expected the latest forward-only step_input")
        g = inp.graph
        self._launches += 1
        g.inp.copy_(g.staging[inp.turn], non_blocking=True)  # ordered before the replay on this stream
        if g.graph is None:
            g.fwd = forward_part(self.model, self.cache, g.inp, inp.B, inp.K, inp.L, float_logits=False)
        else:
            g.graph.replay()
        return g.fwd.rows(bs)

    def forward_step(self, host: np.ndarray, bs: int, K: int, kv_len: int) -> Tensor:
        """The forward part of a step of bs rows (``host``: a ``tree_batch.PackedTrees.host`` of
        bs rows) replayed as its forward graph; returns the logits [bs, K, V] (in the model's
        dtype, as the LM head gave them: the graph's buffer). The start-up cost probe and the
        benchmarks time steps' forwards so."""
        inp = self.step_input(bs, K, kv_len, forward_only=True)
        self._load_step(inp, host, bs)
        return self.launch_forward(inp, bs).logits

    @torch.inference_mode()
    def launch_input(self, inp: StepInput, bs: int, tokens_from: StepLaunch | None = None) -> StepLaunch:
        """Launches a filled ``step_input`` for its first bs rows."""
        if inp.turn != self._launches % 2:
            raise RuntimeError("launch_input: another step was launched since this input was taken")
        if inp.forward_only:
            raise RuntimeError("launch_input: a forward-only step_input is launched by launch_forward")
        B, K, g = inp.B, inp.K, inp.graph
        self._launches += 1
        g.inp.copy_(g.staging[inp.turn], non_blocking=True)  # ordered before the replay on this stream
        if tokens_from is not None:
            if K != 1 or tokens_from.K != 1 or tokens_from.bs != bs:
                raise ValueError(f"tokens_from: expected a one-node step of {bs} requests, got "
                                 f"{tokens_from.bs} requests of {tokens_from.K} nodes (this step: {K} nodes)")
            Bp = tokens_from.B  # a one-node step's predictions follow accept_index [Bp] and accept_token_num [Bp]
            g.inp[:bs].copy_(tokens_from.dev_out[2 * Bp:2 * Bp + bs])
        if g.graph is None:
            g.logits, g.out = self._run_step(g, B, K, inp.L)
            return StepLaunch(B, K, bs, g.out, None, g.logits, g.out)
        return self._replay_step(g, inp.turn, B, K, bs)

    def _replay_step(self, g: _StepGraph, turn: int, B: int, K: int, bs: int) -> StepLaunch:
        g.graph.replay()
        host_out = g.host_out[turn]
        host_out.copy_(g.out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepLaunch(B, K, bs, host_out, event, g.logits, g.out)

    @torch.inference_mode()
    def collect(self, launch: StepLaunch, idle=None) -> GreedyStepResult:
        """Waits for a launched step and returns its results (the host's own copy). ``idle()``, if
        given, is host work done while the GPU still runs: called (each call waiting briefly for
        something to do) until it returns False or the step is done."""
        if launch.event is not None:
            t = time.perf_counter()
            if idle is not None:
                while not launch.event.query() and idle():
                    pass
            launch.event.synchronize()
            self.wait_seconds += time.perf_counter() - t
        return GreedyStepResult.unpack(launch.out.numpy().copy(), launch.B, launch.K, launch.bs, launch.logits)

    def _load_step(self, inp: StepInput, host: np.ndarray, bs: int) -> None:
        """Writes a ``PackedTrees.host`` of bs rows into the bucket's staging (padding rows after)."""
        dst, B, K = inp.host, inp.B, inp.K
        n, m = bs * K, B * K
        tokens, parents = dst[:m].reshape(B, K), dst[m:2 * m].reshape(B, K)
        tokens[:bs] = host[:n].reshape(bs, K)
        parents[:bs] = host[n:2 * n].reshape(bs, K)
        dst[2 * m:2 * m + bs] = host[2 * n:2 * n + bs]  # prefix lens
        dst[2 * m + B:2 * m + B + bs] = host[2 * n + bs:]  # slots
        if bs < B:  # padding rows: isolated nodes at position 0 of the scratch slot
            tokens[bs:] = 0
            parents[bs:] = -1
            dst[2 * m + bs:2 * m + B] = 0
            dst[2 * m + B + bs:] = self.scratch

    def _run_step(self, g: _StepGraph, B: int, K: int, L: int) -> tuple[Tensor, Tensor]:
        # Logits in the model's dtype: the argmax kernel reads them as they are (a float32 copy is
        # exact, so it would change nothing but the step's time); logprobs convert the rows they use.
        f = forward_part(self.model, self.cache, g.inp, B, K, L, float_logits=False)
        return f.logits, greedy_tail(self.cache, f)

    def _build_step(self, B: int, K: int, L: int, forward_only: bool = False) -> _StepGraph:
        dev = self.model.device
        size = 2 * B * K + 2 * B
        staging = torch.zeros(size, dtype=torch.int64, pin_memory=self.capture)
        staging[B * K:2 * B * K] = -1  # parents of isolated padding nodes
        staging[2 * B * K + B:] = self.scratch
        g = _StepGraph(None, staging.to(dev), [staging, staging.clone().pin_memory() if self.capture else staging.clone()])
        if not self.capture:
            return g
        # Warm-ups and capture run on the padding input above (every row in the scratch slot), so
        # no request's K/V moves.
        if forward_only:
            g.graph, g.fwd = self._capture(lambda: forward_part(self.model, self.cache, g.inp, B, K, L,
                                                                float_logits=False))
            log.debug("captured a forward graph for batch %d, %d nodes, %d cache rows", B, K, L)
            return g
        g.host_out = [torch.empty(3 * B * K + B, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        g.graph, (g.logits, g.out) = self._capture(lambda: self._run_step(g, B, K, L))
        log.debug("captured a greedy-step graph for batch %d, %d nodes, %d cache rows", B, K, L)
        return g

    def _capture(self, run):
        """Warms ``run`` up on a side stream (allocator and cuBLAS/SDPA workspaces), then captures
        it; returns (graph, what the captured run returned: the graph's output buffers).

        The first capture of a process also gets one run on the current stream first: a capture
        that was the process's first CUDA work (the engine's cost probe runs before any prefill)
        was invalidated on the device, while captures after eager forwards never were."""
        dev = self.model.device
        if not self._warmed:
            run()
            torch.cuda.synchronize(dev)
            self._warmed = True
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with _capturing(graph, self._pool):
            out = run()
        # An executable graph is uploaded to the device at its first launch, on the launching
        # thread: 0.3-0.9 ms of host time on the H200 machine (SmolLM2 steps), paid by the first
        # step of each (batch, nodes, cache) bucket. A short run meets dozens of buckets for the
        # first time, one per step while a batch drains at the end. One launch here, on the same
        # input as the warm-ups (padding rows in the scratch slot), pays it at capture instead.
        if self.upload_at_capture:
            graph.replay()
        return graph, out


def probe_native_linear(model: Transformer, cache: KVCache, slot: int, repeats: int = 30) -> dict[str, float]:
    """Times a one-token decode step (batch 1, a 256-row context, written to cache slot ``slot``)
    replayed as a CUDA graph with and without kernels.norm_linear, and sets
    ``model.native_linear`` to the faster. Returns both times in milliseconds.

    The fused kernel wins where a step is bound by its number of kernels (SmolLM2-135M on an H200:
    0.83x of the step time); on a large model cuBLAS's matmuls read the weights faster (the
    Llama-3-8B shape: 1.1-1.5x slower), so it is measured rather than assumed."""
    dev = model.device
    L = min(256, cache.max_len)
    pos = torch.full((1, 1), L - 1, dtype=torch.int64, device=dev)
    fb = ForwardBatch(pos, pos, torch.tensor([slot], dtype=torch.int64, device=dev), L,
                      torch.ones(1, 1, L, dtype=torch.bool, device=dev))
    ids = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    times = {}
    for native in (True, False):
        model.native_linear = native
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture stream (lazy initialisation)
            for _ in range(2):
                model(ids, cache, fb)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(ids, cache, fb)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(3):
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / repeats)
        times["native_ms" if native else "torch_ms"] = min(samples)
        del graph
    model.native_linear = times["native_ms"] <= times["torch_ms"]
    return times
