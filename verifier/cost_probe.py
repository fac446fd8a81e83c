"""Start-up measurement of the verify cost model: seconds per forward vs tokens in the batch."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

from .budget import CostModel
from .model import ForwardBatch, KVCache, Transformer

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Forward = Callable[[Tensor, ForwardBatch], Tensor]


def time_forward(model: Transformer, cache: KVCache, bs: int, T: int, prefix_len: int, repeats: int = 3,
                 forward: Forward | None = None) -> float:
    """Seconds of one forward of bs requests x T tree nodes over a prefix of prefix_len: the
    fastest of ``repeats`` (noise from other processes only ever adds time). ``forward`` replaces
    the eager model call (the engine passes its CUDA-graph runner, which is what steps use)."""
    run = forward or (lambda ids, fb: model(ids, cache, fb))
    dev = model.device
    bs = min(bs, cache.num_slots)
    prefix_len = min(prefix_len, cache.max_len - T)
    rows = (prefix_len + torch.arange(T, device=dev)).expand(bs, T)
    mask = torch.ones(bs, T, prefix_len + T, dtype=torch.bool, device=dev).tril(prefix_len)
    fb = ForwardBatch(rows, rows, torch.arange(bs, device=dev), prefix_len + T, mask, (0, bs))
    ids = torch.zeros(bs, T, dtype=torch.int64, device=dev)
    run(ids, fb)  # warm-up (captures the graph of this shape)
    times = []
    for _ in range(repeats):
        _sync(dev)
        t = time.perf_counter()
        run(ids, fb)
        _sync(dev)
        times.append(time.perf_counter() - t)
    return min(times)


def measure_cost_model(model: Transformer, cache: KVCache, max_batch: int, max_nodes: int,
                       prefix_len: int = 256, time_budget_s: float = 10.0,
                       forward: Forward | None = None) -> CostModel:
    """t(N) for N = 1, 2, 4, ... up to max_batch * max_nodes tokens, as bs = min(N, max_batch)
    requests of ceil(N / bs) nodes. Stops early once the probe time budget is spent (beyond the
    last point the model extrapolates linearly: large N is compute-bound)."""
    start = time.perf_counter()
    tokens, seconds = [], []
    n_max = max_batch * max_nodes
    n = 1
    while True:
        bs = min(n, max_batch)
        T = math.ceil(n / bs)
        tokens.append(bs * T)
        seconds.append(time_forward(model, cache, bs, T, prefix_len, forward=forward))
        if n >= n_max or (len(tokens) >= 2 and time.perf_counter() - start > time_budget_s):
            break
        n = min(2 * n, n_max)
    if len(tokens) < 2:
        tokens.append(2 * tokens[0])
        seconds.append(2 * seconds[0])
    cm = CostModel(tokens, seconds)
    log.info("cost model (tokens -> ms): %s", {t: round(s * 1e3, 2) for t, s in zip(cm.tokens, cm.seconds)})
    return cm
