"""The vectorized step validation (Session.parse) and wire packing against the request-by-request
implementation they replaced: same accepted steps, same refusals with the same codes and messages."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.engine.corpus import DraftBatch
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusError, DraftRefused
from corpus_service.server.config import ServiceConfig
from corpus_service.server.session import MAX_REQ_ID_CHARS, Session, extend_packed
from corpus_service.server.state import ServiceState


# ---------------------------------------------------------------------- the previous implementation


def ref_check_req_ids(ids, field, max_batch):
    if len(ids) > max_batch:
        raise CorpusError(f"{field}: {len(ids)} requests exceed max_batch = {max_batch}", grpc.StatusCode.RESOURCE_EXHAUSTED)
    for rid in ids:
        if not rid or len(rid) > MAX_REQ_ID_CHARS:
            raise CorpusError(f"{field}: request ids must be 1-{MAX_REQ_ID_CHARS} characters, got {rid!r:.80}",
                              grpc.StatusCode.INVALID_ARGUMENT)
    if len(set(ids)) != len(ids):
        raise CorpusError(f"{field}: duplicate request ids", grpc.StatusCode.INVALID_ARGUMENT)


def ref_check_tokens(runs, vocab_size, field):
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


def ref_parse(session: Session, msg: pb.SessionRequest):
    cfg = session.state.config
    ns = msg.namespace
    corpus = session.state.corpus(ns)
    restore = arrays.unpack_runs(msg.restore, "restore")
    start = arrays.unpack_runs(msg.start, "start")
    extend = arrays.unpack_runs(msg.extend, "extend")
    finish = list(msg.finish)
    draft = list(msg.draft.req_ids)
    for ids, field in ((restore[0], "restore"), (start[0], "start"), (extend[0], "extend"), (finish, "finish")):
        ref_check_req_ids(ids, field, cfg.max_batch)
    if set(restore[0]) & set(start[0]):
        raise CorpusError("a request id is both restored and started", grpc.StatusCode.INVALID_ARGUMENT)
    num_tokens = sum(r.size for runs in (restore[1], start[1], extend[1]) for r in runs)
    if num_tokens > cfg.max_tokens_per_message:
        raise CorpusError(f"step carries {num_tokens} tokens, more than max_tokens_per_message = "
                          f"{cfg.max_tokens_per_message}", grpc.StatusCode.RESOURCE_EXHAUSTED)
    vocab = corpus.config.vocab_size
    ref_check_tokens(restore[1], vocab, "restore")
    ref_check_tokens(start[1], vocab, "start")
    ref_check_tokens(extend[1], vocab, "extend")
    live = session.live.get(ns, set())
    started, finished = set(start[0]) | set(restore[0]), set(finish)
    for rid in started:
        if rid in live:
            raise CorpusError(f"start: request '{rid}' is already live", grpc.StatusCode.ALREADY_EXISTS)
    num_live = sum(len(v) for v in session.live.values())
    if num_live + len(started) > cfg.max_live_requests_per_session:
        raise CorpusError(f"start: {num_live + len(started)} live requests would exceed "
                          f"max_live_requests_per_session = {cfg.max_live_requests_per_session}",
                          grpc.StatusCode.RESOURCE_EXHAUSTED)
    for ids, field in ((extend[0], "extend"), (finish, "finish")):
        for rid in ids:
            if rid not in live and rid not in started:
                raise CorpusError(f"{field}: unknown request '{rid}' (never started on this stream, or finished)",
                                  grpc.StatusCode.NOT_FOUND)
    budget = msg.draft.budget
    if draft:  # last: a step refused only for its draft had valid operations (client_policy.settle_step)
        try:
            ref_check_draft(session, draft, budget, live, started, finished)
        except CorpusError as e:  # marked for the client (Error.draft_only)
            raise DraftRefused(str(e), e.code) from e
    return ns, restore, start, extend, finish, draft, budget


def ref_check_draft(session, draft, budget, live, started, finished):
    cfg = session.state.config
    ref_check_req_ids(draft, "draft", cfg.max_batch)
    if not 1 <= budget <= cfg.max_budget:
        raise CorpusError(f"draft.budget: expected an int in [1, {cfg.max_budget}], got {budget}",
                          grpc.StatusCode.OUT_OF_RANGE if budget > cfg.max_budget
                          else grpc.StatusCode.INVALID_ARGUMENT)
    for rid in draft:
        if (rid not in live and rid not in started) or rid in finished:
            raise CorpusError(f"draft: unknown request '{rid}' (never started on this stream, or finished)",
                              grpc.StatusCode.NOT_FOUND)


def ref_pack_runs(msg, req_ids, runs):
    msg.req_ids.extend(req_ids)
    msg.lengths = arrays.pack([len(r) for r in runs])
    msg.tokens = b"".join(arrays.pack(r) for r in runs)


def ref_unpack_drafts(msg, n):
    budget = msg.budget
    counts = arrays.unpack(msg.counts, arrays.I32, "drafts.counts", n)
    total = int(counts.sum(dtype=np.int64))
    tokens_flat = arrays.unpack(msg.tokens, arrays.I32, "drafts.tokens", total)
    parents_flat = arrays.unpack(msg.parents, arrays.I32, "drafts.parents", total)
    probs_flat = arrays.unpack(msg.probs, arrays.F32, "drafts.probs", total)
    keep = np.arange(budget)[None, :] < counts[:, None]
    tokens = np.full((n, budget), -1, np.int32)
    parents = np.full((n, budget), -1, np.int32)
    probs = np.zeros((n, budget), np.float32)
    tokens[keep], parents[keep], probs[keep] = tokens_flat, parents_flat, probs_flat
    return DraftBatch(tokens, parents, probs, counts.copy())


# ---------------------------------------------------------------------- random steps


def outcome(fn, session, msg):
    try:
        r = fn(session, msg)
    except Exception as e:  # noqa: BLE001
        return ("error", type(e).__name__, getattr(e, "code", None), str(e))
    return ("ok", r)


def normalized(step):
    """A Step or the reference tuple as plain lists."""
    if isinstance(step, tuple):
        ns, restore, start, extend, finish, draft, budget = step
        runs = lambda r: (r[0], [x.tolist() for x in r[1]])  # noqa: E731
    else:
        ns, restore, start, extend, finish, draft, budget = (step.namespace, step.restore, step.start, step.extend,
                                                             step.finish, step.draft, step.budget)
        runs = lambda r: (r[0], [x.tolist() for x in arrays.split_flat(r[1], r[2])])  # noqa: E731
    return ns, runs(restore), runs(start), runs(extend), finish, draft, budget


def random_step(rng: random.Random, live: set[str], seq: int) -> pb.SessionRequest:
    pool = [str(i) for i in range(10)] + ["", "x" * (MAX_REQ_ID_CHARS + 1), "y" * MAX_REQ_ID_CHARS]
    weights = [10] * 10 + [1, 1, 2]
    live_list = sorted(live)

    def ids(k):
        out = []
        for _ in range(k):
            if live_list and rng.random() < 0.6:
                out.append(rng.choice(live_list))
            else:
                out.append(rng.choices(pool, weights)[0])
        if rng.random() < 0.9:  # mostly without duplicates
            out = list(dict.fromkeys(out))
        return out

    def runs(field, k):
        rids = ids(k)
        toks = [[rng.choice([0, 1, 5, 99, 100, -1]) if rng.random() < 0.05 else rng.randrange(0, 100)
                 for _ in range(rng.choice([0, 1, 2, 3, 7]))] for _ in rids]
        if rng.random() < 0.03:  # a malformed message
            field.req_ids.extend(rids)
            field.lengths = arrays.pack([len(t) + 1 for t in toks])
            field.tokens = arrays.pack([x for t in toks for x in t])
        else:
            arrays.pack_runs(field, rids, toks)

    msg = pb.SessionRequest(seq=seq, namespace=rng.choice(["default"] * 20 + ["nope"]))
    if rng.random() < 0.1:
        runs(msg.restore, rng.randrange(0, 4))
    if rng.random() < 0.5:
        runs(msg.start, rng.randrange(0, 4))
    if rng.random() < 0.8:
        runs(msg.extend, rng.randrange(0, 7))
    if rng.random() < 0.3:
        msg.finish.extend(ids(rng.randrange(0, 3)))
    if rng.random() < 0.8:
        if msg.extend.req_ids and rng.random() < 0.5:
            draft = list(msg.extend.req_ids)
        else:
            draft = ids(rng.randrange(0, 7))
        msg.draft.req_ids.extend(draft)
        msg.draft.budget = rng.choice([0, 1, 3, 8, 9])
    return msg


@pytest.mark.parametrize("seed", range(4))
def test_parse_matches_the_request_by_request_checks(seed):
    cfg = ServiceConfig(max_batch=6, max_budget=8, max_tokens_per_message=30, max_live_requests_per_session=7,
                        namespaces="default:vocab=100")
    state = ServiceState(cfg)
    try:
        session = Session(state)
        rng = random.Random(seed)
        accepted = refused = 0
        for seq in range(1500):
            msg = random_step(rng, session.live.get("default", set()), seq)
            new, ref = outcome(Session.parse, session, msg), outcome(ref_parse, session, msg)
            if ref[0] == "ok":
                assert new[0] == "ok", (msg, new)
                assert normalized(new[1]) == normalized(ref[1])
                accepted += 1
                try:
                    session.apply(new[1], pb.SessionResponse())
                except Exception:  # noqa: BLE001 - engine refusals (e.g. empty prompts) are not parse's business
                    pass
            else:
                assert new == ref, msg
                refused += 1
        assert accepted > 100 and refused > 100, (accepted, refused)
    finally:
        state.close()


def test_extend_packed_matches_extend_batch_of_runs():
    cfg = ServiceConfig(namespaces="a;b")
    state = ServiceState(cfg)
    try:
        a, b = state.corpus("a"), state.corpus("b")
        rng = np.random.default_rng(0)
        ids = [f"r{i}" for i in range(20)]
        for c in (a, b):
            for i, r in enumerate(ids):
                c.start_request(r, np.arange(30 + i, dtype=np.int32) % 50)
        for step in range(30):
            lens = rng.integers(0, 6, len(ids)).astype(np.int32)
            if step == 7:
                lens[3] = 3000  # very uneven: the list form
            toks = rng.integers(0, 50, int(lens.sum())).astype(np.int32)
            extend_packed(a, ids, lens, toks)
            b.extend_batch(ids, arrays.split_flat(lens, toks))
            a.synchronize()  # the learned corpus learns in a background thread: compare settled states
            b.synchronize()
            assert a.draft(ids, 8).tokens.tolist() == b.draft(ids, 8).tokens.tolist()
        with pytest.raises(ValueError):
            extend_packed(a, ids[:1] + ["missing"], np.array([1, 1], np.int32), np.array([1, 2], np.int32))
    finally:
        state.close()


def test_pack_runs_and_drafts_match_the_previous_encoding():
    rng = np.random.default_rng(1)
    for n in (0, 1, 2, 17):
        runs = [rng.integers(0, 1000, rng.integers(0, 9)).astype(np.int32) for _ in range(n)]
        ids = [str(i) for i in range(n)]
        for form in (runs, [r.tolist() for r in runs], [r.astype(np.int64) for r in runs]):
            a, b = pb.TokenRuns(), pb.TokenRuns()
            arrays.pack_runs(a, ids, form)
            ref_pack_runs(b, ids, form)
            assert a == b
        budget = 6
        counts = rng.integers(0, budget + 1, n).astype(np.int32)
        if n == 2:
            counts[:] = budget
        tokens = np.where(np.arange(budget)[None, :] < counts[:, None], rng.integers(0, 99, (n, budget)), -1).astype(np.int32)
        parents = np.where(tokens >= 0, rng.integers(-1, 3, (n, budget)), -1).astype(np.int32)
        probs = np.where(tokens >= 0, rng.random((n, budget)), 0).astype(np.float32)
        msg = pb.DraftTrees()
        keep = tokens >= 0
        arrays.pack_compact_drafts(msg, budget, counts, tokens[keep], parents[keep], probs[keep])
        got, ref = arrays.unpack_drafts(msg, n), ref_unpack_drafts(msg, n)
        for x, y in zip((got.tokens, got.parents, got.probs, got.counts), (ref.tokens, ref.parents, ref.probs, ref.counts)):
            assert x.shape == y.shape and x.dtype == y.dtype and (x == y).all()
            assert x.flags.writeable
        assert (got.tokens == tokens).all() and (got.probs == probs).all()
    with pytest.raises(OverflowError):
        arrays.pack_runs(pb.TokenRuns(), ["a", "b"], [[1], [1 << 40]])
