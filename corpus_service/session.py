"""One client's Session stream: its live requests, and how one step is checked and applied.

A step is validated completely (namespace, ids, limits, token ranges) before anything touches the
engine, so a refused step changes nothing and the client's record of its requests stays true.
Engine request ids are prefixed with the session id: two clients may both call a request "0".
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from corpus_service import wire
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.errors import CorpusError
from corpus_service.service_state import ServiceState

MAX_REQ_ID_CHARS = 256


def check_req_ids(ids: list[str], field: str, max_batch: int) -> None:
    if len(ids) > max_batch:
        raise CorpusError(f"{field}: {len(ids)} requests exceed max_batch = {max_batch}",
                          grpc.StatusCode.RESOURCE_EXHAUSTED)
    for rid in ids:
        if not rid or len(rid) > MAX_REQ_ID_CHARS:
            raise CorpusError(f"{field}: request ids must be 1-{MAX_REQ_ID_CHARS} characters, got {rid!r:.80}",
                              grpc.StatusCode.INVALID_ARGUMENT)
    if len(set(ids)) != len(ids):
        raise CorpusError(f"{field}: duplicate request ids", grpc.StatusCode.INVALID_ARGUMENT)


def check_tokens(runs: list[np.ndarray], vocab_size: int, field: str) -> None:
    if not runs:
        return
    flat = np.concatenate(runs) if len(runs) > 1 else runs[0]
    if flat.size == 0:
        return
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0:
        raise CorpusError(f"{field}: token ids must be >= 0, got {lo}", grpc.StatusCode.INVALID_ARGUMENT)
    if vocab_size and hi >= vocab_size:
        raise CorpusError(f"{field}: token id {hi} is outside the vocabulary (size {vocab_size})",
                          grpc.StatusCode.INVALID_ARGUMENT)


@dataclass(slots=True)
class Step:
    """A validated step, ready to apply."""

    namespace: str
    restore: tuple[list[str], list[np.ndarray]]
    start: tuple[list[str], list[np.ndarray]]
    extend: tuple[list[str], list[np.ndarray]]
    finish: list[str]
    draft: list[str]
    budget: int

    def work(self) -> int:
        """Rough cost in draft nodes + tokens/16: small steps run on the event loop itself."""
        tokens = sum(r.size for runs in (self.restore[1], self.start[1], self.extend[1]) for r in runs)
        return len(self.draft) * self.budget + tokens // 16 + 8 * (len(self.start[0]) + len(self.restore[0]))


class Session:
    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.id = state.next_session_id()
        self.prefix = f"s{self.id}:"
        self.live: dict[str, set[str]] = {}  # namespace -> live request ids

    def parse(self, msg: pb.SessionRequest) -> Step:
        cfg = self.state.config
        ns = msg.namespace
        corpus = self.state.corpus(ns)
        restore = wire.unpack_runs(msg.restore, "restore")
        start = wire.unpack_runs(msg.start, "start")
        extend = wire.unpack_runs(msg.extend, "extend")
        finish = list(msg.finish)
        draft = list(msg.draft.req_ids)
        for ids, field in ((restore[0], "restore"), (start[0], "start"), (extend[0], "extend"), (finish, "finish"),
                           (draft, "draft")):
            check_req_ids(ids, field, cfg.max_batch)
        if set(restore[0]) & set(start[0]):
            raise CorpusError("a request id is both restored and started", grpc.StatusCode.INVALID_ARGUMENT)
        num_tokens = sum(r.size for runs in (restore[1], start[1], extend[1]) for r in runs)
        if num_tokens > cfg.max_tokens_per_message:
            raise CorpusError(f"step carries {num_tokens} tokens, more than max_tokens_per_message = "
                              f"{cfg.max_tokens_per_message}", grpc.StatusCode.RESOURCE_EXHAUSTED)
        vocab = corpus.config.vocab_size
        check_tokens(restore[1], vocab, "restore")
        check_tokens(start[1], vocab, "start")
        check_tokens(extend[1], vocab, "extend")
        # Membership against the live set plus this step's starts/finishes, without copying the set.
        live = self.live.get(ns, set())
        started, finished = set(start[0]) | set(restore[0]), set(finish)
        for rid in started:
            if rid in live:
                raise CorpusError(f"start: request '{rid}' is already live", grpc.StatusCode.ALREADY_EXISTS)
        num_live = sum(len(v) for v in self.live.values())
        if num_live + len(started) > cfg.max_live_requests_per_session:
            raise CorpusError(f"start: {num_live + len(started)} live requests would exceed "
                              f"max_live_requests_per_session = {cfg.max_live_requests_per_session}",
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
        for ids, field in ((extend[0], "extend"), (finish, "finish")):
            for rid in ids:
                if rid not in live and rid not in started:
                    raise CorpusError(f"{field}: unknown request '{rid}' (never started in this session, or finished)",
                                      grpc.StatusCode.NOT_FOUND)
        budget = msg.draft.budget
        if draft:
            if not 1 <= budget <= cfg.max_budget:
                raise CorpusError(f"draft.budget: expected an int in [1, {cfg.max_budget}], got {budget}",
                                  grpc.StatusCode.INVALID_ARGUMENT)
            for rid in draft:
                if (rid not in live and rid not in started) or rid in finished:
                    raise CorpusError(f"draft: unknown request '{rid}' (never started in this session, or finished)",
                                      grpc.StatusCode.NOT_FOUND)
        return Step(ns, restore, start, extend, finish, draft, budget)

    def apply(self, step: Step, out: pb.SessionResponse) -> int:
        """Applies a validated step to the engine; fills ``out.drafts``. Returns drafted nodes."""
        corpus = self.state.corpus(step.namespace)
        p, ns = self.prefix, step.namespace
        live = self.live.setdefault(ns, set())
        for rid, context in zip(*step.restore):
            corpus.start_request(p + rid, context, learn_prompt=False)  # learned before the restart
            live.add(rid)
        for rid, prompt in zip(*step.start):
            corpus.start_request(p + rid, prompt)
            live.add(rid)
        if step.extend[0]:
            corpus.extend_batch([p + rid for rid in step.extend[0]], step.extend[1])
        for rid in step.finish:
            live.discard(rid)
            corpus.finish(p + rid)
        if not step.draft:
            return 0
        batch = corpus.draft([p + rid for rid in step.draft], step.budget)
        wire.pack_drafts(out.drafts, batch)
        return int(batch.counts.sum())

    def close(self) -> None:
        """The stream ended: its live requests are finished (their tokens stay learned)."""
        for ns, rids in self.live.items():
            corpus = self.state.corpus(ns)
            for rid in sorted(rids):
                try:
                    corpus.finish(self.prefix + rid)
                except ValueError:
                    pass  # expired by the engine's idle timeout meanwhile
        self.live.clear()
