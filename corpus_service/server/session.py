"""One client's Session stream: its live requests, and how one step is checked and applied.

A step is validated completely (namespace, ids, limits, token ranges) before anything touches the
engine, so a refused step changes nothing and the client's record of its requests stays true.
Engine request ids are prefixed with the session id: two clients may both call a request "0".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.engine.corpus import NgramCorpus
from corpus_service.engine.prompt_keys import MAX_POLICY_VERSION, prompt_key_error
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusError, DraftRefused
from corpus_service.server.live_budget import REQUEST_CHARGE_BYTES
from corpus_service.server.policy_versions import publish_rollout
from corpus_service.server.state import ServiceState

MAX_REQ_ID_CHARS = 256
MAX_GROUP_CHARS = 256
_UMAX = np.maximum.reduce


def extend_packed(corpus: NgramCorpus, req_ids: list[str], lengths: np.ndarray, tokens: np.ndarray) -> None:
    """``corpus.extend_batch`` for runs already concatenated: the engine's flat form, one native call."""
    corpus.extend_batch(req_ids, tokens, lengths)


def _checked_id_set(ids: list[str], field: str, max_batch: int) -> set[str]:
    """``check_req_ids``, returning the ids as a set (one pass over the ids in C, not in Python)."""
    if len(ids) > max_batch:
        raise CorpusError(f"{field}: {len(ids)} requests exceed max_batch = {max_batch}",
                          grpc.StatusCode.RESOURCE_EXHAUSTED)
    if not ids:
        return set()
    lens = list(map(len, ids))
    if min(lens) == 0 or max(lens) > MAX_REQ_ID_CHARS:
        for rid in ids:
            if not rid or len(rid) > MAX_REQ_ID_CHARS:
                raise CorpusError(f"{field}: request ids must be 1-{MAX_REQ_ID_CHARS} characters, got {rid!r:.80}",
                                  grpc.StatusCode.INVALID_ARGUMENT)
    unique = set(ids)
    if len(unique) != len(ids):
        raise CorpusError(f"{field}: duplicate request ids", grpc.StatusCode.INVALID_ARGUMENT)
    return unique


def check_req_ids(ids: list[str], field: str, max_batch: int) -> None:
    _checked_id_set(ids, field, max_batch)


def check_flat_tokens(flat: np.ndarray, vocab_size: int, field: str) -> None:
    """``check_tokens`` for runs already concatenated."""
    if flat.size == 0:
        return
    # One reduction on the common path: viewed as uint32, a negative id is >= 2**31.
    limit = vocab_size if 0 < vocab_size <= 1 << 31 else 1 << 31
    if flat.dtype == np.int32 and int(_UMAX(flat.view(np.uint32))) < limit:
        return
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0:
        raise CorpusError(f"{field}: token ids must be >= 0, got {lo}", grpc.StatusCode.INVALID_ARGUMENT)
    if vocab_size and hi >= vocab_size:
        raise CorpusError(f"{field}: token id {hi} is outside the vocabulary (size {vocab_size})",
                          grpc.StatusCode.INVALID_ARGUMENT)


def check_tokens(runs: list[np.ndarray], vocab_size: int, field: str) -> None:
    if not runs:
        return
    check_flat_tokens(np.concatenate(runs) if len(runs) > 1 else runs[0], vocab_size, field)


def check_groups(runs: pb.TokenRuns, field: str) -> list[str] | None:
    """The group key of each run (``""``: none), or None when the message carries no groups (old
    clients)."""
    groups = list(runs.groups)
    if not groups:
        return None
    if len(groups) != len(runs.req_ids):
        raise CorpusError(f"{field}.groups: expected one group key per request id ({len(runs.req_ids)}) or none, "
                          f"got {len(groups)}", grpc.StatusCode.INVALID_ARGUMENT)
    if max(map(len, groups)) > MAX_GROUP_CHARS:
        raise CorpusError(f"{field}.groups: group keys must be at most {MAX_GROUP_CHARS} characters",
                          grpc.StatusCode.INVALID_ARGUMENT)
    return groups


