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
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.request import Request


def needs_processing(req: Request) -> bool:
    p = req.params
    return p.penalized or len(req.output_ids) < p.min_tokens


@torch.inference_mode()  # the logits are inference tensors (updated in place)
def process_logits(logits: Tensor, reqs: list[Request], tokens: Tensor, tree_mask: Tensor,
                   eos_ids: tuple[int, ...]) -> Tensor:
    """logits [bs, K, V] of bs requests' trees (tokens [bs, K], node 0 = root; tree_mask [bs, K, K]
    ancestor-or-self) -> the same tensor, processed in place for the requests that need it."""
    for b, req in enumerate(reqs):
        if needs_processing(req):
            _process_one(logits[b], req, tokens[b], tree_mask[b], eos_ids)
    return logits


def _counts(req: Request, V: int, dev: torch.device, need_prompt: bool) -> tuple[Tensor, Tensor | None]:
    """The request's output-token counts [V] (float32) and, for the repetition penalty, its prompt
    tokens as a mask [V], kept on the device and brought up to date with the tokens committed
    since the last step (output only grows), instead of copying every output id each step."""
    state = req.penalty_state
    if state is None or state[1].device != dev:
        counts = torch.zeros(V, dtype=torch.float32, device=dev)
        prompt = None
        if need_prompt:
            prompt = torch.zeros(V, dtype=torch.bool, device=dev)
            prompt[torch.tensor([t for t in req.prompt_ids if 0 <= t < V], dtype=torch.int64, device=dev)] = True
        state = req.penalty_state = [0, counts, prompt]
    n = len(req.output_ids)
    if state[0] < n:
        new = torch.tensor(req.output_ids[state[0]:], dtype=torch.int64, device=dev).clamp_(0, V - 1)
        state[1].index_add_(0, new, torch.ones(len(new), dtype=torch.float32, device=dev))
        state[0] = n
    return state[1], state[2]


def _process_one(logits: Tensor, req: Request, tokens: Tensor, mask: Tensor, eos_ids: tuple[int, ...]) -> None:
    p = req.params
    K, V = logits.shape
    dev = logits.device
    if p.penalized:
        base, prompt_seen = _counts(req, V, dev, p.repetition_penalty != 1.0)
        counts = base.to(logits.dtype).expand(K, V).clone()
        if K > 1:  # + the draft tokens on each node's path (columns 1.., the root is in output_ids)
            path = mask[:, 1:].to(logits.dtype)
            counts.scatter_add_(1, tokens[1:].clamp(0, V - 1)[None].expand(K, K - 1), path)
        if p.repetition_penalty != 1.0:
            seen = (counts > 0) | prompt_seen
            r = p.repetition_penalty
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
        if p.frequency_penalty:
            logits.sub_(p.frequency_penalty * counts)
        if p.presence_penalty:
            logits.sub_(p.presence_penalty * (counts > 0).to(logits.dtype))
    produced = len(req.output_ids)
    if produced < p.min_tokens:
        stops = [t for t in (() if p.ignore_eos else eos_ids) + p.stop_token_ids if 0 <= t < V]
        if stops:
            depth = mask.sum(-1) - 1  # [K]
            early = (produced + depth) < p.min_tokens
            cols = torch.tensor(stops, dtype=torch.int64, device=dev)
            logits[:, cols] = logits[:, cols].masked_fill(early[:, None], float("-inf"))
