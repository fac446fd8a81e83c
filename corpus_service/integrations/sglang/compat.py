"""Whether the installed SGLang is one this plugin was built for, checked before anything is hooked.

The replacement must take the constructor arguments SGLang's NGRAM worker passes and answer the calls
it makes, so the plugin compares SGLang's own ``NgramCorpus`` (its constructor's parameters and its
methods) and the worker's source (the keywords it constructs the corpus with, the calls it makes)
with SGLang 0.5.23's. Any difference: SGLang keeps its own corpus and the plugin says why in one line.
Reading the worker's source instead of importing it: the worker module needs sgl-kernel (a GPU
build), and the check must not crash, or slow down, a process that never drafts."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import re

CORPUS_MODULE = "sglang.srt.speculative.cpp_ngram.ngram_corpus"
CORPUS_TARGET = CORPUS_MODULE + ".NgramCorpus"
WORKER_MODULE = "sglang.srt.speculative.ngram_worker"
WORKER_CLASS = WORKER_MODULE + ".NGRAMWorker"
TESTED_VERSIONS = ("0.5.23",)

# SGLang 0.5.23's NgramCorpus.__init__ parameters, in order (the worker passes them all by keyword).
CONSTRUCTOR_ARGS = ("max_trie_depth", "min_bfs_breadth", "max_bfs_breadth", "draft_token_num", "match_type",
                    "capacity", "external_sam_budget", "external_corpus_max_tokens")
# Every method the worker, its ExternalCorpusManager and the scheduler call, with their parameters.
METHODS = {
    "batch_get": ("req_ids", "batch_tokens", "total_lens"),
    "batch_put": ("batch_tokens",),
    "synchronize": (),
    "reset": (),
    "erase_match_state": ("req_ids",),
    "load_external_corpus_named": ("corpus_id", "chunks"),
    "commit_external_corpus_load": ("corpus_id", "loaded_token_count"),
    "remove_external_corpus": ("corpus_id",),
    "list_external_corpora": (),
}
# What the worker's source must contain: the calls above made the way this plugin answers them.
WORKER_CALLS = (r"self\.ngram_corpus\.batch_get\(\s*req_ids,\s*batch_tokens,\s*total_lens\s*\)",
                r"self\.ngram_corpus\.batch_put\(batch_tokens\)", r"self\.ngram_corpus\.synchronize\(\)",
                r"self\.ngram_corpus\.erase_match_state\(", r"def _prepare_draft_tokens\(\s*self,\s*batch",
                r"self\.draft_token_num\s*=")


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_mismatch(version: str | None) -> str:
    """Why SGLang ``version`` (None: not installed) is not one this plugin replaces the corpus of ('' if it is)."""
    if version is None:
        return "SGLang is not installed"
    if version not in TESTED_VERSIONS:
        return f"SGLang {version} is not a version this plugin was built for ({', '.join(TESTED_VERSIONS)})"
    return ""


def _params(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def corpus_mismatch(cls: type) -> str:
    """Why ``cls`` (SGLang's NgramCorpus) is not the class this plugin replaces ('' when it is)."""
    got = _params(cls.__init__)
    if got != CONSTRUCTOR_ARGS:
        return f"NgramCorpus.__init__ takes ({', '.join(got)}), built for ({', '.join(CONSTRUCTOR_ARGS)})"
    for name, args in METHODS.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return f"NgramCorpus has no {name}()"
        if _params(fn) != args:
            return f"NgramCorpus.{name} takes ({', '.join(_params(fn))}), built for ({', '.join(args)})"
    if not isinstance(inspect.getattr_static(cls, "remaining_token_budget", None), property):
        return "NgramCorpus has no remaining_token_budget property"
    return ""


def worker_mismatch(source: str) -> str:
    """Why the NGRAM worker's ``source`` does not drive its corpus as this plugin expects ('' if it does)."""
    call = re.search(r"self\.ngram_corpus\s*=\s*NgramCorpus\((.*?)\n\s*\)", source, re.S)
    if call is None:
        return "the NGRAM worker does not build its corpus as NgramCorpus(...)"
    passed = tuple(sorted(re.findall(r"(\w+)\s*=", call.group(1))))
    if passed != tuple(sorted(CONSTRUCTOR_ARGS)):
        return f"the NGRAM worker builds NgramCorpus({', '.join(passed)}), built for ({', '.join(sorted(CONSTRUCTOR_ARGS))})"
    for pattern in WORKER_CALLS:
        if re.search(pattern, source) is None:
            return f"the NGRAM worker's source has no match for {pattern!r}"
    return ""


def check_engine() -> str:
    """'' when the installed SGLang is one this plugin replaces the corpus of, else why not (one line)."""
    version = sglang_version()
    why = version_mismatch(version)
    if why:
        return why
    spec = importlib.util.find_spec(WORKER_MODULE)
    if spec is None or spec.origin is None:
        return f"SGLang {version} has no {WORKER_MODULE}"
    try:
        with open(spec.origin, encoding="utf-8") as f:
            why = worker_mismatch(f.read())
        if why:
            return why
        module = importlib.import_module(CORPUS_MODULE)
    except Exception as e:  # an SGLang this plugin cannot read: leave it as it is
        return f"cannot inspect SGLang {version}'s NGRAM corpus: {type(e).__name__}: {e}"
    return corpus_mismatch(module.NgramCorpus)
