"""Draft trees from the corpus, with a fallback that keeps the verifier serving.

``local``: an in-process ``NgramCorpus``. Remote: a ``CorpusClient`` driven by one worker thread
(every call, in order, so buffered start/extend/finish stay consistent) while the engine waits at
most ``draft_timeout_s`` for a draft. When the corpus is down (``CorpusUnavailable``: the
client's circuit breaker answers in microseconds), errs, or is slow, the step drafts from an
in-process fallback corpus that mirrors this verifier's requests (prompt lookup plus what this
verifier generated). A call still in flight keeps running in the background (the client retries
and, once the server is back, replays every live request on a new session); until it returns, the
engine does not wait on the remote corpus at all. No corpus failure ever fails a request.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from corpus_service import NgramCorpus
from corpus_service.engine import DraftBatch

log = logging.getLogger(__name__)


@dataclass
class DraftStats:
    remote_steps: int = 0  # steps drafted by the remote corpus
    fallback_steps: int = 0  # steps drafted in process because the remote one failed or was slow
    local_steps: int = 0  # steps drafted by the in-process corpus (--corpus local)
    remote_errors: int = 0
    last_error: str = ""


class Drafter:
    def __init__(self, corpus: str | NgramCorpus = "local", *, namespace: str = "default",
                 draft_timeout_s: float = 0.05, client_timeout_s: float = 1.0, vocab_size: int = 0,
                 breaker_cooldown_s: float = 0.5, token: str | None = None, tls: str | None = None) -> None:
        # A short cool-down: a trial against a dead corpus runs on the client thread and fails fast
        # (the channel is in backoff), while a long one would delay resuming speculation after a restart
        # (docs/reliability.md promises 2 s; the channel's reconnect backoff is at most 1 s).
        if not draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s: expected > 0, got {draft_timeout_s}")
        self.stats = DraftStats()
        self.draft_timeout_s = draft_timeout_s
        self._client = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        if isinstance(corpus, NgramCorpus):
            self.local, self.target = corpus, "local"
        elif corpus == "local":
            self.local, self.target = NgramCorpus(vocab_size=vocab_size) if vocab_size else NgramCorpus(), "local"
        else:
            from corpus_service.circuit_breaker import CircuitBreaker
            from corpus_service.client import CorpusClient

            self.target = corpus
            self._client = CorpusClient(corpus, namespace=namespace, timeout=client_timeout_s, token=token, tls=tls,
                                        breaker=CircuitBreaker(failure_threshold=2, cooldown_s=breaker_cooldown_s))
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="corpus-client")
            self.local = NgramCorpus(vocab_size=vocab_size) if vocab_size else NgramCorpus()

    @property
    def remote(self) -> bool:
        return self._client is not None

    # Mirror every request operation into the local corpus (the draft source when local, the
    # fallback when remote) and queue it for the remote one.

    def start_request(self, req_id: str, prompt_ids: list[int], group: str | None = None) -> None:
        """``group``: requests of one key (the samples of one API request) draft from each other."""
        self.local.start_request(req_id, prompt_ids, group=group)
        self._remote_call(self._client.start_request if self._client else None, req_id, prompt_ids, group)

    def extend(self, req_id: str, tokens: list[int]) -> None:
        if tokens:
            self.local.extend(req_id, tokens)
            self._remote_call(self._client.extend if self._client else None, req_id, tokens)

    def extend_many(self, items: list[tuple[str, list[int]]]) -> None:
        """A step's extends in one native call and one queued remote call (not one per request)."""
        items = [(r, t) for r, t in items if t]
        if not items:
            return
        ids = [r for r, _ in items]
        flat = np.fromiter((tok for _, t in items for tok in t), dtype=np.int32)
        self.local.extend_batch(ids, flat, np.fromiter((len(t) for _, t in items), dtype=np.int64, count=len(items)))
        if self._client is not None:
            self._remote_call(self._extend_remote, items)

    def _extend_remote(self, items: list[tuple[str, list[int]]]) -> None:
        for req_id, tokens in items:
            self._client.extend(req_id, tokens)

    def finish(self, req_id: str) -> None:
        if self.local.has_request(req_id):
            self.local.finish(req_id)
        self._remote_call(self._client.finish if self._client else None, req_id)

    def draft(self, req_ids: list[str], budget: int) -> DraftBatch:
        if self._client is None:
            self.stats.local_steps += 1
            return self.local.draft(req_ids, budget)
        batch = self._remote_draft(req_ids, budget)
        if batch is not None:
            self.stats.remote_steps += 1
            return batch
        self.stats.fallback_steps += 1
        return self.local.draft(req_ids, budget)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ remote

    def _remote_call(self, fn, *args) -> None:
        if fn is not None and self._pool is not None:
            self._pool.submit(self._guarded, fn, *args)

    def _guarded(self, fn, *args):
        from corpus_service.errors import CorpusError

        try:
            return fn(*args)
        except (CorpusError, ValueError) as e:  # never let the corpus fail a request
            self._note_error(e)
            return None

    def _note_error(self, e: Exception) -> None:
        self.stats.remote_errors += 1
        msg = f"{type(e).__name__}: {e}"
        if msg != self.stats.last_error:
            log.warning("corpus %s: %s (drafting in process meanwhile)", self.target, msg)
        self.stats.last_error = msg

    def _remote_draft(self, req_ids: list[str], budget: int) -> DraftBatch | None:
        if self._inflight is not None and not self._inflight.done():
            return None  # an earlier call is still stuck on a slow/unreachable corpus
        fut = self._pool.submit(self._guarded, self._client.draft, req_ids, budget)
        try:
            batch = fut.result(timeout=self.draft_timeout_s)
        except FutureTimeout:
            self._inflight = fut
            return None
        self._inflight = None
        return batch if batch is not None and len(batch) == len(req_ids) else None