def check_history_fields(keys_field, versions_field, n: int, field: str) -> tuple[list[str | None] | None,
                                                                               list[int | None] | None]:
    """The prompt key (None: the default) and policy version (None: the namespace's) of each of n
    requests, or None for a field the message does not carry (old clients): ``prompt_keys`` and
    ``policy_versions`` of a TokenRuns or a BatchGetRequest."""
    keys = versions = None
    if len(keys_field):
        if len(keys_field) != n:
            raise CorpusError(f"{field}.prompt_keys: expected one key per request id ({n}) or none, got "
                              f"{len(keys_field)}", grpc.StatusCode.INVALID_ARGUMENT)
        keys = [k or None for k in keys_field]
        for k in keys:
            problem = None if k is None else prompt_key_error(k)
            if problem is not None:
                raise CorpusError(f"{field}.prompt_keys: {problem}", grpc.StatusCode.INVALID_ARGUMENT)
    if len(versions_field):
        if len(versions_field) != n:
            raise CorpusError(f"{field}.policy_versions: expected one version per request id ({n}) or none, got "
                              f"{len(versions_field)}", grpc.StatusCode.INVALID_ARGUMENT)
        versions = [None if v == -1 else int(v) for v in versions_field]
        for v in versions:
            if v is not None and not 0 <= v <= MAX_POLICY_VERSION:
                raise CorpusError(f"{field}.policy_versions: expected -1 (the namespace's) or an int in [0, 2**62), "
                                  f"got {v}", grpc.StatusCode.INVALID_ARGUMENT)
    return keys, versions


def _first_unknown(ids: list[str], live: set[str], started: set[str], finished: set[str] = frozenset()) -> str | None:
    """The first id (in message order) that is neither live nor started, or is finished."""
    for rid in ids:
        if (rid not in live and rid not in started) or rid in finished:
            return rid
    return None


@dataclass(slots=True)
class Step:
    """A validated step, ready to apply. Token runs stay packed: ``(req_ids, lengths, tokens)`` with
    the arrays read-only views of the message bytes."""

    namespace: str
    restore: tuple[list[str], np.ndarray, np.ndarray]
    start: tuple[list[str], np.ndarray, np.ndarray]
    extend: tuple[list[str], np.ndarray, np.ndarray]
    finish: list[str]
    draft: list[str]
    budget: int
    restore_groups: list[str] | None = None  # group key per restored / started request ("": none)
    start_groups: list[str] | None = None
    # (prompt keys, policy versions) per restored / started request, each None when not carried
    restore_history: tuple = (None, None)
    start_history: tuple = (None, None)
    abandon: frozenset[str] = frozenset()  # of `finish`: ended without finishing (no rollout)

    def num_tokens(self) -> int:
        return self.restore[2].size + self.start[2].size + self.extend[2].size

    def work(self) -> int:
        """Rough cost in draft nodes + tokens/16 (see ``CorpusServicer.Session``)."""
        return len(self.draft) * self.budget + self.num_tokens() // 16 + 8 * (len(self.start[0]) + len(self.restore[0]))


