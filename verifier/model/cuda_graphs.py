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
previous error during capture"; see ``_build``.) Prefill stays eager: its length varies per prompt.

``static_forward`` runs exactly the padded computation a graph replays, without capturing, so the
padding logic is tested on the CPU (tests/verifier/test_cuda_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from .kv_cache import KVCache
from .transformer import ForwardBatch, Transformer

log = logging.getLogger(__name__)


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
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    ids: Tensor  # [B, K] int64
    positions: Tensor  # [B, K] int64
    write_rows: Tensor  # [B, K] int64
    slots: Tensor  # [B] int64
    mask: Tensor  # [B, K, L] bool
    pad_rows: Tensor  # [B, K] 0 .. K-1: the padding rows' positions and scratch-slot rows
    pad_mask: Tensor  # [B, K, L] the padding rows' pattern (attend to themselves)
    logits: Tensor | None = None  # [B, K, V] float32, written by replay


class GraphRunner:
    """Replays captured forwards for decode/verify steps; ``forward`` takes what the eager model
    takes (ids [bs, K] and a ForwardBatch with a mask) and returns logits [bs, K, V]. The returned
    tensor is the graph's output buffer: valid until the next forward."""

    def __init__(self, model: Transformer, cache: KVCache, max_batch: int, scratch_slot: int,
                 min_kv: int = 256, capture: bool = True, max_nodes: int = 16) -> None:
        if not 0 <= scratch_slot < cache.num_slots:
            raise ValueError(f"scratch_slot: expected a cache slot in [0, {cache.num_slots}), got {scratch_slot}")
        self.model, self.cache, self.scratch = model, cache, scratch_slot
        self.capture = capture and model.device.type == "cuda"
        self.batch_buckets = pow2_buckets(1, max_batch)
        self.kv_buckets = pow2_buckets(min(min_kv, cache.max_len), cache.max_len)
        self.node_buckets = pow2_buckets(1, max_nodes)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._warmed = False

    def kv_bucket(self, kv_len: int) -> int:
        return next_bucket(kv_len, self.kv_buckets)

    def nodes_bucket(self, K: int, room: int) -> int:
        """The bucket of K tree nodes when ``room`` cache rows are free after the longest prefix."""
        b = next_bucket(K, self.node_buckets) if K <= self.node_buckets[-1] else K
        return b if b <= room else K

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, fb: ForwardBatch) -> Tensor:
        if fb.mask is None:
            raise ValueError("GraphRunner: decode/verify forwards need an explicit mask (prefill runs eagerly)")
        bs, K = input_ids.shape
        B, L = next_bucket(bs, self.batch_buckets), self.kv_bucket(fb.kv_len)
        g = self._graphs.get((B, K, L))
        if g is None:
            g = self._graphs[(B, K, L)] = self._build(B, K, L)
        self._load(g, input_ids, fb, bs, L)
        if g.graph is None:  # CPU (tests): the same padded computation, eagerly
            g.logits = self._run(g, L)
        else:
            g.graph.replay()
        return g.logits[:bs]

    def _load(self, g: _Graph, input_ids: Tensor, fb: ForwardBatch, bs: int, L: int) -> None:
        g.ids[:bs].copy_(input_ids)
        g.positions[:bs].copy_(fb.positions)
        g.write_rows[:bs].copy_(fb.write_rows)
        g.slots[:bs].copy_(fb.slots)
        m = fb.mask
        if m.shape[-1] == L:
            g.mask[:bs].copy_(m)
        else:
            g.mask[:bs, :, :m.shape[-1]].copy_(m)
            g.mask[:bs, :, m.shape[-1]:].fill_(False)
        if bs < g.ids.shape[0]:  # rows a larger batch left behind: back to padding
            g.ids[bs:].zero_()
            g.positions[bs:].copy_(g.pad_rows[bs:])
            g.write_rows[bs:].copy_(g.pad_rows[bs:])
            g.slots[bs:].fill_(self.scratch)
            g.mask[bs:].copy_(g.pad_mask[bs:])

    def _run(self, g: _Graph, L: int) -> Tensor:
        fb = ForwardBatch(g.positions, g.write_rows, g.slots, L, g.mask, None)
        return self.model(g.ids, self.cache, fb)

    def _build(self, B: int, K: int, L: int) -> _Graph:
        dev = self.model.device
        rows = torch.arange(K, device=dev).expand(B, K).contiguous()
        pad_mask = torch.zeros(B, K, L, dtype=torch.bool, device=dev)
        pad_mask[:, torch.arange(K), torch.arange(K)] = True  # a padding node attends to itself only
        g = _Graph(None, torch.zeros(B, K, dtype=torch.int64, device=dev), rows.clone(), rows.clone(),
                   torch.full((B,), self.scratch, dtype=torch.int64, device=dev), pad_mask.clone(),
                   pad_rows=rows, pad_mask=pad_mask)
        if not self.capture:
            return g
        # Warm up on a side stream (allocator and cuBLAS/SDPA workspaces), then capture. The
        # padding rows write only into the scratch slot, so neither touches a request's K/V.
        # The first capture of a process also gets one forward on the current stream first: a
        # capture that was the process's first CUDA work (the engine's cost probe runs before any
        # prefill) was invalidated on the device, while captures after eager forwards never were.
        if not self._warmed:
            self._run(g, L)
            torch.cuda.synchronize(dev)
            self._warmed = True
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(g, L)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            g.logits = self._run(g, L)
        g.graph = graph
        log.debug("captured a CUDA graph for batch %d, %d nodes, %d cache rows", B, K, L)
        return g
