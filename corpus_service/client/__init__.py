"""Clients of a remote corpus: ``CorpusClient`` (``sync.py``), ``AsyncCorpusClient`` (``aio.py``), the
SGLang-compatible drop-in ``RemoteNgramCorpus`` (``sglang.py``), what a client knows of the service's health
(``health.py``: outages said once, the namespace check), and what they share: the circuit breaker,
the retry policy and the request log that replays live requests on a new session."""

from corpus_service.client.aio import AsyncCorpusClient
from corpus_service.client.circuit_breaker import CircuitBreaker
from corpus_service.client.health import (REACHABLE_NOTE, BackgroundCheck, CorpusHealth, ModelIds, NamespaceMismatch, Note,
                                          check_namespace, model_ids, note_of, unreachable)
from corpus_service.client.policy import RetryPolicy
from corpus_service.client.sglang import RemoteNgramCorpus
from corpus_service.client.sync import CorpusClient
from corpus_service.protocol.status import CorpusError, CorpusInvalidArgument, CorpusOutOfRange, CorpusUnavailable

__all__ = ["REACHABLE_NOTE", "AsyncCorpusClient", "BackgroundCheck", "CircuitBreaker", "CorpusHealth", "ModelIds",
           "NamespaceMismatch", "Note", "check_namespace", "model_ids", "note_of", "unreachable", "CorpusClient", "CorpusError", "CorpusInvalidArgument", "CorpusOutOfRange", "CorpusUnavailable",
           "RemoteNgramCorpus", "RetryPolicy"]
