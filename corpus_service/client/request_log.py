"""The client's record of its live requests, and the steps it sends.

Operations are buffered and ride on the next draft (one message each way per decode step). The
log keeps every live request's tokens (prompt, then committed output) so a new session, after a
server restart or a broken stream, can re-create the requests in one replay message. Confirmed
state changes only when the server acknowledges a step: a refused step changes nothing on either
side, and the caller gets the error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.engine.prompt_keys import check_policy_version, check_prompt_key
from corpus_service.protocol import arrays


def req_id(value: object) -> str:
    if isinstance(value, str):
        if not value:
            raise ValueError("request id: expected a non-empty string")
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value))
    raise TypeError(f"request id: expected str or int, got {type(value).__name__}")


def token_array(tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what}: expected a 1-D sequence of ints, got shape {list(arr.shape)} dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 31):
        raise ValueError(f"{what}: token ids must be in [0, 2**31), got {int(arr.min())}..{int(arr.max())}")
    return arr.astype(np.int32, copy=True)


def token_runs(items: Sequence[tuple[object, Sequence[int] | np.ndarray]]) -> tuple[list[str], list[np.ndarray]]:
    """A step's commits [(request id, tokens), ...] as (ids, int32 runs), all tokens validated in
    one pass (``extend_many`` of both clients)."""
    rids = [req_id(r) for r, _ in items]
    lengths = [len(t) for _, t in items]
    flat = token_array(np.fromiter((int(x) for _, t in items for x in t), dtype=np.int64, count=sum(lengths)),
                       "tokens")
    return rids, np.split(flat, np.cumsum(lengths)[:-1])


def group_key(value: object) -> str:
    """A request group key for the wire ("" = none)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"group: expected str or None, got {type(value).__name__}")
    if not 1 <= len(value) <= 256:
        raise ValueError(f"group: expected 1-256 characters (or None for no group), got {len(value)}")
    return value


def history_args(prompt_key: object, policy_version: object) -> tuple[str, int]:
    """A prompt key and policy version for the wire ("" = the default key, -1 = the namespace's
    version), checked by the engine's rule (corpus_service/engine/prompt_keys.py)."""
    key = check_prompt_key(prompt_key)
    return ("" if key is None else key), check_policy_version(policy_version)


def _pack_history(runs: pb.TokenRuns, ids: Sequence[str], history: dict[str, tuple[str, int]]) -> None:
    # Only when some request has one: a message without them is what older servers expect.
    if any(history.get(r, ("", -1)) != ("", -1) for r in ids):
        runs.prompt_keys.extend(history.get(r, ("", -1))[0] for r in ids)
        runs.policy_versions.extend(history.get(r, ("", -1))[1] for r in ids)


