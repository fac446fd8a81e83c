"""Packed little-endian arrays on the wire (see proto/ngram_corpus/v1/corpus.proto).

Both ends convert with one copy: ``numpy.frombuffer`` reading, ``tobytes`` writing. Readers check
that each array has a whole number of elements and the length its sibling fields promise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.engine.corpus import DraftBatch

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")
_EMPTY_I32 = np.zeros(0, I32)
_EMPTY_I32.flags.writeable = False


class WireError(ValueError):
    """A message whose arrays do not fit together (the sender's bug): INVALID_ARGUMENT."""


def pack(values: Sequence[int] | np.ndarray, dtype: np.dtype = I32) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype, field: str, expect: int | None = None) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte values")
    arr = np.frombuffer(data, dtype=dtype)
    if expect is not None and arr.shape[0] != expect:
        raise WireError(f"{field}: expected {expect} values, got {arr.shape[0]}")
    return arr


def pack_runs(msg: pb.TokenRuns, req_ids: Sequence[str], runs: Sequence[Sequence[int] | np.ndarray]) -> None:
    """Fills a TokenRuns message with one run of tokens per request (1-D arrays: one concatenation)."""
    msg.req_ids.extend(req_ids)
    if not len(runs):
        msg.lengths = msg.tokens = b""
        return
    msg.lengths = np.fromiter(map(len, runs), dtype=I32, count=len(runs)).tobytes()
    if len(runs) == 1:
        msg.tokens = pack(runs[0])
    elif all(type(r) is np.ndarray and r.ndim == 1 for r in runs):
        msg.tokens = np.concatenate(runs, dtype=I32, casting="unsafe").tobytes()
    else:  # lists: converted one by one, so out-of-range ints raise as ``pack`` raises
        msg.tokens = b"".join(pack(r) for r in runs)


def pack_flat_runs(msg: pb.TokenRuns, req_ids: Sequence[str], lengths: np.ndarray, tokens: np.ndarray) -> None:
    """Fills a TokenRuns message from runs already concatenated (``tokens``) with their ``lengths``."""
    msg.req_ids.extend(req_ids)
    msg.lengths = pack(lengths)
    msg.tokens = pack(tokens)


def split_runs(lengths: bytes, tokens: bytes, n: int, field: str) -> list[np.ndarray]:
    """The runs of a (lengths, tokens) pair; the arrays are views of the message bytes."""
    lens = unpack(lengths, I32, f"{field}.lengths", n)
    if lens.size and lens.min() < 0:
        raise WireError(f"{field}.lengths: expected lengths >= 0, got {int(lens.min())}")
    toks = unpack(tokens, I32, f"{field}.tokens", int(lens.sum(dtype=np.int64)))
    ends = np.cumsum(lens, dtype=np.int64)
    return [toks[e - n_ : e] for e, n_ in zip(ends.tolist(), lens.tolist())]


def unpack_runs(msg: pb.TokenRuns, field: str) -> tuple[list[str], list[np.ndarray]]:
    ids = list(msg.req_ids)
    return ids, split_runs(msg.lengths, msg.tokens, len(ids), field)


def unpack_flat_runs(msg: pb.TokenRuns, field: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``unpack_runs`` without splitting: (req_ids, lengths int32[n], tokens int32[sum(lengths)]),
    the arrays read-only views of the message bytes, checked as ``split_runs`` checks them."""
    ids = list(msg.req_ids)
    n = len(ids)
    if not n and not msg.lengths and not msg.tokens:
        return ids, _EMPTY_I32, _EMPTY_I32
    lens = unpack(msg.lengths, I32, f"{field}.lengths", n)
    if n and lens.min() < 0:
        raise WireError(f"{field}.lengths: expected lengths >= 0, got {int(lens.min())}")
    toks = unpack(msg.tokens, I32, f"{field}.tokens", int(lens.sum(dtype=np.int64)) if n else 0)
    return ids, lens, toks


def split_flat(lens: np.ndarray, toks: np.ndarray) -> list[np.ndarray]:
    """The runs of (lengths, tokens) as views."""
    ends = np.cumsum(lens, dtype=np.int64).tolist()
    return [toks[e - n : e] for e, n in zip(ends, lens.tolist())]


def _kept(counts: np.ndarray, budget: int) -> np.ndarray:
    """Flat indices of the first counts[i] nodes of each row of an [n, budget] array."""
    return np.flatnonzero(np.arange(budget, dtype=np.int32)[None, :] < counts[:, None])


def pack_compact_drafts(msg: pb.DraftTrees, budget: int, counts: np.ndarray, tokens: np.ndarray,
                        parents: np.ndarray, probs: np.ndarray) -> None:
    """``NgramCorpus.draft_compact``'s arrays are the wire layout already: no padding to strip."""
    msg.budget = budget
    msg.counts = pack(counts)
    msg.tokens, msg.parents = pack(tokens), pack(parents)
    msg.probs = pack(probs, F32)


def unpack_drafts(msg: pb.DraftTrees, n: int) -> DraftBatch:
    """Back to the engine's padded DraftBatch (token -1, parent -1, prob 0 as padding)."""
    budget = msg.budget
    counts = unpack(msg.counts, I32, "drafts.counts", n)
    total = int(counts.sum(dtype=np.int64))
    tokens_flat = unpack(msg.tokens, I32, "drafts.tokens", total)
    parents_flat = unpack(msg.parents, I32, "drafts.parents", total)
    probs_flat = unpack(msg.probs, F32, "drafts.probs", total)
    if total == n * budget:
        return DraftBatch(tokens_flat.reshape(n, budget).copy(), parents_flat.reshape(n, budget).copy(),
                          probs_flat.reshape(n, budget).copy(), counts.copy())
    if n and (int(counts.min()) < 0 or int(counts.max()) > budget):
        raise WireError(f"drafts.counts: expected counts in [0, {budget}], got {int(counts.min())}..{int(counts.max())}")
    keep = _kept(counts, budget)
    tokens = np.full(n * budget, -1, np.int32)
    parents = np.full(n * budget, -1, np.int32)
    probs = np.zeros(n * budget, np.float32)
    tokens[keep], parents[keep], probs[keep] = tokens_flat, parents_flat, probs_flat
    shape = (n, budget)
    return DraftBatch(tokens.reshape(shape), parents.reshape(shape), probs.reshape(shape), counts.copy())
