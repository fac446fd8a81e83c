"""External corpora loaded at start-up from files, for users who do not run the corpus's REST admin.

``--external-corpus [NAME=]PATH`` (repeatable) loads PATH into the in-process corpus
(``--corpus local``) before the server accepts requests. The formats are the admin upload's
(``corpus_service.admin.uploads``), chosen by the file's suffix: ``.jsonl`` (``{"text": ...}`` or
``{"ids": [...]}`` per line), ``.ids`` (token ids per line), anything else UTF-8 text with
documents separated by blank lines. Text is tokenized with the model's own tokenizer. NAME
defaults to the file's stem. A bad file stops the start-up with the file and line at fault.

A remote corpus (``--corpus HOST:PORT``) is shared by every verifier, so its corpora belong to its
admin: ``ngram-corpus upload FILE --name NAME --namespace NS``; the config refuses the flag there.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from corpus_service import NgramCorpus, read_documents

log = logging.getLogger(__name__)

_TEXT_BATCH = 256  # documents per tokenizer call (the tokenizer parallelizes inside a batch)


@dataclass(frozen=True, slots=True)
class ExternalCorpusFile:
    name: str
    path: Path
    fmt: str  # "jsonl" | "ids" | "text"

    @classmethod
    def parse(cls, spec: str) -> "ExternalCorpusFile":
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"external_corpus: expected [NAME=]PATH, got {spec!r}")
        name, sep, path = spec.partition("=")
        if not sep or os.sep in name:  # no NAME= (an '=' inside a path is part of it)
            name, path = "", spec
        p = Path(path).expanduser()
        fmt = {".jsonl": "jsonl", ".ids": "ids"}.get(p.suffix.lower(), "text")
        return cls(name or p.stem, p, fmt)


def load_external_corpora(corpus: NgramCorpus, specs: tuple[str, ...] | list[str], tokenizer) -> dict[str, int]:
    """Loads each file as a named external corpus (committed atomically, one at a time); returns
    name -> tokens. ``tokenizer``: a ``tokenizers.Tokenizer`` (the model's). ValueError on bad input."""
    files = [ExternalCorpusFile.parse(s) for s in specs]
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"external_corpus: names must be distinct, got {names} (use NAME=PATH)")
    loaded = {}
    for f in files:
        if not f.path.is_file():
            raise ValueError(f"external_corpus: {f.path} is not a readable file")
        corpus.begin_external_corpus(f.name)
        try:
            docs = _load(corpus, f, tokenizer)
            if docs == 0:
                raise ValueError("no documents")
            loaded[f.name] = corpus.commit_external_corpus(f.name)
        except (ValueError, UnicodeDecodeError, OSError) as e:
            if corpus.is_loading_external_corpus(f.name):
                corpus.abort_external_corpus(f.name)
            raise ValueError(f"external_corpus {f.path} ({f.fmt}): {e}") from None
        log.info("external corpus '%s': %d documents, %d tokens from %s", f.name, docs, loaded[f.name], f.path)
    return loaded


def _load(corpus: NgramCorpus, f: ExternalCorpusFile, tokenizer) -> int:
    texts: list[str] = []
    docs = 0

    def add(ids) -> None:
        nonlocal docs
        if len(ids):
            corpus.add_external_chunk(f.name, ids)
            docs += 1

    def flush() -> None:
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            add(enc.ids)
        texts.clear()

    for _, kind, payload in read_documents(f.path, f.fmt, corpus.config.vocab_size, True):
        if kind == "text":
            texts.append(payload)
            if len(texts) >= _TEXT_BATCH:
                flush()
        else:
            add(payload)
    flush()
    return docs
