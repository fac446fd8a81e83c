"""Start-up measurement of the verify cost model: seconds per forward vs tokens in the batch.

Every size is timed ``repeats`` times in interleaved passes (each pass times every size once,
alternately smallest first and largest first), so that a spell of load from other processes falls
on all sizes alike, and its figure is the median. One warm-up and the fastest of three, as before,
let one pass of noise decide: on a loaded 2-core CPU the probe measured 1 token at 232-506 ms and 2
tokens at 1,538-1,577 ms, and the budget policy never drafted. The engine refreshes the figures
from the steps it runs (``verifier.budget.cost_model``), so the probe only has to be a sane start.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..model import KVCache, Transformer
from ..step.cuda_graphs import forward_part
from .cost_model import CostModel

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# (packed step input of bs rows, bs, K, cache rows attended) -> logits: GraphRunner.forward_step.
Forward = Callable[[np.ndarray, int, int, int], Tensor]


def chain_step(bs: int, T: int, prefix_len: int) -> np.ndarray:
    """The packed input (``tree_batch.PackedTrees.host``) of a step of bs requests, each a chain of
    T nodes (token 0) after prefix_len cache rows, in slots 0 .. bs - 1."""
    return np.concatenate([np.zeros(bs * T), np.tile(np.arange(-1, T - 1), bs), np.full(bs, prefix_len),
                           np.arange(bs)]).astype(np.int64)


def forward_timer(model: Transformer, cache: KVCache, bs: int, T: int, prefix_len: int,
                  forward: Forward | None = None) -> Callable[[], float]:
    """A function timing the forward part of a verify step of bs requests x T tree nodes (a chain)
    over a prefix of prefix_len (seconds), after one untimed warm-up (which captures the graph of
    this shape). ``forward`` replaces the eager forward part (the engine passes its CUDA-graph
    runner's, which steps use)."""
    dev = model.device
    bs = min(bs, cache.num_slots)
    prefix_len = max(0, min(prefix_len, cache.max_len - T))
    host = chain_step(bs, T, prefix_len)
    if forward is None:
        inp = torch.from_numpy(host).to(dev)
        run = lambda: forward_part(model, cache, inp, bs, T, prefix_len + T, slot_range=(0, bs))  # noqa: E731
    else:
        run = lambda: forward(host, bs, T, prefix_len + T)  # noqa: E731
    run()

    def timed() -> float:
        _sync(dev)
        t = time.perf_counter()
        run()
        _sync(dev)
        return time.perf_counter() - t

    return timed


def measure_cost_model(model: Transformer, cache: KVCache, max_batch: int, max_nodes: int,
                       prefix_len: int = 256, time_budget_s: float = 10.0,
                       forward: Forward | None = None, repeats: int = 5) -> CostModel:
    """t(N) for N = 1, 2, 4, ... up to max_batch * max_nodes tokens, as bs = min(N, max_batch)
    requests of ceil(N / bs) nodes: the median of ``repeats`` timings in interleaved passes (module
    docstring). Sizes are added while half of the time budget lasts (beyond the last one the model
    extrapolates linearly: large N is compute-bound); further passes run while the budget lasts."""
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    start = time.perf_counter()
    tokens: list[int] = []
    timers: list[Callable[[], float]] = []
    samples: list[list[float]] = []
    n_max = max_batch * max_nodes
    n = 1
    while True:  # the first pass, growing N
        bs = min(n, max_batch)
        T = math.ceil(n / bs)
        timer = forward_timer(model, cache, bs, T, prefix_len, forward)
        tokens.append(bs * T)
        timers.append(timer)
        samples.append([timer()])
        if n >= n_max or (len(tokens) >= 2 and time.perf_counter() - start > time_budget_s / 2):
            break
        n = min(2 * n, n_max)
    passes = 1
    while passes < repeats and time.perf_counter() - start < time_budget_s:
        order = range(len(timers)) if passes % 2 == 0 else range(len(timers) - 1, -1, -1)
        for i in order:
            samples[i].append(timers[i]())
        passes += 1
    seconds = [sorted(s)[(len(s) - 1) // 2] for s in samples]  # the lower median: noise only adds time
    if len(tokens) < 2:
        tokens.append(2 * tokens[0])
        seconds.append(2 * seconds[0])
    cm = CostModel(tokens, seconds)
    log.info("cost model (tokens -> ms, median of %d passes): %s", passes,
             {t: round(s * 1e3, 2) for t, s in zip(cm.tokens, cm.seconds)})
    return cm
