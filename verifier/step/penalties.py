"""Penalties and ``min_tokens`` on the logits of every tree node, so that they stay exact under
speculation.

Tree node i predicts the token after the path root -> i. Plain decoding would reach that
position having generated the path's draft tokens, so node i is penalized with the counts of the
request's tokens so far *plus the draft tokens on its path* (the root is the last committed token,
already counted). A token accepted earlier in the same step therefore counts for the nodes after
it, and the target of every node (greedy argmax or the rejection-sampling distribution) is the
one plain decoding would use at that position. Node i at depth d predicts output token
``len(output_ids) + d``; while that index is below ``min_tokens`` the stop tokens are masked.

Semantics (vLLM's): presence and frequency penalties count output tokens,
``logit -= frequency * count + presence * (count > 0)``; the repetition penalty applies to every
token in the prompt or the output, ``logit / r`` if positive else ``logit * r``.

The penalized requests of a step are processed together, in a fixed number of batched ops
whatever their number: per request, a dozen small ops (each a kernel launch and its Python) took
5.1 ms a step for 32 penalized requests of a batch of 64 on the H100, 0.27 ms batched
(``bench/penalties.py``, 2026-12-06).
Each request's output-token counts and prompt tokens live in one device matrix per engine, a row
per KV-cache slot (``PenaltyCounts``), brought up to date with the tokens committed since the
last step (output only grows) in one scatter for the whole batch.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import Tensor

from ..engine.request import Request

_serials = itertools.count(1)  # a request's claim on a slot's row (Request.penalty_state)


def needs_processing(req: Request) -> bool:
    p = req.params
    return p.penalized or len(req.output_ids) < p.min_tokens


class PenaltyCounts:
    """Per KV-cache slot: the output-token counts [slots, V] (float32) and the prompt's tokens as a
    mask [slots, V] of the request running in it, on the device, allocated at the first penalized
    request (``slots x V x 5`` bytes: 15.7 MB for 64 slots of SmolLM2's 49,152 tokens). A row
    belongs to the request whose serial (``Request.penalty_state``) it holds; another request in
    the slot starts it afresh."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots: expected >= 1, got {slots}")
        self.slots = slots
        self.counts: Tensor | None = None
        self.prompt: Tensor | None = None
        self._owner = [0] * slots  # the serial of the request each row counts for (0: none)
        self._counted = [0] * slots  # output tokens counted in each row
        self._ones: Tensor | None = None  # a scatter's addends (sliced: no fill per step)
        self._params: tuple[tuple, Tensor] | None = None  # the latest step's parameters on the device

    def rows(self, reqs: list[Request], V: int, dev: torch.device) -> Tensor:
        """The requests' slots as a device index, their rows brought up to date (one host-to-device
        copy and at most three scatters for all of them)."""
        if self.counts is None or self.counts.shape[1] != V or self.counts.device != dev:
            self.counts = torch.zeros(self.slots, V, dtype=torch.float32, device=dev)
            self.prompt = torch.zeros(self.slots, V, dtype=torch.bool, device=dev)
            self._owner = [0] * self.slots
        fresh: list[int] = []  # rows to clear
        marks: list[int] = []  # flat (slot, prompt token) indices to set
        adds: list[int] = []  # flat (slot, output token) indices to count
        for req in reqs:
            s = req.slot
            if not 0 <= s < self.slots:
                raise ValueError(f"penalties: request {req.req_id!r} holds slot {s}, expected 0..{self.slots - 1}")
            if req.penalty_state is None:
                req.penalty_state = next(_serials)
            if self._owner[s] != req.penalty_state:
                self._owner[s], self._counted[s] = req.penalty_state, 0
                fresh.append(s)
                if req.params.repetition_penalty != 1.0:  # the only reader of the prompt's row
                    marks.extend(s * V + t for t in req.prompt_ids if 0 <= t < V)
            out = req.output_ids
            if self._counted[s] < len(out):
                adds.extend(s * V + min(max(t, 0), V - 1) for t in out[self._counted[s]:])
                self._counted[s] = len(out)
        n = len(reqs)
        host = np.empty(n + len(fresh) + len(marks) + len(adds), dtype=np.int64)
        host[:n] = [r.slot for r in reqs]
        host[n:n + len(fresh)] = fresh
        host[n + len(fresh):n + len(fresh) + len(marks)] = marks
        host[n + len(fresh) + len(marks):] = adds
        idx = torch.from_numpy(host).to(dev, non_blocking=True)
        if fresh:
            rows = idx[n:n + len(fresh)]
            self.counts.index_fill_(0, rows, 0.0)
            self.prompt.index_fill_(0, rows, False)
            if marks:
                self.prompt.view(-1).index_fill_(0, idx[n + len(fresh):n + len(fresh) + len(marks)], True)
        if adds:
            if self._ones is None or self._ones.numel() < len(adds) or self._ones.device != dev:
                self._ones = torch.ones(max(len(adds), 2 * self.slots), dtype=torch.float32, device=dev)
            self.counts.view(-1).index_add_(0, idx[n + len(fresh) + len(marks):], self._ones[:len(adds)])
        return idx[:n]

    def params(self, reqs: list[Request], dev: torch.device) -> Tensor:
        """The requests' (repetition, frequency, presence) penalties as [n, 3] on the device: copied
        once while a batch keeps its requests' parameters (most steps)."""
        key = tuple((r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty) for r in reqs)
        if self._params is None or self._params[0] != key or self._params[1].device != dev:
            self._params = key, torch.tensor(key, dtype=torch.float32).to(dev, non_blocking=True)
        return self._params[1]


