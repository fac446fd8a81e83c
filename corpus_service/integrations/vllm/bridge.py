"""One replica's side of the corpus, as vLLM's suffix proposer sees it: one batched call per step.

``CorpusBridge.step`` takes what the proposer knows at a decode step (each drafted request's
prompt length, its tokens so far, how many draft tokens it may take; which requests are still in
the batch) and returns one chain per request, or None when the corpus did not answer in time
(the caller then drafts locally). It feeds the corpus with exactly what the request committed:
prompts start requests, committed tokens extend them, requests that left the batch finish.
Nothing here imports vLLM: the same bridge serves the replay benchmark (bench/vllm_pattern.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Counter

from corpus_service.client.circuit_breaker import CircuitBreaker
from corpus_service.client.sync import CorpusClient
from corpus_service.engine.corpus import DraftBatch
from corpus_service.integrations.settings import IntegrationSettings
from corpus_service.protocol.status import CorpusDeadlineExceeded

log = logging.getLogger("corpus_service.integrations.vllm")

# In the process's default registry: vLLM's /metrics shows a worker's counters where vLLM collects
# multiprocess metrics (PROMETHEUS_MULTIPROC_DIR, which vLLM sets itself with --api-server-count > 1).
STEPS = Counter("ngram_corpus_vllm_steps", "vLLM decode steps that asked the corpus, by outcome "
                "(corpus: drafted from it; local: vLLM's own drafting, after a deadline or an outage)", ["outcome"])
OUTAGES = Counter("ngram_corpus_vllm_outages", "Episodes of vLLM decode steps the corpus did not answer")
DRAFTED = Counter("ngram_corpus_vllm_drafted_tokens", "Chain tokens the corpus drafted for vLLM")
DEFERRED = Counter("ngram_corpus_vllm_deferred_drafts", "Requests given no chain at a step because their start on the "
                   "corpus waits for room under NGRAM_CORPUS_MAX_START_TOKENS (one per request and step)")

MAX_TREE_BUDGET = 64  # the corpus server's default --max-budget
TREE_BUDGET_FACTOR = 2  # tree nodes asked per chain token: a deeper best path (bench/vllm_pattern.py)


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request drafted at this step: ``token_ids[:num_tokens]`` is its prompt and output so far
    (the newest sampled token last); ``max_draft`` bounds its chain (0: no draft this step)."""
    req_id: str
    token_ids: np.ndarray  # int, at least num_tokens long
    num_prompt_tokens: int
    num_tokens: int
    max_draft: int

    def __post_init__(self) -> None:
        if not 0 < self.num_prompt_tokens <= self.num_tokens <= len(self.token_ids):
            raise ValueError(f"request {self.req_id!r}: expected 0 < num_prompt_tokens ({self.num_prompt_tokens}) "
                             f"<= num_tokens ({self.num_tokens}) <= len(token_ids) ({len(self.token_ids)})")
        if self.max_draft < 0:
            raise ValueError(f"request {self.req_id!r}: max_draft must be >= 0, got {self.max_draft}")


@dataclass(slots=True)
class BridgeStats:
    """Counters of one replica's plugin (the leader rank's): what a step got from the corpus."""
    steps: int = 0  # steps the corpus was asked
    corpus_steps: int = 0  # ... that it answered in time
    fallback_steps: int = 0  # ... that went to vLLM's own drafting (deadline, outage, error)
    deadline_misses: int = 0
    outages: int = 0  # episodes of unanswered steps (each logged once)
    drafted_tokens: int = 0  # chain tokens returned from the corpus
    deferred_drafts: int = 0  # request-steps with no chain: the request's start waited under max_start_tokens
    deferral_episodes: int = 0  # runs of steps with deferred requests (each logged once)
    last_error: str = ""
    outage_since: float | None = field(default=None)
    deferring: bool = False

    def as_dict(self) -> dict:
        hidden = ("outage_since", "deferring")
        return {k: getattr(self, k) for k in self.__slots__ if k not in hidden} | {"in_outage": self.outage_since is not None}


