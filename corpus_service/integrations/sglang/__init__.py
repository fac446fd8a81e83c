"""The SGLang plugin: SGLang's NGRAM speculative decoding drafts from and feeds the shared corpus.

Found by SGLang's own loader (entry point ``ngram_corpus`` of the group ``sglang.srt.plugins``;
``sglang.srt.plugins.load_plugins()`` runs it in every SGLang process), it registers a class REPLACE
hook of ``sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus`` with ``SharedNgramCorpus``,
plus two hooks on the NGRAM worker (``worker_hooks.py``). It says in one log line what it did:
nothing without ``NGRAM_CORPUS_TARGET``; nothing, and why, on an SGLang other than the one it was
built for (``compat.py``). It never raises into SGLang's start-up: bad ``NGRAM_CORPUS_*`` values
surface as one clear error when the NGRAM worker builds its corpus. docs/sglang.md."""

from __future__ import annotations

import importlib.util
import logging

from corpus_service.integrations.settings import IntegrationSettings

log = logging.getLogger("corpus_service.integrations.sglang")

# The last load's outcome, one line (what was logged): for tests and for anyone asking.
last_outcome = ""


def _say(level: int, line: str) -> str:
    global last_outcome
    last_outcome = line
    log.log(level, "ngram_corpus: %s", line)
    return line


def _register(settings_error: str) -> str:
    """Registers the REPLACE hook (and the worker hooks where SGLang can run its NGRAM worker); returns
    what was registered, in words."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from corpus_service.integrations.sglang.compat import CORPUS_TARGET
    from corpus_service.integrations.sglang.corpus import SharedNgramCorpus

    SharedNgramCorpus.settings_error = settings_error
    HookRegistry.register(CORPUS_TARGET, SharedNgramCorpus, HookType.REPLACE)
    if importlib.util.find_spec("sgl_kernel") is None:
        return "no worker hooks: sgl-kernel is not installed, so SGLang cannot run its NGRAM worker in this environment"
    from corpus_service.integrations.sglang.worker_hooks import HOOKS

    for target, hook in HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    return "worker hooks: namespace checked against the model at start, prompt keys from each request"


def load_plugin() -> str:
    """SGLang's entry point. Returns the line it logged."""
    try:
        settings, settings_error = IntegrationSettings.from_env(), ""
    except ValueError as e:
        settings, settings_error = None, str(e)
    if settings is None and not settings_error:
        return _say(logging.INFO, "NGRAM_CORPUS_TARGET is not set: SGLang keeps its own n-gram corpus")
    try:
        from corpus_service.integrations.sglang.compat import check_engine

        why = check_engine()
    except Exception as e:  # never SGLang's start-up's problem
        why = f"cannot check SGLang: {type(e).__name__}: {e}"
    if why:
        return _say(logging.WARNING, f"{why}: SGLang keeps its own n-gram corpus")
    try:
        hooks = _register(settings_error)
    except Exception as e:  # a registry this plugin cannot use: SGLang keeps its corpus, start-up goes on
        return _say(logging.WARNING, f"cannot register hooks with SGLang ({type(e).__name__}: {e}): "
                                     f"SGLang keeps its own n-gram corpus")
    if settings_error:
        return _say(logging.ERROR, f"NgramCorpus replaced, but {settings_error}: the NGRAM worker will fail to start")
    return _say(logging.INFO, f"NgramCorpus replaced by the shared corpus at {settings.target}, namespace "
                              f"{settings.namespace!r} ({hooks})")


__all__ = ["load_plugin"]
