"""Namespaces: independent corpora in one process, one per tokenizer/model family.

Token ids from different tokenizers never mix: each namespace has its own engine and, optionally,
a vocabulary size that every id is checked against.
"""

from __future__ import annotations

import re
import threading

from corpus_service.config import CorpusConfig
from corpus_service.engine import NgramCorpus

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def check_namespace_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"namespace: expected 1-64 characters of letters, digits, '_', '.', '-' (not starting with "
            f"a symbol), got {name!r}"
        )
    return name


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