@torch.inference_mode()  # the logits are inference tensors (updated in place)
def process_logits(logits: Tensor, reqs: list[Request], tokens: Tensor, tree_mask: Tensor,
                   eos_ids: tuple[int, ...], counts: PenaltyCounts) -> Tensor:
    """logits [bs, K, V] of bs requests' trees (tokens [bs, K], node 0 = root; tree_mask [bs, K, K]
    ancestor-or-self) -> the same tensor, processed in place for the requests that need it."""
    pen = [b for b, r in enumerate(reqs) if r.params.penalized]
    if pen:
        _penalize(logits, [reqs[b] for b in pen], pen, tokens, tree_mask, counts)
    for b, req in enumerate(reqs):
        if len(req.output_ids) < req.params.min_tokens:
            _min_tokens(logits[b], req, tree_mask[b], eos_ids)
    return logits


def greedy_targets(logits: Tensor, reqs: list[Request], tokens: Tensor, tree_mask: Tensor,
                   eos_ids: tuple[int, ...], counts: PenaltyCounts) -> Tensor:
    """Each node's greedy target, int64 [bs, K]: the argmax of its processed logits (``logits``
    [bs, K, V] in any float dtype, non-finite rows already zeroed). Only the rows of requests that
    need processing (``needs_processing``) are copied to float32 and processed; the others' argmax is
    taken from ``logits`` as they are, the same token as from a float32 copy (the copy is exact, and
    both argmaxes return the first of tied maxima). A batch with one penalised request among plain
    greedy ones once copied and scanned every row's [K, V] logits in float32 to process that one."""
    need = [b for b, r in enumerate(reqs) if needs_processing(r)]
    if len(need) == len(reqs):  # all of them: the whole batch, in place on one copy
        x = logits if logits.dtype == torch.float32 else logits.float()
        return process_logits(x, reqs, tokens, tree_mask, eos_ids, counts).argmax(-1)
    target = logits.argmax(-1)
    if need:
        sel = torch.tensor(need, dtype=torch.int64).to(logits.device, non_blocking=True)
        x = logits.index_select(0, sel).float()
        process_logits(x, [reqs[b] for b in need], tokens.index_select(0, sel), tree_mask.index_select(0, sel),
                       eos_ids, counts)
        target.index_copy_(0, sel, x.argmax(-1))
    return target


def _penalize(logits: Tensor, reqs: list[Request], pen: list[int], tokens: Tensor, tree_mask: Tensor,
              counts: PenaltyCounts) -> None:
    """The penalties of rows ``pen`` (requests ``reqs``), in batched ops."""
    bs, K, V = logits.shape
    dev = logits.device
    n = len(pen)
    whole = n == bs
    slots = counts.rows(reqs, V, dev)
    params = counts.params(reqs, dev)
    rep, freq, pres = (params[:, i, None, None] for i in range(3))  # [n, 1, 1] columns
    sel = None if whole else torch.tensor(pen, dtype=torch.int64).to(dev, non_blocking=True)
    c = counts.counts.index_select(0, slots)[:, None, :]  # [n, 1, V]
    if K > 1:  # + the draft tokens on each node's path (columns 1.., the root is in output_ids)
        tok = tokens if whole else tokens.index_select(0, sel)
        mask = tree_mask if whole else tree_mask.index_select(0, sel)
        c = c.repeat(1, K, 1)
        c.scatter_add_(2, tok[:, 1:].clamp(0, V - 1)[:, None, :].expand(n, K, K - 1), mask[:, :, 1:].to(c.dtype))
    # The whole batch penalized: in place (elementwise, each element read before it is written);
    # else on a copy of the rows, written back.
    x = logits if whole else logits.index_select(0, sel)
    pos = c > 0
    if any(r.params.repetition_penalty != 1.0 for r in reqs):
        seen = pos | counts.prompt.index_select(0, slots)[:, None, :]
        torch.where(seen, torch.where(x > 0, x / rep, x * rep), x, out=x)  # (r = 1: x itself, exactly)
    x.addcmul_(freq, c, value=-1.0)  # (frequency 0: unchanged)
    x.addcmul_(pres, pos.to(x.dtype), value=-1.0)
    if not whole:
        logits.index_copy_(0, sel, x)


def _min_tokens(logits: Tensor, req: Request, mask: Tensor, eos_ids: tuple[int, ...]) -> None:
    """The stop tokens masked at the nodes whose output index is still below ``min_tokens``."""
    p = req.params
    V = logits.shape[-1]
    stops = [t for t in (() if p.ignore_eos else eos_ids) + p.stop_token_ids if 0 <= t < V]
    if stops:
        depth = mask.sum(-1) - 1  # [K]
        early = (len(req.output_ids) + depth) < p.min_tokens
        cols = torch.tensor(stops, dtype=torch.int64, device=logits.device)
        logits[:, cols] = logits[:, cols].masked_fill(early[:, None], float("-inf"))
