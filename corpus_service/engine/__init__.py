"""The in-process corpus: the ``NgramCorpus`` facade over the native engine (``corpus.py``), its
``CorpusConfig`` (``config.py``), one engine per tokenizer family (``namespaces.py``) and the
tokenizers that turn uploaded text into token ids (``tokenizer.py``)."""

from corpus_service.engine.config import MAX_BUDGET, CorpusConfig
from corpus_service.engine.corpus import MAX_GROUP_CHARS, DraftBatch, NgramCorpus, merge_with_earlier, typed_stats

__all__ = ["MAX_BUDGET", "MAX_GROUP_CHARS", "CorpusConfig", "DraftBatch", "NgramCorpus", "merge_with_earlier",
           "typed_stats"]
