"""Packed little-endian arrays on the wire (see proto/ngram_corpus/v1/corpus.proto).

Both ends convert with one copy: ``numpy.frombuffer`` reading, ``tobytes`` writing. Readers check
that each array has a whole number of elements and the length its sibling fields promise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.engine import DraftBatch

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")


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
    """Fills a TokenRuns message with one run of tokens per request."""
    msg.req_ids.extend(req_ids)
    msg.lengths = pack([len(r) for r in runs])
    msg.tokens = b"".join(pack(r) for r in runs)


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


def pack_drafts(msg: pb.DraftTrees, batch: DraftBatch) -> None:
    """Unpadded trees: only the first counts[i] nodes of each row travel."""
    counts = batch.counts
    budget = batch.tokens.shape[1] if batch.tokens.ndim == 2 else 0
    msg.budget = budget
    msg.counts = pack(counts)
    if counts.size and int(counts.min()) == budget:  # full rows: the padded arrays are the payload
        msg.tokens, msg.parents = pack(batch.tokens), pack(batch.parents)
        msg.probs = pack(batch.probs, F32)
        return
    keep = np.arange(budget)[None, :] < counts[:, None]
    msg.tokens = pack(batch.tokens[keep])
    msg.parents = pack(batch.parents[keep])
    msg.probs = pack(batch.probs[keep], F32)


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
    keep = np.arange(budget)[None, :] < counts[:, None]
    tokens = np.full((n, budget), -1, np.int32)
    parents = np.full((n, budget), -1, np.int32)
    probs = np.zeros((n, budget), np.float32)
    tokens[keep], parents[keep], probs[keep] = tokens_flat, parents_flat, probs_flat
    return DraftBatch(tokens, parents, probs, counts.copy())
