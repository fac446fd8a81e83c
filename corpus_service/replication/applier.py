"""Applies log messages to this replica's engines, in stream order, from one thread.

Determinism: the same messages in the same order give the same learned corpus on every replica,
whether it ran from the start or loaded a snapshot midway. Each chunk goes in as its own
``batch_put`` document, followed by two empty puts: the engine closes a batch_put document after two
put calls that did not continue it, so no document is left open for a later message to join.
Open documents are not in snapshots, so leaving one open would make a replica that loaded a
snapshot differ from one that did not.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import numpy as np

from corpus_service._native import RANK_DELTA_WORDS_V1
from corpus_service.replication.events import CHUNK, EXTERNAL, POLICY, RANK, REMOVE, RESET, ROLLOUT, Batch, carried
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.replication")

ExternalHook = Callable[[list], None]


class Applier:
    def __init__(self, state: ServiceState, on_external: ExternalHook, on_remove: ExternalHook) -> None:
        self.state = state
        self._on_external, self._on_remove = on_external, on_remove
        self.applied_tokens = 0
        self.skipped_events = 0

    def apply(self, batches: list[Batch]) -> None:
        """Applies messages in order; returns once their chunks are visible to drafts."""
        touched = set()
        # Consecutive chunks of a namespace go to its engine in one call (learn_documents); any other
        # event of that namespace sends them first, so every event applies in log order.
        chunks_of: dict[str, list[np.ndarray]] = {}
        for batch in batches:
            chunks = iter(batch.tokens)
            for ev in batch.events:
                kind, ns = ev[0], ev[1]
                tokens = next(chunks) if carried(ev) is not None else None
                if ns not in self.state.specs:
                    self.skipped_events += 1  # every replica of one cluster serves the same namespaces
                    log.warning("log event for unknown namespace %r skipped", ns)
                    continue
                if kind == CHUNK:
                    chunks_of.setdefault(ns, []).append(tokens)
                    self.applied_tokens += tokens.size
                    touched.add(ns)
                    continue
                pending = chunks_of.pop(ns, None)
                if pending:
                    self.state.corpus(ns).learn_documents(pending)
                self._apply_event(kind, ns, ev, tokens)
        for ns, pending in chunks_of.items():
            self.state.corpus(ns).learn_documents(pending)
        for ns in sorted(touched):
            self.state.corpus(ns).synchronize()

    def _apply_event(self, kind: str, ns: str, ev: list, tokens: np.ndarray | None) -> None:
        corpus = self.state.corpus(ns)
        if kind == EXTERNAL:
            self._on_external(ev)
        elif kind == REMOVE:
            self._on_remove(ev)
        elif kind == RESET:
            corpus.reset()
        elif kind == ROLLOUT:  # ["h", NS, KEY, VERSION, OUTPUT, N]
            try:
                corpus.add_rollout(ev[2], ev[3], tokens, ev[4])
            except ValueError as e:  # a bad event from a foreign writer: every replica skips it
                self.skipped_events += 1
                log.warning("log rollout event skipped: %s", e)
        elif kind == RANK:  # ["a", NS, N, W]: a replica's rank model observations, learned by all
            try:  # ["a", NS, N] (before 2026-12-03): the older layout's words per node
                corpus.apply_rank_delta(tokens, ev[3] if len(ev) > 3 else RANK_DELTA_WORDS_V1)
            except ValueError as e:  # a bad event from a foreign writer: every replica skips it
                self.skipped_events += 1
                log.warning("log rank model event skipped: %s", e)
        elif kind == POLICY:
            corpus.advance_policy_version(ev[2])


def digest(state: ServiceState) -> str:
    """A hash of what replication must make equal on every replica: each namespace's learned corpus
    (its tokens and document boundaries, in order), its external corpora (names, token counts), its
    policy version, its prompt history (keys in least-recently-written order, each rollout's
    version, output length and tokens) and its rank model's weights."""
    h = hashlib.sha256()
    for ns in sorted(state.specs):
        corpus = state.corpus(ns)
        h.update(ns.encode() + b"\0")
        h.update(np.ascontiguousarray(corpus.learned_tokens(), dtype="<i4").tobytes())
        for name, count in sorted(corpus.list_external_corpora().items()):
            h.update(f"\0{name}={count}".encode())
        h.update(f"\2{corpus.policy_version()}".encode())
        for r in corpus.history_rollouts():
            h.update(f"\3{r.prompt_key}\0{r.policy_version}\0{r.output}\0".encode())
            h.update(np.ascontiguousarray(r.tokens, dtype="<i4").tobytes())
        h.update(b"\4" + np.ascontiguousarray(corpus.rank_weights(), dtype="<f4").tobytes())
        h.update(b"\1")
    return h.hexdigest()
