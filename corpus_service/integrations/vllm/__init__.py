"""The vLLM plugin: vLLM's ``suffix`` speculative decoding drafts from and feeds the shared corpus.

Found by vLLM's own loader (entry point ``ngram_corpus`` of the group ``vllm.general_plugins``;
``vllm.plugins.load_general_plugins()`` runs it in every vLLM process, possibly more than once),
it replaces vLLM's ``SuffixDecodingProposer`` with a subclass that drafts from the corpus
(``proposer.py``, ``compat.py``). It says in one log line what it did: nothing without
``NGRAM_CORPUS_TARGET``; nothing, and why, on a vLLM whose proposer it was not built for, or with
unusable ``NGRAM_CORPUS_*`` values. It never raises into vLLM's start-up. docs/vllm.md."""

from __future__ import annotations

import logging
import threading

from corpus_service.integrations.settings import IntegrationSettings

log = logging.getLogger("corpus_service.integrations.vllm")

_lock = threading.Lock()
# The first load's outcome in this process, one line (what was logged); later loads return it.
last_outcome = ""


def _say(level: int, line: str) -> str:
    global last_outcome
    last_outcome = line
    log.log(level, "ngram_corpus: %s", line)
    return line


def _load() -> str:
    try:
        settings = IntegrationSettings.from_env()
    except ValueError as e:
        return _say(logging.ERROR, f"{e}: vLLM keeps its own suffix speculation")
    if settings is None:
        return _say(logging.INFO, "NGRAM_CORPUS_TARGET is not set: vLLM keeps its own suffix speculation")
    from corpus_service.integrations.vllm import compat

    why, base = compat.check_engine()
    if why:
        return _say(logging.WARNING, f"{why}: vLLM keeps its own suffix speculation")
    from corpus_service.integrations.vllm.proposer import make_proposer_class

    modules = compat.apply(base, make_proposer_class(base, settings))
    return _say(logging.INFO, f"vLLM's suffix speculation (method 'suffix') drafts from the corpus at "
                              f"{settings.target}, namespace {settings.namespace!r} (patched {', '.join(modules)})")


def load_plugin() -> str:
    """vLLM's entry point. Idempotent: a second call in one process changes nothing and returns the
    first call's line. Returns the line it logged."""
    with _lock:
        if last_outcome:
            return last_outcome
        try:
            return _load()
        except Exception as e:  # never vLLM's start-up's problem
            return _say(logging.ERROR, f"the plugin failed ({type(e).__name__}: {e}): vLLM keeps its own suffix speculation")


__all__ = ["load_plugin"]
