"""The commit path: accepted tokens appended to a request up to its stops (stop tokens and
strings, grammars, logprobs, non-finite rows), and the committed tokens handed to the drafter
(the corpus) in one batch per step."""

from __future__ import annotations

import logging
import time

import torch

from ..step.grammar import finish_if_complete, settle
from ..step.logprobs import row_logprobs
from ..step.numerics import error_message
from .request import Request, Status, append_run, append_tokens

log = logging.getLogger(__name__)


class Commits:
    """Committing tokens and the drafter's calls (mixed into ``Engine``, whose state it uses)."""

    def _commit_path(self, req: Request, tokens: list[int], logits: torch.Tensor | None, path: list[int], bad: list[bool]) -> int:
        """Commits tokens chosen from logits [K, V] rows ``path`` (one each) up to the first
        non-finite row, which fails the request (``verifier.step.numerics``); returns how many were committed."""
        m = bad.index(True) if True in bad else len(tokens)
        lps = [] if req.params.logprobs is None else row_logprobs(logits[path[:m]], tokens[:m], [req.params.logprobs] * m)
        committed = self._commit(req, tokens[:m], lps)
        if m < len(tokens) and not req.finished:
            req.status, req.finish_reason, req.finished_at = Status.FINISHED, "error", time.monotonic()
            req.error = error_message(len(req.output_ids))
            log.warning("request %s: %s", req.req_id, req.error)
        return committed

    def _commit_run(self, req: Request, tokens: list[int]) -> int:
        """``_commit`` for a request whose commits may take ``append_run`` (``Request.as_run``: no
        stop strings, grammar or logprobs)."""
        m = append_run(req, tokens, req.stops, self.codec.decode)
        if m:
            self.stats.generated_tokens += m
            if self.drafter is not None:
                self._extends.append((req.req_id, tokens[:m]))  # sent in one batch: _flush_extends
        return m

    def _commit(self, req: Request, tokens: list[int], logprobs: list | None = None) -> int:
        """Appends tokens up to a stop; returns how many were committed."""
        before = len(req.output_ids)
        append_tokens(req, settle(req, tokens), self.eos_ids, self.codec.decode)
        finish_if_complete(req, self.codec.decode)
        committed = req.output_ids[before:]
        req.logprobs.extend((logprobs or [])[:len(committed)])
        self.stats.generated_tokens += len(committed)
        if self.drafter is not None and committed:
            self._extends.append((req.req_id, committed))  # sent in one batch: _flush_extends
        return len(committed)

    def _corpus_call(self, method, *args, **kwargs):
        """A drafter call, its time counted in stats.corpus_seconds."""
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.stats.corpus_seconds += time.perf_counter() - t

    def _await_remote(self) -> bool:
        """While the GPU runs a step: the remote corpus' answer for the next step taken in (see
        Drafter.await_ahead). Its time is the GPU wait's, not the corpus': it only fills that wait."""
        return self.drafter.await_ahead()

    def _dispatch(self, hold: bool = False) -> None:
        """The last verify step's deferred work (``_settle``), then the drafter's held corpus calls and
        next draft request to its client (Drafter.dispatch); ``hold``: more steps follow soon, so
        calls no draft request needs may wait for one of them."""
        if self.drafter is not None:
            self._settle()
            self._corpus_call(self.drafter.dispatch, hold)

    def _flush_extends(self) -> None:
        if self._extends:
            extends, self._extends = self._extends, []
            self._corpus_call(self.drafter.extend_many, extends)

    def _settle(self) -> None:
        """A verify step's bookkeeping that no decision before the next launch needs: its committed
        tokens into the corpus and what the budget policy learns from it. A CUDA engine runs it
        while the GPU computes the next step (``_dispatch`` follows every launch), not between the
        last step's results and the next launch, where it kept the GPU idle: at batch 64 a plain
        step of a speculative engine cost 0.2 ms more than plain decoding's (H100, 2026-12-06).
        A draft or a request's finish needs the corpus up to date, so both flush the extends first;
        the policy's next budget decision sees the step before (its figures average over tens of steps)."""
        self._flush_extends()
        told, self._told = self._told, []
        for call, args in told:
            call(*args)
        self._send_updates()

    def _send_updates(self) -> None:
        """The steps' updated requests to their callers: each one's ``on_update``, then
        ``after_updates`` once (Engine.step says when)."""
        if self._updates:
            updates, self._updates = self._updates, []
            for r in updates:
                r.on_update(r)
            if self.after_updates is not None:
                self.after_updates()
