"""Exceptions of the corpus engine. All are ValueError subclasses (bad input), so code that catches
ValueError keeps working; the classes let callers and the gRPC layer tell the cases apart."""

from __future__ import annotations


class CorpusEngineError(ValueError):
    """Base class of the engine's specific errors."""


class UnknownRequestError(CorpusEngineError):
    """A request id that is not live (never started, finished, or expired)."""


class AlreadyExistsError(CorpusEngineError):
    """A live request id, or an external corpus name, used again."""


class NotFoundError(CorpusEngineError):
    """An external corpus that does not exist, or is not being loaded."""


class BudgetTooLargeError(CorpusEngineError):
    """A draft budget above the most nodes the corpus drafts per tree (its ``max_budget``): the
    caller may ask again with a smaller one (a pipelined verifier's deep tree does)."""


class LimitExceededError(CorpusEngineError):
    """A configured bound (live requests, external corpus tokens) would be exceeded."""


class CorruptSnapshotError(CorpusEngineError):
    """A snapshot file that is corrupt, truncated, of another version or incompatible; nothing of it
    was loaded."""


class StalePolicyVersionError(CorpusEngineError):
    """A policy version older than the namespace's announced one (versions only move forward)."""