class RequestLog:
    def __init__(self) -> None:
        self.prompts: dict[str, np.ndarray] = {}  # confirmed live requests
        self.outputs: dict[str, list[np.ndarray]] = {}
        self.groups: dict[str, str] = {}  # group key of live requests started in a group
        self.history: dict[str, tuple[str, int]] = {}  # (prompt key, policy version) of live requests with one
        self._starts: dict[str, np.ndarray] = {}  # pending, not yet acknowledged
        self._start_groups: dict[str, str] = {}
        self._start_history: dict[str, tuple[str, int]] = {}
        self._extends: dict[str, list[np.ndarray]] = {}
        self._finishes: list[str] = []
        self._abandons: set[str] = set()  # of _finishes: ended without finishing (no rollout)
        self._pending_tokens = 0  # tokens in _starts and _extends (checked on every extend)

    # ------------------------------------------------------------------ buffering

    def is_live(self, rid: str) -> bool:
        """Live once the pending operations are applied."""
        return (rid in self.prompts or rid in self._starts) and rid not in self._finishes

    def needs_flush_before_start(self, rid: str) -> bool:
        # A step applies start before finish: restarting an id finished in the same step must wait.
        return rid in self._finishes

    def start(self, rid: str, prompt: np.ndarray, group: str = "", history: tuple[str, int] = ("", -1)) -> None:
        if self.is_live(rid):
            raise ValueError(f"request id '{rid}' is already live")
        self._starts[rid] = prompt
        self._pending_tokens += prompt.size
        if group:
            self._start_groups[rid] = group
        if history != ("", -1):
            self._start_history[rid] = history

    def extend(self, rid: str, tokens: np.ndarray) -> None:
        if not self.is_live(rid):
            raise ValueError(f"unknown request id '{rid}' (never started, or finished)")
        self._extends.setdefault(rid, []).append(tokens)
        self._pending_tokens += tokens.size

    def extend_many(self, rids: Sequence[str], runs: Sequence[np.ndarray]) -> None:
        """``extend`` for several requests, all or none: every id is checked first."""
        for rid in rids:
            if not self.is_live(rid):
                raise ValueError(f"unknown request id '{rid}' (never started, or finished)")
        for rid, tokens in zip(rids, runs):
            self._extends.setdefault(rid, []).append(tokens)
            self._pending_tokens += tokens.size

    def finish(self, rid: str, rollout: bool = True) -> None:
        if not self.is_live(rid):
            raise ValueError(f"unknown request id '{rid}' (never started, or finished)")
        self._finishes.append(rid)
        if not rollout:
            self._abandons.add(rid)

    def has_pending(self) -> bool:
        return bool(self._starts or self._extends or self._finishes)

    def pending_tokens(self) -> int:
        return self._pending_tokens

    def pending_start_tokens(self) -> int:
        """Prompt tokens of the starts not yet acknowledged (they ride on the next step)."""
        return sum(p.size for p in self._starts.values())

    # ------------------------------------------------------------------ messages

    def build(self, seq: int, namespace: str, draft_ids: Sequence[str], budget: int, replay: bool) -> pb.SessionRequest:
        """The next step: the pending delta, plus (``replay``) every live request's whole context
        as ``restore`` runs, which the server indexes without learning them a second time."""
        msg = pb.SessionRequest(seq=seq, namespace=namespace)
        if replay:
            self._pack_restore(msg)
        if self._starts:
            arrays.pack_runs(msg.start, list(self._starts), list(self._starts.values()))
            if self._start_groups:
                msg.start.groups.extend(self._start_groups.get(r, "") for r in self._starts)
            _pack_history(msg.start, list(self._starts), self._start_history)
        if self._extends:
            ext_ids = list(self._extends)
            ext = [ts[0] if len(ts) == 1 else np.concatenate(ts) for ts in self._extends.values()]
            arrays.pack_runs(msg.extend, ext_ids, ext)  # one concatenation of every request's tokens
        msg.finish.extend(r for r in self._finishes if r not in self._abandons)
        msg.abandon.extend(r for r in self._finishes if r in self._abandons)
        if draft_ids:
            msg.draft.req_ids.extend(draft_ids)
            msg.draft.budget = budget
        return msg

    def restore(self, seq: int, namespace: str) -> pb.SessionRequest:
        """A replay alone: every confirmed live request's whole context, none of the pending
        delta, so operations buffered while it is in flight stay pending (they go with a later
        step, and only that step's acknowledgement commits them)."""
        msg = pb.SessionRequest(seq=seq, namespace=namespace)
        self._pack_restore(msg)
        return msg

    def _pack_restore(self, msg: pb.SessionRequest) -> None:
        if self.prompts:
            live = list(self.prompts)
            contexts = [np.concatenate([self.prompts[r], *self.outputs[r]]) for r in live]
            arrays.pack_runs(msg.restore, live, contexts)
            if self.groups:  # only then: a message without groups is what older servers expect
                msg.restore.groups.extend(self.groups.get(r, "") for r in live)
            _pack_history(msg.restore, live, self.history)

    def commit(self) -> None:
        """The server applied the pending step."""
        for r, p in self._starts.items():
            self.prompts[r], self.outputs[r] = p, []
        self.groups.update(self._start_groups)
        self.history.update(self._start_history)
        for r, ts in self._extends.items():
            self.outputs[r].extend(ts)
        for r in self._finishes:
            self.prompts.pop(r, None)
            self.outputs.pop(r, None)
            self.groups.pop(r, None)
            self.history.pop(r, None)
        self.discard()

    def discard(self) -> None:
        """The server refused the pending step: nothing of it was applied."""
        self._starts, self._extends, self._finishes = {}, {}, []
        self._start_groups, self._start_history, self._abandons = {}, {}, set()
        self._pending_tokens = 0
