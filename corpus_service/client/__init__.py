"""Clients of a remote corpus: ``CorpusClient`` (``sync.py``), ``AsyncCorpusClient`` (``aio.py``), the
SGLang-compatible drop-in ``RemoteNgramCorpus`` (``sglang.py``), and what they share: the circuit
breaker, the retry policy and the request log that replays live requests on a new session."""

from corpus_service.client.aio import AsyncCorpusClient
from corpus_service.client.circuit_breaker import CircuitBreaker
from corpus_service.client.policy import RetryPolicy
from corpus_service.client.sglang import RemoteNgramCorpus
from corpus_service.client.sync import CorpusClient
from corpus_service.protocol.status import CorpusError, CorpusOutOfRange, CorpusUnavailable

__all__ = ["AsyncCorpusClient", "CircuitBreaker", "CorpusClient", "CorpusError", "CorpusOutOfRange", "CorpusUnavailable",
           "RemoteNgramCorpus", "RetryPolicy"]