class Session:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.id = state.next_session_id()
        self.prefix = f"s{self.id}:"
        self.live: dict[str, set[str]] = {}  # namespace -> live request ids
        # Bytes the live requests of this stream hold in the server-wide budget (live_budget.py): charged
        # when a step is admitted, released by its finishes and, for whatever is left, at close. A
        # step the engine refuses midway keeps its charge until close: an over-count, never an under-count.
        self.charged = 0
        self.closed = False
        # A step applied on the worker pool may still run when its cancelled stream closes: close()
        # then leaves the cleanup to that step (it finishes what it started too), never runs beside it.
        self._applying = False
        self._lock = threading.Lock()

    def parse(self, msg: pb.SessionRequest) -> Step:
        """Validates a step completely (vectorized: no per-request Python work on the common path;
        errors, their order and their messages are those of a check request by request)."""
        cfg = self.state.config
        ns = msg.namespace
        corpus = self.state.corpus(ns)
        restore = arrays.unpack_flat_runs(msg.restore, "restore")
        start = arrays.unpack_flat_runs(msg.start, "start")
        restore_groups = check_groups(msg.restore, "restore")
        start_groups = check_groups(msg.start, "start")
        restore_history = check_history_fields(msg.restore.prompt_keys, msg.restore.policy_versions,
                                               len(msg.restore.req_ids), "restore")
        start_history = check_history_fields(msg.start.prompt_keys, msg.start.policy_versions,
                                             len(msg.start.req_ids), "start")
        extend = arrays.unpack_flat_runs(msg.extend, "extend")
        finish = list(msg.finish)
        abandon = frozenset(msg.abandon)
        if abandon:  # finished like `finish` (a duplicate across the two is refused with the rest)
            finish += list(msg.abandon)
        draft = list(msg.draft.req_ids)
        max_batch = cfg.max_batch
        restore_set = _checked_id_set(restore[0], "restore", max_batch)
        start_set = _checked_id_set(start[0], "start", max_batch)
        extend_set = _checked_id_set(extend[0], "extend", max_batch)
        finished = _checked_id_set(finish, "finish", max_batch)
        if restore_set and start_set and not restore_set.isdisjoint(start_set):
            raise CorpusError("a request id is both restored and started", grpc.StatusCode.INVALID_ARGUMENT)
        num_tokens = restore[2].size + start[2].size + extend[2].size
        if num_tokens > cfg.max_tokens_per_message:
            raise CorpusError(f"step carries {num_tokens} tokens, more than max_tokens_per_message = "
                              f"{cfg.max_tokens_per_message}", grpc.StatusCode.RESOURCE_EXHAUSTED)
        vocab = corpus.config.vocab_size
        check_flat_tokens(restore[2], vocab, "restore")
        check_flat_tokens(start[2], vocab, "start")
        check_flat_tokens(extend[2], vocab, "extend")
        # Membership against the live set plus this step's starts/finishes, without copying the set.
        live = self.live.get(ns, set())
        started = start_set | restore_set if restore_set else start_set
        if started and not live.isdisjoint(started):
            for rid in started:
                if rid in live:
                    raise CorpusError(f"start: request '{rid}' is already live", grpc.StatusCode.ALREADY_EXISTS)
        num_live = sum(len(v) for v in self.live.values())
        if num_live + len(started) > cfg.max_live_requests_per_session:
            raise CorpusError(f"start: {num_live + len(started)} live requests would exceed "
                              f"max_live_requests_per_session = {cfg.max_live_requests_per_session}",
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
        for ids, id_set, field in ((extend[0], extend_set, "extend"), (finish, finished, "finish")):
            missing = id_set.difference(live) if id_set else id_set
            if missing and not started.issuperset(missing):
                rid = _first_unknown(ids, live, started)
                if rid is not None:
                    raise CorpusError(f"{field}: unknown request '{rid}' (never started on this stream, or finished)",
                                      grpc.StatusCode.NOT_FOUND)
        budget = msg.draft.budget
        # The draft request is checked last, and refused as DraftRefused (Error.draft_only): a client
        # keeps the step's (valid, unapplied) operations pending when only its draft was refused
        # (corpus_service.client.policy.settle_step).
        if draft:
            # The common step extends and drafts the same batch: its ids were checked above.
            try:
                draft_set = extend_set if draft == extend[0] else _checked_id_set(draft, "draft", max_batch)
            except CorpusError as e:
                raise DraftRefused(str(e), e.code) from e
            if not 1 <= budget <= cfg.max_budget:
                # Above the maximum: OUT_OF_RANGE, so that a client asking for deep trees (a pipelined
                # verifier) knows by the code that a smaller budget will do.
                raise DraftRefused(f"draft.budget: expected an int in [1, {cfg.max_budget}], got {budget}",
                                   grpc.StatusCode.OUT_OF_RANGE if budget > cfg.max_budget
                                   else grpc.StatusCode.INVALID_ARGUMENT)
            missing = draft_set.difference(live)
            if (missing and not started.issuperset(missing)) or (finished and not finished.isdisjoint(draft_set)):
                rid = _first_unknown(draft, live, started, finished)
                if rid is not None:
                    raise DraftRefused(f"draft: unknown request '{rid}' (never started on this stream, or finished)",
                                       grpc.StatusCode.NOT_FOUND)
        if num_tokens or started:  # last: a step refused here changes nothing, like every refusal above
            tb = self.state.token_bytes[ns]
            charge = num_tokens * tb + len(started) * REQUEST_CHARGE_BYTES
            credit = self._held_bytes(corpus, finish, tb, live) if finish else 0
            self.state.budget.reserve(charge, "start" if started else "extend", credit)
            self.charged += charge
        return Step(ns, restore, start, extend, finish, draft, budget, restore_groups, start_groups,
                    restore_history, start_history, abandon)

    def _held_bytes(self, corpus: NgramCorpus, rids: list[str], tb: int, live: set[str] | None = None) -> int:
        """Budget bytes the live ones of ``rids`` hold now (a request the engine expired holds none)."""
        p = self.prefix
        lens = corpus.context_lengths([p + r for r in rids if live is None or r in live])
        held = lens[lens >= 0]
        return int(held.sum()) * tb + held.size * REQUEST_CHARGE_BYTES

    def apply(self, step: Step, out: pb.SessionResponse) -> int:
        """Applies a validated step to the engine; fills ``out.drafts``. Returns drafted nodes. A step
        whose stream closed before it began is not applied; one whose stream closed while it ran
        finishes the stream's live requests when it ends, those it started included (else they would
        stay live on the engine, unknown to any stream, until its idle timeout)."""
        with self._lock:
            if self.closed:
                raise CorpusError("the session's stream has ended", grpc.StatusCode.CANCELLED)
            self._applying = True
        try:
            corpus = self.state.corpus(step.namespace)
            self.update(corpus, step)
            if not step.draft:
                return 0
            return self.draft(corpus, step, out)
        finally:
            with self._lock:
                self._applying = False
                closed_meanwhile = self.closed
            if closed_meanwhile:
                self._finish_live()

    def update(self, corpus: NgramCorpus, step: Step) -> None:
        """Restores, starts, extends and finishes of a step (everything before its draft)."""
        p = self.prefix
        live = self.live.setdefault(step.namespace, set())
        # Replicated: the engine's requests do not learn; their commits go to the log as chunks.
        ch = self.state.chunkers[step.namespace] if self.state.chunkers is not None else None
        # Group keys are scoped to the session like request ids: clients cannot join each other's.
        # Prompt keys are not: they name a prompt across clients, replicas and time (the namespace's).
        for runs, groups, (keys, versions), restored in ((step.restore, step.restore_groups, step.restore_history, True),
                                                         (step.start, step.start_groups, step.start_history, False)):
            ids, lens, toks = runs
            if not ids:
                continue
            n = len(ids)
            groups = [p + g if g else None for g in groups] if groups else [None] * n
            keys, versions = keys or [None] * n, versions or [None] * n
            for rid, prompt, group, key, version in zip(ids, arrays.split_flat(lens, toks), groups, keys, versions):
                if ch is None:  # a restored request was learned before the restart
                    corpus.start_request(p + rid, prompt, learn_prompt=False if restored else None, group=group,
                                         prompt_key=key, policy_version=version)
                else:
                    corpus.start_request_unlearned(p + rid, prompt, group=group, prompt_key=key,
                                                   policy_version=version)
                    ch.start(p + rid, prompt, learn_prompt=False if restored else None)
                live.add(rid)
        ids, lens, toks = step.extend
        if ids:
            extend_packed(corpus, [p + rid for rid in ids], lens, toks)
            if ch is not None:
                ch.extend_packed([p + rid for rid in ids], lens, toks)
        if step.finish:
            self._release(self._held_bytes(corpus, step.finish, self.state.token_bytes[step.namespace]))
        for rid in step.finish:
            live.discard(rid)
            rollout = rid not in step.abandon
            if ch is not None:
                ch.finish(p + rid)
                if rollout:
                    publish_rollout(self.state, step.namespace, corpus, p + rid)
            corpus.finish(p + rid, rollout=rollout)

    def draft(self, corpus: NgramCorpus, step: Step, out: pb.SessionResponse) -> int:
        """Drafts a step's trees into ``out.drafts``; returns the drafted nodes."""
        p = self.prefix
        counts, tokens, parents, probs = corpus.draft_compact([p + rid for rid in step.draft], step.budget)
        arrays.pack_compact_drafts(out.drafts, step.budget, counts, tokens, parents, probs)
        return int(tokens.size)

    def close(self) -> None:
        """The stream ended: its live requests are finished (their tokens stay learned), here or, if a
        step of it is being applied on the pool, by that step when it ends (``apply``)."""
        with self._lock:
            self.closed = True
            busy = self._applying
        if not busy:
            self._finish_live()

    def _finish_live(self) -> None:
        for ns, rids in self.live.items():
            corpus = self.state.corpus(ns)
            ch = self.state.chunkers[ns] if self.state.chunkers is not None else None
            for rid in sorted(rids):
                if ch is not None:
                    ch.finish(self.prefix + rid)
                try:  # not finished by its client: its output does not join the prompt history
                    corpus.finish(self.prefix + rid, rollout=False)
                except ValueError:
                    pass  # expired by the engine's idle timeout meanwhile
        self.live.clear()
        with self._lock:
            nbytes, self.charged = self.charged, 0
        self.state.budget.release(nbytes)

    def _release(self, nbytes: int) -> None:
        # A step applied on the pool may still finish requests after its cancelled stream closed:
        # what the close's cleanup releases (all that is charged) must not be released twice.
        with self._lock:
            nbytes = 0 if self.closed else min(nbytes, self.charged)
            self.charged -= nbytes
        self.state.budget.release(nbytes)
