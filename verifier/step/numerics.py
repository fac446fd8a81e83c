"""Numerical guard: NaN or infinite logits fail the request they belong to, never its output.

The rows are checked on the raw model logits (``min_tokens`` puts -inf there on purpose later)
and zeroed, so sampling and verification never see them. A request whose accepted path reaches a
bad row keeps the tokens chosen before it (exactly what plain decoding would have emitted) and
finishes with finish_reason "error"; nothing after that point reaches the corpus.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.inference_mode()  # the logits are inference tensors (updated in place)
def nonfinite_rows(logits: Tensor) -> Tensor:
    """logits [..., V] -> bool [...] (True: a NaN or inf in that row); zeroes those rows in place."""
    bad = logits.isfinite().logical_not_().any(-1)
    logits.masked_fill_(bad[..., None], 0.0)
    return bad


def error_message(output_index: int) -> str:
    return f"numerical error: the model produced NaN or infinite logits for output token {output_index}"
