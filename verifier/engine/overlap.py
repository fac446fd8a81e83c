"""Overlapped plain decoding: a plain step launched on the device one step ahead of the host,
its tokens committed while the next one runs (``EngineConfig.overlap_plain``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..step.cuda_graphs import StepLaunch
from .request import Request


@dataclass
class _Inflight:
    """An overlapped plain step launched on the device whose tokens are not committed yet."""

    reqs: list[Request]
    launch: StepLaunch
    prefix: list[int]  # each request's root row (cache_len as of the step)


class Overlap:
    """Overlapped plain steps (mixed into ``Engine``, whose state it uses)."""

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
        if self.drafter is not None:  # a verify step's bookkeeping, while the device runs this one
            self._settle()
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
            if not bad[b] and req.as_run:
                self._commit_run(req, [predicts[b]])
            else:
                self._commit_path(req, [predicts[b]], None, [0], [bad[b]])
            if bad[b]:  # NaN K/V in masked rows would still reach attention (0 * NaN)
                self.cache.clear(req.slot, 0 if req.finish_reason == "error" else req.cache_len)
        self._flush_extends()
        return list(inflight.reqs)
