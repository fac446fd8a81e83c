"""Committed tokens -> learned-corpus chunks, on the replica that received them.

A replicated engine does not feed its own learned corpus (its requests start unlearned): every
replica, this one included, learns only what comes back through the log, in stream order. So the
chunking the engine does for a single node (``RequestState.take_chunk``: the prompt when
``learn_prompts``, then all pending tokens once ``flush_tokens`` are pending, the rest at finish)
happens here, and each chunk is published as one event.

The rule runs natively (``csrc/log_chunker.h``): a decode step extends every request of a batch by a
few tokens, and it runs on the serving loop for every step, where a dozen numpy calls per step were
the largest share of a replica's cost over a single node's (``bench/replication.py``, lookups).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from corpus_service import _native

Emit = Callable[[str, np.ndarray], None]  # (namespace, tokens)


class Chunker:
    def __init__(self, namespace: str, flush_tokens: int, learn_prompts: bool, emit: Emit) -> None:
        self.namespace, self.flush_tokens, self.learn_prompts = namespace, flush_tokens, learn_prompts
        self._emit = emit
        self._native = _native.LogChunker(int(flush_tokens), bool(learn_prompts))

    def _out(self, chunks: list[np.ndarray]) -> None:
        for chunk in chunks:
            self._emit(self.namespace, chunk)

    def start(self, rid: str, prompt: np.ndarray, learn_prompt: bool | None = None) -> None:
        self._out(self._native.start(rid, prompt, -1 if learn_prompt is None else int(learn_prompt)))

    def extend(self, rid: str, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, np.int32)
        self.extend_packed([rid], np.array([tokens.size], np.int64), tokens)

    def extend_packed(self, rids: list[str], lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Extends ``rids[i]`` by the next ``lengths[i]`` of ``tokens`` (the ids are distinct);
        requests not started here (those of a closed Session stream) are skipped."""
        if rids:
            self._out(self._native.extend_packed(rids, lengths, tokens))

    def finish(self, rid: str) -> None:
        self._out(self._native.finish(rid))

    def live(self) -> int:
        return self._native.live()
