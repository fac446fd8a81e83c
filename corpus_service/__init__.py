"""Shared n-gram/suffix draft corpus for speculative decoding.

``NgramCorpus`` is the in-process engine; ``CorpusConfig`` configures it; ``Namespaces`` keeps one
engine per tokenizer family.
"""

from corpus_service.engine.config import CorpusConfig
from corpus_service.engine.corpus import DraftBatch, NgramCorpus
from corpus_service.engine.namespaces import Namespaces

__all__ = ["CorpusConfig", "DraftBatch", "NgramCorpus", "Namespaces"]
