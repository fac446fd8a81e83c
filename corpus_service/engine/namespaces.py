"""Namespaces: independent corpora in one process, one per tokenizer/model family.

Token ids from different tokenizers never mix: each namespace has its own engine and, optionally,
a vocabulary size that every id is checked against.
"""

from __future__ import annotations

import threading

from corpus_service.engine.config import CorpusConfig
from corpus_service.engine.corpus import NgramCorpus
from corpus_service.names import check_namespace_name

__all__ = ["Namespaces", "check_namespace_name"]  # the name rule is re-exported: older imports use it


class Namespaces:
    """A registry of named ``NgramCorpus`` engines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._corpora: dict[str, NgramCorpus] = {}

    def create(self, name: str, config: CorpusConfig | None = None) -> NgramCorpus:
        check_namespace_name(name)
        with self._lock:
            if name in self._corpora:
                raise ValueError(f"namespace '{name}' already exists")
            corpus = NgramCorpus(config)
            self._corpora[name] = corpus
            return corpus

    def get(self, name: str) -> NgramCorpus:
        with self._lock:
            try:
                return self._corpora[name]
            except KeyError:
                raise KeyError(f"unknown namespace '{name}' (known: {sorted(self._corpora)})") from None

    def drop(self, name: str) -> None:
        with self._lock:
            if self._corpora.pop(name, None) is None:
                raise KeyError(f"unknown namespace '{name}'")

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._corpora)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._corpora