def best_chain(batch: DraftBatch, row: int, max_len: int) -> list[int]:
    """The tree's highest-probability root path, cut at ``max_len`` tokens: from the root, the
    most probable child each time. ``probs`` are path acceptance probabilities, so a child's is
    at most its parent's and the first node of the most probable path of any length is always
    the most probable child (parents come before children in a row)."""
    n = int(batch.counts[row])
    if n == 0 or max_len <= 0:
        return []
    tokens, parents, probs = batch.tokens[row, :n], batch.parents[row, :n], batch.probs[row, :n]
    best: dict[int, int] = {}  # parent node (-1: the root) -> its most probable child
    for j in range(n):
        p = int(parents[j])
        if p not in best or probs[j] > probs[best[p]]:
            best[p] = j
    chain, node = [], -1
    while len(chain) < max_len and node in best:
        node = best[node]
        chain.append(int(tokens[node]))
    return chain


class CorpusBridge:
    """The leader rank's corpus client and the request bookkeeping around it (not thread-safe:
    vLLM's runner proposes from one thread)."""

    def __init__(self, settings: IntegrationSettings, client: CorpusClient | None = None) -> None:
        self.settings = settings
        self.client = client or CorpusClient(settings.target, settings.namespace, timeout=settings.timeout,
                                             breaker=CircuitBreaker(cooldown_s=settings.retry_seconds),
                                             replay_timeout=settings.replay_timeout)
        self.fed: dict[str, int] = {}  # live request -> tokens the corpus has of it
        self.waiting: dict[str, None] = {}  # live requests not started on the corpus yet, oldest first
        self.stats = BridgeStats()

    def check(self) -> str:
        """One call at start-up within the connect timeout: '' when the corpus answered, else why.
        A corpus that is away at start-up is not an error: steps draft locally until it answers."""
        try:
            ns = self.client.describe_namespaces(timeout=self.settings.connect_timeout)
        except Exception as e:  # CorpusError, or anything else: a corpus that is away is not fatal
            return f"{self.settings.target} did not answer ({type(e).__name__}: {e})"
        if self.settings.namespace not in ns:
            return f"namespace {self.settings.namespace!r} not served by {self.settings.target} (it has {sorted(ns)})"
        return ""

    def step(self, requests: Sequence[StepRequest], live: set[str] | frozenset[str], budget_cap: int = MAX_TREE_BUDGET
             ) -> list[list[int]] | None:
        """Feeds the step's news (finished, started, committed tokens), then drafts every request
        with ``max_draft > 0`` in one call. None: no answer within the deadline (or an error)."""
        self.stats.steps += 1
        try:
            self._feed(requests, live)
            # A request still waiting for its start gets an empty chain (no speculation) this step.
            drafted = [i for i, r in enumerate(requests) if r.max_draft > 0 and r.req_id in self.fed]
            self._note_deferred(sum(r.max_draft > 0 and r.req_id in self.waiting for r in requests))
            chains: list[list[int]] = [[] for _ in requests]
            if drafted:
                longest = max(requests[i].max_draft for i in drafted)
                budget = max(1, min(budget_cap, TREE_BUDGET_FACTOR * longest))
                batch = self.client.draft([requests[i].req_id for i in drafted], budget, timeout=self.settings.timeout)
                for row, i in enumerate(drafted):
                    chains[i] = best_chain(batch, row, requests[i].max_draft)
        except Exception as e:  # any failure costs this step its corpus drafts, never vLLM's step
            self.note_failure(e)
            return None
        self._answered(sum(map(len, chains)))
        return chains

    def _feed(self, requests: Sequence[StepRequest], live: set[str] | frozenset[str]) -> None:
        client = self.client
        for rid in [r for r in self.fed if r not in live]:
            del self.fed[rid]  # first: a failing finish must not leave it behind
            client.finish(rid)
        for rid in [r for r in self.waiting if r not in live]:
            del self.waiting[rid]  # left before it was started: the server never had it
        for r in requests:
            have = self.fed.get(r.req_id)
            if have is not None and have > r.num_tokens:  # came back shorter (preempted, recomputed): anew
                del self.fed[r.req_id]
                client.finish(r.req_id, rollout=False)
            if r.req_id not in self.fed:
                self.waiting.setdefault(r.req_id, None)
        self._start_waiting({r.req_id: r for r in requests if r.req_id in self.waiting})
        extends: list[tuple[str, np.ndarray]] = []
        for r in requests:
            have = self.fed.get(r.req_id)
            if have is not None and r.num_tokens > have:
                extends.append((r.req_id, r.token_ids[have:r.num_tokens]))
                self.fed[r.req_id] = r.num_tokens
        client.extend_many(extends)

    def _start_waiting(self, ready: dict[str, StepRequest]) -> None:
        """Starts waiting requests, oldest first, while the step's message stays within
        ``max_start_tokens`` prompt tokens, counting starts not yet acknowledged (a missed step's
        ride again): a message the server cannot apply within the deadline misses at every step
        (a burst of 128 x 4K prompts did). Strictly in order, so every request starts in turn; one
        prompt over the bound starts alone."""
        cap = self.settings.max_start_tokens
        pending = self.client.pending_start_tokens()
        for rid in list(self.waiting):
            r = ready.get(rid)
            if r is None:  # live but not drafted this step: its turn waits for its tokens
                continue
            if pending > 0 and pending + r.num_prompt_tokens > cap:
                break
            del self.waiting[rid]
            self.fed[rid] = r.num_prompt_tokens  # before the call: a logged start that failed to flush still counts
            self.client.start_request(rid, r.token_ids[:r.num_prompt_tokens])
            pending += r.num_prompt_tokens

    def _note_deferred(self, n: int) -> None:
        """Requests left without a chain this step while their start waits: counted; the first step
        of each run of such steps is logged."""
        s = self.stats
        if n:
            s.deferred_drafts += n
            DEFERRED.inc(n)
            if not s.deferring:
                s.deferral_episodes += 1
                log.warning("ngram_corpus: %d new requests wait for their start on the corpus (at most %d prompt "
                            "tokens a step, NGRAM_CORPUS_MAX_START_TOKENS) and draft nothing until then (episode %d)",
                            n, self.settings.max_start_tokens, s.deferral_episodes)
        s.deferring = n > 0

    def note_failure(self, e: Exception) -> None:
        """A step without corpus drafts: counted; the first of an outage is logged."""
        s = self.stats
        s.fallback_steps += 1
        STEPS.labels("local").inc()
        s.deadline_misses += isinstance(e, CorpusDeadlineExceeded)
        s.last_error = f"{type(e).__name__}: {e}"[:300]
        if s.outage_since is None:
            s.outage_since = time.monotonic()
            s.outages += 1
            OUTAGES.inc()
            log.warning("ngram_corpus: no drafts from the corpus at %s (%s): vLLM drafts locally until it answers "
                        "(retried every %.1fs; outage %d)", self.settings.target, s.last_error,
                        self.settings.retry_seconds, s.outages)

    def _answered(self, drafted_tokens: int) -> None:
        s = self.stats
        s.corpus_steps += 1
        s.drafted_tokens += drafted_tokens
        STEPS.labels("corpus").inc()
        DRAFTED.inc(drafted_tokens)
        if s.outage_since is not None:
            log.warning("ngram_corpus: the corpus at %s answers again after %.1fs (%d steps drafted locally so far)",
                        self.settings.target, time.monotonic() - s.outage_since, s.fallback_steps)
            s.outage_since = None

    def close(self) -> None:
        self.client.close()
