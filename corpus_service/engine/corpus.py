"""NgramCorpus: the in-process corpus engine (a facade over the native index).

Two APIs over one engine:
- request-level: ``start_request``, ``extend``, ``draft``, ``finish`` (plus batch forms);
- SGLang-compatible: ``batch_get``, ``batch_put``, ``synchronize``, ``reset``, ``erase_match_state``,
  ``load_external_corpus_named``, ``commit_external_corpus_load``, ``remove_external_corpus``,
  ``list_external_corpora``, with SGLang's argument and return conventions.
Every method is thread-safe; the native calls release the GIL.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from corpus_service import _native
from corpus_service.engine.config import MAX_BUDGET, CorpusConfig
from corpus_service.engine.prompt_keys import check_policy_version, check_prompt_key
from corpus_service.exceptions import AlreadyExistsError, BudgetTooLargeError

ReqId = str | int
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraftBatch:
    """Draft trees for a batch: row i holds ``counts[i]`` nodes, padded to ``budget``.

    ``parents[i, j]`` is the index of node j's parent in row i, or -1 for a child of the root (the
    request's last token). Parents come before children. ``probs`` are estimated path acceptance
    probabilities. Padding: token -1, parent -1, prob 0.
    """

    tokens: np.ndarray  # int32 [n, budget]
    parents: np.ndarray  # int32 [n, budget]
    probs: np.ndarray  # float32 [n, budget]
    counts: np.ndarray  # int32 [n]
    # Merged trees only (merge_with_earlier, NgramCorpus.draft_merged): per row, bit k set where
    # node k (k < 64) came from the earlier tree alone, the nodes the earlier tree added; None otherwise.
    earlier_only: np.ndarray | None = None  # uint64 [n]

    def __len__(self) -> int:
        return int(self.counts.shape[0])

    def earlier_accepted(self, rows: Sequence[int], paths: Sequence[Sequence[int]]) -> np.ndarray:
        """Per j, of the tokens ``paths[j]`` accepted from the tree of row ``rows[j]`` (in order
        from its root), how many only the earlier tree drafted: the nodes on the path marked in
        ``earlier_only`` (int64 [len(rows)]; 0 for trees that were not merged). One native call."""
        if len(rows) != len(paths):
            raise ValueError(f"earlier_accepted: {len(rows)} rows but {len(paths)} paths")
        if self.earlier_only is None:
            return np.zeros(len(rows), dtype=np.int64)
        return _native.marked_on_paths(self.tokens, self.parents, self.counts, self.earlier_only,
                                       np.asarray(rows, dtype=np.int64), paths)

    def tree(self, i: int) -> tuple[list[int], list[int], list[float]]:
        """The i-th tree as ``(tokens, parents, probs)`` lists without padding."""
        n = int(self.counts[i])
        return self.tokens[i, :n].tolist(), self.parents[i, :n].tolist(), self.probs[i, :n].tolist()


def merge_with_earlier(fresh: DraftBatch, earlier: DraftBatch, since: Sequence[Sequence[int]], budget: int) -> DraftBatch:
    """Row i: ``fresh``'s tree united with ``earlier``'s (drafted for the same request from an
    older context) re-rooted along ``since[i]``, the tokens committed after it was drafted; the
    ``budget`` most probable nodes (csrc/tree_merge.h). A row of ``earlier`` with count 0, or whose
    tree does not contain the path ``since[i]``, leaves the fresh tree alone."""
    budget = _check_budget(budget)
    if len(fresh) != len(earlier) or len(since) != len(fresh):
        raise ValueError(f"merge_with_earlier: {len(fresh)} fresh trees, {len(earlier)} earlier, {len(since)} since")
    # Arrays of other dtypes or layouts are converted by the binding; ``since`` is read there too.
    out = _native.merge_with_earlier(fresh.tokens, fresh.parents, fresh.probs, fresh.counts, earlier.tokens,
                                     earlier.parents, earlier.probs, earlier.counts, since, budget)
    return DraftBatch(*out)


# Statistics that are fractional by nature; every other one counts something (the native side
# reports all of them as doubles).
_FRACTIONAL_SUFFIXES = ("_seconds", "_per_token", "_ratio", "_rate", "_weight")


def typed_stats(raw: dict[str, float]) -> dict[str, int | float]:
    """Counters as ints, fractional statistics as floats. An unknown statistic that is not
    integral stays a float rather than being truncated."""
    return {k: (int(v) if not k.endswith(_FRACTIONAL_SUFFIXES) and float(v).is_integer() else float(v))
            for k, v in raw.items()}


def _check_budget(budget: Any) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"budget: expected an int in [1, {MAX_BUDGET}], got {budget!r}")
    if budget > MAX_BUDGET:  # a smaller budget will do (BudgetTooLargeError is a ValueError)
        raise BudgetTooLargeError(f"budget: expected an int in [1, {MAX_BUDGET}], got {budget!r}")
    return int(budget)


MAX_GROUP_CHARS = 1024  # the service scopes keys by session: its own bound (256) leaves room


def _group(group: Any) -> str:
    """A group key for the native engine: "" means no group."""
    if group is None:
        return ""
    if not isinstance(group, str):
        raise TypeError(f"group: expected str or None, got {type(group).__name__}")
    if not 1 <= len(group) <= MAX_GROUP_CHARS:
        raise ValueError(f"group: expected 1-{MAX_GROUP_CHARS} characters (or None for no group), got {len(group)}")
    if group.startswith("\0"):  # the engine's groups of prompt keys (csrc/group.h, kKeyGroupPrefix)
        raise ValueError("group: must not start with a NUL character")
    return group


@dataclass(frozen=True, slots=True)
class Rollout:
    """A finished request's output as its prompt key's history keeps it: the prompt's last tokens
    (up to ``config.history_context``), then the ``output`` generated tokens."""

    prompt_key: str
    policy_version: int
    tokens: np.ndarray  # int32
    output: int


def _rid(req_id: Any) -> str:
    if isinstance(req_id, str):
        return req_id
    if isinstance(req_id, (int, np.integer)) and not isinstance(req_id, bool):
        return str(int(req_id))
    raise TypeError(f"request id: expected str or int, got {type(req_id).__name__}")


class NgramCorpus:
    """In-process draft corpus: each request's own context, a shared learned corpus, external corpora.

    ``NgramCorpus(config)`` or ``NgramCorpus(**config_fields)``. SGLang's constructor arguments
    (``draft_token_num``, ``match_type``, ``capacity``, ``max_trie_depth``, ``min_bfs_breadth``,
    ``max_bfs_breadth``, ``external_sam_budget``, ``external_corpus_max_tokens``) are accepted too,
    so the object drops into SGLang's ngram worker.

    Whatever ``match_type`` SGLang passes, the drop-in drafts in the config's mode, ``score`` by
    default: under SGLang's calling pattern it drafts more than SGLang's own BFS and PROB
    (``bench/sglang_pattern.py``, docs/benchmarks.md). ``sglang_ordering=True`` makes ``match_type``
    choose the mode as SGLang's does instead: ``"BFS"`` (the default) the ``bfs`` mode (most recent
    continuations first, breadth by match length), ``"PROB"`` the ``prob`` mode (most frequent), and
    ``max_trie_depth`` bounds the trees' depth as it does SGLang's; both order this engine's
    candidates, they do not rebuild SGLang's trie.
    """

    def __init__(
        self,
        config: CorpusConfig | None = None,
        *,
        draft_token_num: int = 8,
        match_type: str | None = None,
        capacity: int | None = None,
        max_trie_depth: int | None = None,  # the tree depth with sglang_ordering; unused otherwise
        min_bfs_breadth: int | None = None,  # accepted for SGLang compatibility; unused
        max_bfs_breadth: int | None = None,  # accepted for SGLang compatibility; unused
        external_sam_budget: int | None = None,  # accepted for SGLang compatibility; unused
        external_corpus_max_tokens: int | None = None,
        sglang_ordering: bool = False,
        **overrides: Any,
    ) -> None:
        if config is not None and not isinstance(config, CorpusConfig):
            raise TypeError(f"config: expected CorpusConfig, got {type(config).__name__}")
        cfg = config or CorpusConfig()
        if match_type is not None and str(match_type).upper() not in ("BFS", "PROB"):
            raise ValueError(f"match_type: expected 'BFS' or 'PROB', got {match_type!r}")
        if not isinstance(sglang_ordering, bool):
            raise ValueError(f"sglang_ordering: expected a bool, got {sglang_ordering!r}")
        if sglang_ordering:
            # SGLang's orderings on request only: match_type alone (SGLang always passes one) keeps
            # the config's mode, the better drafter under SGLang's calls (bench/sglang_pattern.py).
            mode = str(match_type or "BFS").lower()
            if overrides.get("mode", mode) != mode:
                raise ValueError(f"sglang_ordering: match_type {match_type!r} picks mode '{mode}', "
                                 f"but mode={overrides['mode']!r} was passed too")
            overrides["mode"] = mode
        elif match_type is not None and "mode" not in overrides and cfg.mode != str(match_type).lower():
            log.info("match_type=%r is accepted for SGLang compatibility; drafting in mode '%s' "
                     "(sglang_ordering=True for SGLang's ordering)", match_type, cfg.mode)
        if capacity is not None:
            overrides.setdefault("learned_max_bytes", int(int(capacity) * cfg.bytes_per_token()))
        if max_trie_depth is not None and sglang_ordering:
            # SGLang's trie depth bounds what its trie stores (and its windows), so it bounds its
            # trees' depth; this engine's sources have no such bound, and capping the default's
            # trees there cost 0.4-0.9% MAT at draft_token_num 32 (bench/sglang_pattern.py).
            overrides.setdefault("max_depth", int(max_trie_depth))
        if external_corpus_max_tokens is not None:
            overrides.setdefault("max_external_tokens", int(external_corpus_max_tokens))
        self.config = cfg.replace(**overrides) if overrides else cfg
        if isinstance(draft_token_num, bool) or not isinstance(draft_token_num, int) or not 1 <= draft_token_num <= MAX_BUDGET + 1:
            raise ValueError(f"draft_token_num: expected an int in [1, {MAX_BUDGET + 1}], got {draft_token_num!r}")
        self.draft_token_num = draft_token_num
        self._native = _native.Corpus(self.config.to_native())

    # ------------------------------------------------------------------ request-level API

    def start_request(
        self, req_id: ReqId, prompt_ids: Sequence[int] | np.ndarray, *, learn_prompt: bool | None = None,
        group: str | None = None, prompt_key: str | None = None, policy_version: int | None = None,
    ) -> None:
        """Starts a request: its prompt is indexed for prompt lookup. ``learn_prompt`` overrides
        ``config.learn_prompts`` for this request (False suits a request re-established after a
        restart, whose tokens the learned corpus already holds). ``group``: requests started with the
        same key (the n samples of one prompt) draft from each other's committed tokens at once, and
        their shared prompt counts once; the group lives as long as any member.

        ``prompt_key``: what the request is a sample of (``engine/prompt_keys.py``); its key's
        finished rollouts draft for it, and its own output joins them when it finishes. None: a hash
        of the prompt ids. An explicit key also makes its live requests one group (namespace-wide),
        unless ``group`` is given. ``policy_version``: the policy sampling it (None: the namespace's
        current, ``announce_policy_version``); history counts by how many versions apart a rollout
        is. Raises AlreadyExistsError if live."""
        flag = -1 if learn_prompt is None else int(bool(learn_prompt))
        key, version, implied = self._history_args(prompt_key, policy_version)
        self._native.start_request(_rid(req_id), prompt_ids, flag, _group(group), True, key, version, implied)

    @staticmethod
    def _history_args(prompt_key: Any, policy_version: Any) -> tuple[str, int, bool]:
        """(key, version, whether the key implies a group) for the native start: key "" is the
        default key, which the native start hashes from the ids it validated (default_prompt_key)."""
        key = check_prompt_key(prompt_key)
        return ("" if key is None else key), check_policy_version(policy_version), key is not None

    def start_request_unlearned(self, req_id: ReqId, prompt_ids: Sequence[int] | np.ndarray, *,
                                group: str | None = None, prompt_key: str | None = None,
                                policy_version: int | None = None) -> None:
        """``start_request`` for a request whose tokens never feed this engine's learned corpus nor
        its output this engine's history, not even its extends: a replica learns only from the commit
        log (corpus_service/replication; ``rollout`` gives what to publish). Raises AlreadyExistsError
        if live."""
        key, version, implied = self._history_args(prompt_key, policy_version)
        self._native.start_request(_rid(req_id), prompt_ids, 0, _group(group), False, key, version, implied)

    def extend(self, req_id: ReqId, token_ids: Sequence[int] | np.ndarray) -> None:
        """Appends committed tokens (accepted drafts plus the bonus token) to a live request."""
        self._native.extend(_rid(req_id), token_ids)

    def draft(self, req_ids: Sequence[ReqId], budget: int) -> DraftBatch:
        """Draft trees of at most ``budget`` nodes for each request (all must be live)."""
        budget = _check_budget(budget)
        tokens, parents, probs, counts = self._native.draft([_rid(r) for r in req_ids], budget)
        return DraftBatch(tokens, parents, probs, counts)

    def draft_merged(self, req_ids: Sequence[ReqId], budget: int, earlier: DraftBatch,
                     since: Sequence[Sequence[int]] | None = None, *, since_from: np.ndarray | None = None) -> DraftBatch:
        """``merge_with_earlier(self.draft(req_ids, budget), earlier, since, budget)`` in one native
        call: row i of ``earlier`` (drafted for request i from an older context, e.g. by a remote
        corpus) re-rooted along ``since[i]`` and united with the fresh tree. In place of ``since``,
        ``since_from[i]``: request i's ``context_lengths`` when its earlier tree was drafted (the path
        is then the tokens it committed since, read from its own context; a length it no longer
        holds leaves the fresh tree alone)."""
        budget = _check_budget(budget)
        if (since is None) == (since_from is None):
            raise ValueError("draft_merged: expected since or since_from, not both or neither")
        n_since = len(since) if since is not None else len(since_from)
        if len(earlier) != len(req_ids) or n_since != len(req_ids):
            raise ValueError(f"draft_merged: {len(req_ids)} request ids, {len(earlier)} earlier trees, {n_since} since")
        e = earlier
        if since is not None:
            out = self._native.draft_merged(req_ids, budget, e.tokens, e.parents, e.probs, e.counts, since)
        else:
            out = self._native.draft_merged_from(req_ids, budget, e.tokens, e.parents, e.probs, e.counts, since_from)
        return DraftBatch(*out)

    def context_lengths(self, req_ids: Sequence[ReqId]) -> np.ndarray:
        """Tokens in each request so far, prompt and committed output (int64 [n]; -1 for a request
        id that is not live: a pipelined caller asks for the lengths of a batch that may have lost one)."""
        return self._native.context_lengths(req_ids)

    def context_tail(self, req_id: ReqId, n: int) -> np.ndarray:
        """The last ``n`` tokens of a live request's context (int32; ``ValueError`` past what it holds)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise ValueError(f"n: expected an int, got {n!r}")
        return self._native.context_tail(_rid(req_id), int(n))

    def draft_compact(
        self, req_ids: Sequence[ReqId], budget: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The trees of ``draft`` without padding: ``(counts int32 [n], tokens int32 [sum],
        parents int32 [sum], probs float32 [sum])``; request i's nodes follow request i-1's and its
        parents index within its own tree (the service's wire layout)."""
        budget = _check_budget(budget)
        return self._native.draft_compact([_rid(r) for r in req_ids], budget)

    def finish(self, req_id: ReqId, *, rollout: bool = True) -> None:
        """Ends a request: its remaining committed tokens go to the learned corpus, and its output
        (with ``rollout``) to its prompt key's history. ``rollout=False`` for a request that ended
        without finishing (its client went away): a cut output would mislead the history."""
        self._native.finish(_rid(req_id), bool(rollout))

    def rollout(self, req_id: ReqId) -> Rollout | None:
        """What ``finish`` would add to the history for a live request (None: nothing, e.g. no output
        yet); a replica publishes it to the commit log."""
        r = self._native.rollout(_rid(req_id))
        return None if r is None else Rollout(r[0], int(r[1]), r[2], int(r[3]))

    # ------------------------------------------------------------------ prompt history, policy versions

    def announce_policy_version(self, version: int) -> int:
        """The policy's weights changed: the namespace's version becomes ``version`` (requests started
        without one are sampled by it; rollouts ``history_max_age`` versions older are dropped).
        Returns it. An older version than the current raises StalePolicyVersionError (ValueError);
        the same one changes nothing."""
        v = check_policy_version(version, "version")
        if v < 0:
            raise ValueError("version: expected a non-negative int, got None")
        return int(self._native.announce_policy_version(v, True))

    def advance_policy_version(self, version: int) -> int:
        """``announce_policy_version`` that ignores an older version (a replica applying the commit
        log, where announcements of several replicas interleave). Returns the current version."""
        v = check_policy_version(version, "version")
        return int(self._native.announce_policy_version(max(v, 0), False))

    def policy_version(self) -> int:
        """The namespace's current policy version (0 until one is announced)."""
        return int(self._native.policy_version())

    def add_rollout(self, prompt_key: str, policy_version: int, tokens: Sequence[int] | np.ndarray, output: int) -> bool:
        """Adds a rollout to ``prompt_key``'s history as the commit log delivers it: ``tokens`` are the
        prompt's tail, then its last ``output`` tokens are the output. False if nothing was stored
        (history off, or no output)."""
        key = check_prompt_key(prompt_key)
        if key is None:
            raise ValueError("prompt_key: expected a key, got None")
        v = check_policy_version(policy_version)
        if v < 0:
            raise ValueError("policy_version: expected a non-negative int, got None")
        if isinstance(output, bool) or not isinstance(output, (int, np.integer)) or output < 0:
            raise ValueError(f"output: expected an int >= 0, got {output!r}")
        return bool(self._native.add_rollout(key, v, tokens, int(output)))

    def prompt_history(self, prompt_key: str) -> list[tuple[int, int]]:
        """``(policy_version, output_tokens)`` of each rollout the key's history holds, oldest first
        (a request's expected length comes from it)."""
        key = check_prompt_key(prompt_key)
        return [] if key is None else [(int(v), int(n)) for v, n in self._native.history_lengths(key)]

    def history_rollouts(self) -> list[Rollout]:
        """Every stored rollout, keys least recently written first (what replicas must agree on)."""
        return [Rollout(k, int(v), t, int(o)) for k, v, o, t in self._native.history_dump()]

    def has_request(self, req_id: ReqId) -> bool:
        return self._native.has_request(_rid(req_id))

    # Batch forms: one call for many requests (numpy arrays or lists per request).
    def start_requests(self, req_ids: Sequence[ReqId], prompts: Sequence[Sequence[int] | np.ndarray],
                       groups: Sequence[str | None] | None = None, *,
                       prompt_keys: Sequence[str | None] | None = None,
                       policy_versions: Sequence[int | None] | None = None) -> None:
        """``start_request`` for many; ``groups[i]``, ``prompt_keys[i]``, ``policy_versions[i]`` are
        request i's (None: none, the hash of its prompt, the namespace's version)."""
        if len(req_ids) != len(prompts):
            raise ValueError(f"start_requests: {len(req_ids)} request ids but {len(prompts)} prompts")

        def per_request(values: Any, what: str) -> Sequence[Any]:
            if values is None:
                return [None] * len(req_ids)
            if isinstance(values, str) or len(values) != len(req_ids):
                raise ValueError(f"start_requests: expected one {what} (or None) per request id, got "
                                 f"{'a str' if isinstance(values, str) else len(values)} for {len(req_ids)} ids")
            return values

        groups, keys, versions = (per_request(groups, "group"), per_request(prompt_keys, "prompt key"),
                                  per_request(policy_versions, "policy version"))
        # All checked before any request starts.
        args = [(_group(g), *self._history_args(k, v)) for g, k, v in zip(groups, keys, versions)]
        for rid, prompt, (group, key, version, implied) in zip(req_ids, prompts, args):
            self._native.start_request(_rid(rid), prompt, -1, group, True, key, version, implied)

    def extend_batch(
        self,
        req_ids: Sequence[ReqId],
        token_ids: np.ndarray | Sequence[Sequence[int]],
        lengths: np.ndarray | Sequence[int] | None = None,
    ) -> None:
        """Extends many requests: ``token_ids`` is a list of sequences, a 2-D array whose row i holds
        ``lengths[i]`` tokens (padding after them is ignored), or a 1-D array of all the runs
        concatenated with their ``lengths``."""
        if (isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 and token_ids.dtype == np.int32
                and isinstance(lengths, np.ndarray) and lengths.dtype == np.int64 and lengths.shape == (len(req_ids),)):
            # The verifier's per-step form: nothing to convert, and the native call checks the rest
            # (lengths >= 0 adding up to the tokens, token ids in range) before it changes anything.
            self._native.extend_many([_rid(r) for r in req_ids], np.ascontiguousarray(token_ids),
                                     np.ascontiguousarray(lengths))
            return
        if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 and lengths is not None:
            # Already concatenated: row i is the next lengths[i] tokens (the cheapest form).
            lengths = np.asarray(lengths, dtype=np.int64)
            if lengths.shape != (len(req_ids),) or (lengths.size and lengths.min() < 0):
                raise ValueError(f"extend_batch: expected {len(req_ids)} lengths >= 0, got shape {list(lengths.shape)}")
            if int(lengths.sum()) != token_ids.size:
                raise ValueError(f"extend_batch: lengths add up to {int(lengths.sum())} but {token_ids.size} tokens were given")
            if token_ids.size and token_ids.dtype.kind not in "iu":
                raise ValueError(f"extend_batch: expected an integer array, got dtype {token_ids.dtype}")
            if token_ids.size and (token_ids.min() < 0 or token_ids.max() > np.iinfo(np.int32).max):
                raise ValueError("extend_batch: token ids must be in [0, 2^31)")
            flat = np.ascontiguousarray(token_ids, dtype=np.int32)
        elif isinstance(token_ids, np.ndarray) and token_ids.ndim == 2:
            if lengths is None:
                lengths = np.full(token_ids.shape[0], token_ids.shape[1])
            lengths = np.asarray(lengths)
            if token_ids.shape[0] != len(req_ids) or lengths.shape != (len(req_ids),):
                raise ValueError(
                    f"extend_batch: expected token_ids [{len(req_ids)}, L] and lengths [{len(req_ids)}], "
                    f"got {list(token_ids.shape)} and {list(lengths.shape)}"
                )
            if lengths.size and (lengths.min() < 0 or lengths.max() > token_ids.shape[1]):
                raise ValueError(f"extend_batch: lengths must be in [0, {token_ids.shape[1]}]")
            if token_ids.dtype.kind not in "iu":
                raise ValueError(f"extend_batch: expected an integer array, got dtype {token_ids.dtype}")
            if token_ids.size and (token_ids.min() < 0 or token_ids.max() > np.iinfo(np.int32).max):
                raise ValueError("extend_batch: token ids must be in [0, 2^31)")
            keep = np.arange(token_ids.shape[1])[None, :] < lengths[:, None]
            flat = token_ids[keep].astype(np.int32)  # row-major: row i's first lengths[i] tokens
        else:
            if lengths is not None:
                raise ValueError("extend_batch: lengths needs a 1-D or 2-D token array")
            rows = list(token_ids)
            if len(rows) != len(req_ids):
                raise ValueError(f"extend_batch: {len(req_ids)} request ids but {len(rows)} token sequences")
            arrays = [np.asarray(r) for r in rows]
            for i, a in enumerate(arrays):
                if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                    raise ValueError(f"extend_batch: sequence {i} is not a 1-D sequence of token ids")
                if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
                    raise ValueError(f"extend_batch: sequence {i} has token ids outside [0, 2^31)")
            lengths = np.array([a.size for a in arrays], dtype=np.int64)
            flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
        # One native call, all or nothing: unknown ids or bad tokens leave every request unchanged.
        self._native.extend_many([_rid(r) for r in req_ids], flat, np.asarray(lengths, dtype=np.int64))

    def extend_runs(self, req_ids: Sequence[ReqId], runs: Sequence[Sequence[int]]) -> None:
        """``extend_batch`` from one sequence of token ids per request (lists, tuples or 1-D integer
        arrays), read natively: the cheapest form for a step's commits. All or nothing, as
        ``extend_batch``."""
        if len(runs) != len(req_ids):
            raise ValueError(f"extend_runs: {len(req_ids)} request ids but {len(runs)} token sequences")
        self._native.extend_runs(req_ids, runs)

    def finish_batch(self, req_ids: Sequence[ReqId]) -> None:
        for rid in req_ids:
            self.finish(rid)

    # ------------------------------------------------------------------ SGLang-compatible API

    def batch_get(
        self,
        req_ids: Sequence[ReqId],
        batch_tokens: Sequence[Sequence[int]],
        total_lens: Sequence[int],
        draft_token_num: int | None = None,
        *,
        prompt_keys: Sequence[str | None] | None = None,
        policy_versions: Sequence[int | None] | None = None,
        keep_rollouts: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """SGLang's stateful match: ``batch_tokens[i]`` is the last window of request i's tokens and
        ``total_lens[i]`` its full length. Returns ``(drafts, mask)``: int64 ``[B*K]`` tokens, each
        row starting with the last token, and int64 ``[B*K*K]`` ancestor masks, padded with token 0
        under the root as SGLang pads. K is ``draft_token_num`` (default: the constructor's).

        SGLang's API carries no prompt, so its requests have no prompt key unless the caller adds
        ``prompt_keys`` (an extension; with ``policy_versions``), read when a request is first seen:
        it then drafts from its key's history, and ``erase_match_state`` adds its output there
        (``keep_rollouts``; its tokens after its first window's total length)."""
        k = self.draft_token_num if draft_token_num is None else draft_token_num
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_BUDGET + 1:
            raise ValueError(f"draft_token_num: expected an int in [1, {MAX_BUDGET + 1}], got {k!r}")
        if not (len(req_ids) == len(batch_tokens) == len(total_lens)):
            raise ValueError(
                f"batch_get: req_ids, batch_tokens and total_lens must have one entry per request, got "
                f"{len(req_ids)}, {len(batch_tokens)}, {len(total_lens)}"
            )
        ids = [_rid(r) for r in req_ids]
        keys = versions = None
        if prompt_keys is not None or policy_versions is not None:
            n = len(ids)
            keys = [check_prompt_key(x, "prompt_keys") for x in (prompt_keys or [None] * n)]
            versions = [check_policy_version(v, "policy_versions") for v in (policy_versions or [None] * n)]
            if len(keys) != n or len(versions) != n:
                raise ValueError(f"batch_get: expected one prompt key and policy version (or None) per request, "
                                 f"got {len(keys)} and {len(versions)} for {n}")
        for i, (rid, window, total) in enumerate(zip(ids, batch_tokens, total_lens)):
            if len(window) == 0:
                raise ValueError(f"batch_get: request '{rid}' has an empty token window")
            new = keys is not None and not self._native.has_request(rid)
            self._native.sync_window(rid, window, int(total))
            if new and keys[i] is not None:
                self._native.set_prompt_key(rid, keys[i], versions[i], bool(keep_rollouts))
        return self._native.draft_flat(ids, int(k))

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        """Queues token sequences for the learned corpus (asynchronous; see ``synchronize``).
        Overlapping windows of the same request (as SGLang's worker sends them) are joined, so each
        occurrence is counted once."""
        self._native.put(batch_tokens)

    def learn_documents(self, documents: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Queues each sequence as one closed document of the learned corpus, in order
        (asynchronous; see ``synchronize``): what ``batch_put([seq])`` followed by two empty
        ``batch_put([])`` calls stores, in one call. A replica applies its log's chunks so."""
        self._native.learn_documents(documents)

    def synchronize(self) -> None:
        """Waits until every queued insert is applied."""
        self._native.synchronize()

    def reset(self) -> None:
        """Drops the learned corpus, the prompt history and all request state; external corpora and the
        policy version stay."""
        self._native.reset()

    def erase_match_state(self, req_ids: Sequence[ReqId]) -> None:
        for rid in req_ids:
            self._native.erase(_rid(rid))

    def load_external_corpus_named(self, corpus_id: str, chunks: Iterable[Sequence[int] | np.ndarray]) -> int:
        """Loads an external corpus (each chunk one document); it stays invisible to drafting until
        ``commit_external_corpus_load``. Returns the number of tokens loaded."""
        self.begin_external_corpus(corpus_id)
        loaded = 0
        try:
            for chunk in chunks:
                self._native.add_external(corpus_id, chunk)
                loaded += len(chunk)
        except BaseException:
            self._native.abort_external(corpus_id)
            raise
        return loaded

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int | None = None) -> None:
        count = self.commit_external_corpus(corpus_id)
        if loaded_token_count is not None and int(loaded_token_count) != count:
            raise ValueError(
                f"commit_external_corpus_load: corpus '{corpus_id}' holds {count} tokens, "
                f"caller reported {loaded_token_count}"
            )

    def remove_external_corpus(self, corpus_id: str) -> None:
        self._native.remove_external(corpus_id)

    def list_external_corpora(self) -> dict[str, int]:
        """Committed external corpora and their token counts."""
        return dict(self._native.list_externals())

    # ------------------------------------------------------------------ external corpora, staged

    def begin_external_corpus(self, name: str, replace: bool = False) -> None:
        """Starts loading ``name`` invisibly. ``replace``: the name may be committed already; the
        commit then swaps the new corpus in atomically (drafts use the old one until then)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"external corpus name: expected a non-empty str, got {name!r}")
        self._native.begin_external(name, bool(replace))

    def add_external_chunk(self, name: str, token_ids: Sequence[int] | np.ndarray) -> None:
        self._native.add_external(name, token_ids)

    def commit_external_corpus(self, name: str) -> int:
        """Makes a loaded corpus visible atomically; returns its token count."""
        return int(self._native.commit_external(name))

    def abort_external_corpus(self, name: str) -> None:
        self._native.abort_external(name)

    def is_loading_external_corpus(self, name: str) -> bool:
        return self._native.is_loading(name)

    # ------------------------------------------------------------------ persistence, inspection

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the learned and external corpora to a versioned, checksummed file (atomically).
        Pending commits of live requests are flushed into the learned corpus first."""
        self._native.save(os.fspath(path))

    def load(self, path: str | os.PathLike[str]) -> None:
        """Replaces the learned and external corpora with a snapshot's. A corrupt, truncated or
        incompatible file raises CorruptSnapshotError (a ValueError), an unreadable one OSError;
        either way nothing changes."""
        self._native.load(os.fspath(path))

    def stats(self) -> dict[str, int | float]:
        """Counts, tokens and bytes as ints; seconds and ratios as floats (see ``typed_stats``)."""
        return typed_stats(self._native.stats())

    def rank_weights(self) -> np.ndarray:
        """The rank model's weights (csrc/rank_model.h: bias, logit q, cell, token, pair, request,
        own-context and shared estimates, depth), for inspection and tests."""
        return np.asarray(self._native.rank_weights(), np.float32)

    def export_rank_delta(self) -> np.ndarray:
        """What the rank model observed since the last call, as int32 words (``RANK_DELTA_WORDS`` per tested node), when
        ``rank_learn_local`` is off: a replica publishes it so that every replica applies it."""
        return self._native.export_rank_delta()

    def apply_rank_delta(self, words: np.ndarray, node_words: int | None = None) -> None:
        """Learns from a delta of ``export_rank_delta`` (any replica's). ``node_words``: its words per
        node, ``RANK_DELTA_WORDS`` (None) or ``RANK_DELTA_WORDS_V1`` (a delta written before the
        source-pair cell and the request's own cells, 2026-12-03: it learns without them). A malformed
        one raises ValueError and changes nothing."""
        arr = np.asarray(words)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"apply_rank_delta: expected a 1-D integer array, got {arr.dtype} with shape {arr.shape}")
        if node_words is None:
            self._native.apply_rank_delta(arr.astype(np.int32, copy=False))
        else:
            if isinstance(node_words, bool) or not isinstance(node_words, (int, np.integer)) or node_words <= 0:
                raise ValueError(f"apply_rank_delta: node_words must be a positive int, got {node_words!r}")
            self._native.apply_rank_delta(arr.astype(np.int32, copy=False), int(node_words))

    def check_integrity(self) -> None:
        """Verifies every native invariant; raises AssertionError naming the first violation."""
        self._native.check_integrity()

    def learned_tokens(self) -> np.ndarray:
        """The learned corpus' tokens (documents separated by -2**31), for inspection and tests."""
        return self._native.learned_tokens()
