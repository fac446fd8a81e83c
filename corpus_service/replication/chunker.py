"""Committed tokens -> learned-corpus chunks, on the replica that received them.

A replicated engine does not feed its own learned corpus (its requests start unlearned): every
replica, this one included, learns only what comes back through the log, in stream order. So the
chunking the engine does for a single node (``RequestState.take_chunk``: the prompt when
``learn_prompts``, then all pending tokens once ``flush_tokens`` are pending, the rest at finish)
happens here, and each chunk is published as one event.

A decode step extends every request of a batch by a few tokens, so the step is applied with a few
numpy operations over all its requests: each request owns a row of a pending-token buffer, and a
step scatters its runs into the rows at once. Invariant: a row holds fewer than ``flush_tokens``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

Emit = Callable[[str, np.ndarray], None]  # (namespace, tokens)


class Chunker:
    def __init__(self, namespace: str, flush_tokens: int, learn_prompts: bool, emit: Emit) -> None:
        self.namespace, self.flush_tokens, self.learn_prompts = namespace, flush_tokens, learn_prompts
        self._emit = emit
        self._lock = threading.Lock()
        self._cap = max(2 * flush_tokens, 256)  # a run longer than cap - flush_tokens takes the slow path
        self._buf = np.zeros((64, self._cap), np.int32)
        self._sizes = np.zeros(64, np.int64)
        self._slots: dict[str, int] = {}  # engine request id -> row
        self._free = list(range(63, -1, -1))

    def _new_slot(self) -> int:
        if not self._free:
            n = self._buf.shape[0]
            self._buf = np.concatenate([self._buf, np.zeros((n, self._cap), np.int32)])
            self._sizes = np.concatenate([self._sizes, np.zeros(n, np.int64)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def start(self, rid: str, prompt: np.ndarray, learn_prompt: bool | None = None) -> None:
        learn = self.learn_prompts if learn_prompt is None else learn_prompt
        prompt = np.asarray(prompt, np.int32)
        emit = None
        with self._lock:
            slot = self._slots.get(rid)
            if slot is None:
                slot = self._slots[rid] = self._new_slot()
            self._sizes[slot] = 0
            if learn and prompt.size >= self.flush_tokens:
                emit = prompt.copy()
            elif learn and prompt.size:
                self._buf[slot, :prompt.size] = prompt
                self._sizes[slot] = prompt.size
        if emit is not None:
            self._emit(self.namespace, emit)

    def extend(self, rid: str, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, np.int32)
        self.extend_packed([rid], np.array([tokens.size], np.int64), tokens)

    def extend_packed(self, rids: list[str], lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Extends ``rids[i]`` by the next ``lengths[i]`` of ``tokens`` (the ids are distinct)."""
        out = []
        with self._lock:
            found = list(map(self._slots.get, rids))
            if None not in found:
                slots, lens, toks = np.array(found, np.int64), np.asarray(lengths, np.int64), tokens
            else:  # requests of finished sessions: their tokens are not learned
                idx = np.array([i for i, s in enumerate(found) if s is not None], np.int64)
                if not idx.size:
                    return
                lengths = np.asarray(lengths, np.int64)
                starts = np.cumsum(lengths) - lengths
                slots = np.array([found[i] for i in idx.tolist()], np.int64)
                lens = lengths[idx]
                toks = np.concatenate([tokens[starts[i]:starts[i] + lengths[i]] for i in idx.tolist()])
            have = self._sizes[slots]
            long = have + lens > self._cap
            if long.any():  # rare: a long run; it makes a chunk at once, with what was pending
                starts = np.cumsum(lens) - lens
                for j in np.flatnonzero(long).tolist():
                    s, h = int(slots[j]), int(have[j])
                    out.append(np.concatenate([self._buf[s, :h], toks[starts[j]:starts[j] + lens[j]]]))
                    self._sizes[s] = 0
                keep = ~long
                toks = toks[np.repeat(keep, lens)]
                slots, lens, have = slots[keep], lens[keep], have[keep]
            if lens.size and toks.size:
                # Token k of run i goes to row slots[i], column have[i] + (its position in the run).
                run_start = np.repeat(np.cumsum(lens) - lens, lens)
                cols = np.repeat(have, lens) + (np.arange(toks.size) - run_start)
                self._buf[np.repeat(slots, lens), cols] = toks
                self._sizes[slots] = have + lens
            due = slots[self._sizes[slots] >= self.flush_tokens] if lens.size else slots[:0]
            for s in due.tolist():
                out.append(self._buf[s, :self._sizes[s]].copy())
                self._sizes[s] = 0
        for chunk in out:
            self._emit(self.namespace, chunk)

    def finish(self, rid: str) -> None:
        with self._lock:
            slot = self._slots.pop(rid, None)
            if slot is None:
                return
            n = int(self._sizes[slot])
            chunk = self._buf[slot, :n].copy() if n else None
            self._sizes[slot] = 0
            self._free.append(slot)
        if chunk is not None:
            self._emit(self.namespace, chunk)

    def live(self) -> int:
        with self._lock:
            return len(self._slots)
