"""Errors on both sides of the wire: engine exceptions -> gRPC status codes -> client exceptions.

The client's exceptions subclass the built-in ones the in-process engine raises (``ValueError``,
``TimeoutError``), so code written against ``NgramCorpus`` keeps its ``except`` clauses.
"""

from __future__ import annotations

import grpc

from corpus_service import exceptions


class CorpusError(Exception):
    """A failed corpus call; ``code`` is the gRPC status code."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class DraftRefused(CorpusError):
    """A session step refused for its draft request alone (``Error.draft_only``): its other
    operations passed their checks and were not applied."""


class CorpusInvalidArgument(CorpusError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class CorpusNotFound(CorpusError, ValueError):
    """Unknown namespace, request or corpus (the engine raises ValueError for these too)."""

    code = grpc.StatusCode.NOT_FOUND


class CorpusAlreadyExists(CorpusError, ValueError):
    code = grpc.StatusCode.ALREADY_EXISTS


class CorpusFailedPrecondition(CorpusError, ValueError):
    """The call does not fit the corpus' state: e.g. a policy version older than the announced one."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class CorpusOutOfRange(CorpusError, ValueError):
    """A draft budget above the corpus' --max-budget (the engine's ``BudgetTooLargeError``): asking
    again with a smaller budget succeeds."""

    code = grpc.StatusCode.OUT_OF_RANGE


class CorpusResourceExhausted(CorpusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CorpusDeadlineExceeded(CorpusError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CorpusUnauthenticated(CorpusError):
    """No token, or one the server does not know (``token=`` / ``NGRAM_CORPUS_TOKEN``)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class CorpusPermissionDenied(CorpusError):
    """The token does not allow this namespace or call."""

    code = grpc.StatusCode.PERMISSION_DENIED


class CorpusUnavailable(CorpusError):
    """The corpus cannot be reached (down, draining, or the circuit breaker is open). A verifier
    catches this and drafts locally or not at all; with the breaker open it costs microseconds."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[CorpusError]] = {
    cls.code: cls
    for cls in (CorpusInvalidArgument, CorpusNotFound, CorpusAlreadyExists, CorpusFailedPrecondition, CorpusOutOfRange,
                CorpusResourceExhausted, CorpusDeadlineExceeded, CorpusUnavailable, CorpusUnauthenticated,
                CorpusPermissionDenied)
}
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}

# Transport-level failures: retried (UNAVAILABLE) and counted by the circuit breaker.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def code_from_value(value: int) -> grpc.StatusCode:
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def to_exception(code: grpc.StatusCode, message: str) -> CorpusError:
    cls = _BY_CODE.get(code, CorpusError)
    return cls(message, code) if cls is CorpusError else cls(message)


def from_rpc_error(e: grpc.RpcError) -> CorpusError:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    if details and "failed to connect" in details and "Socket closed" in details:
        # What a plaintext client sees from a TLS server: say so instead of only "Socket closed".
        details += (" (the server closed the connection during set-up: if it serves TLS, connect with TLS: "
                    "tls=CA_FILE, --tls-ca or NGRAM_CORPUS_TLS_CA)")
    return to_exception(code, details or code.name)


# The engine's exception classes name the kind of failure; plain ValueError/TypeError is bad input.
_ENGINE_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (exceptions.UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    (exceptions.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (exceptions.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (exceptions.LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (exceptions.StalePolicyVersionError, grpc.StatusCode.FAILED_PRECONDITION),
    (exceptions.BudgetTooLargeError, grpc.StatusCode.OUT_OF_RANGE),
    (KeyError, grpc.StatusCode.NOT_FOUND),  # unknown namespace
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception raised while serving a call."""
    if isinstance(exc, CorpusError):
        return exc.code
    for cls, code in _ENGINE_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    if status_for(exc) == grpc.StatusCode.INTERNAL:
        # An unexpected failure's text may name server paths (OSError): the server logs it, the
        # caller gets its kind only.
        return f"internal error ({type(exc).__name__}; see the corpus server's log)"
    # KeyError's str() quotes its argument; the message itself is what the caller needs.
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
