"""The corpus' namespace checked against the SGLang replica, once, at start-up.

Bad configuration is one clear error at start (``ValueError``, which fails SGLang's start-up with
its message), never a per-step log flood: a namespace the corpus does not serve, a token it refuses,
a vocabulary or tokenizer other than the model's. A corpus that cannot be reached is not a
configuration error: the replica starts on local drafting and checks again when the corpus answers."""

from __future__ import annotations

from corpus_service.integrations.settings import NAMESPACE_ENV, TARGET_ENV
from corpus_service.protocol.status import TRANSIENT, CorpusError
from ngram_common.tokenizer import PROBE_TEXT
from corpus_service.client.health import ModelIds, NamespaceMismatch, namespace_verdict


def reachable_namespaces(client, timeout: float) -> dict[str, dict] | None:
    """``client.describe_namespaces`` (name -> vocab_size, tokenizer, tokenizer_probe); None when the
    corpus cannot be reached; ValueError when it refuses the call (a token it does not know...)."""
    try:
        return client.describe_namespaces(timeout=timeout)
    except CorpusError as e:
        if e.code in TRANSIENT:
            return None
        which = "NGRAM_CORPUS_TOKEN" if e.code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED") else TARGET_ENV
        raise ValueError(f"{which}: the corpus at {client.target} refused the plugin ({e.code.name}: {e}); "
                         f"check NGRAM_CORPUS_TOKEN and the TLS settings (docs/sglang.md)") from None


def check_served(target: str, namespace: str, served: dict[str, dict]) -> None:
    if namespace not in served:
        names = ", ".join(sorted(served)) or "none this token may read"
        raise ValueError(f"{NAMESPACE_ENV}: the corpus at {target} has no namespace {namespace!r} "
                         f"(it serves: {names})")


def check_model(target: str, namespace: str, served: dict[str, dict], vocab_size: int, tokenizer=None) -> str:
    """What was checked (one line), or ValueError when the namespace serves another model's token ids.
    ``tokenizer``: the model's (HF ``encode``), None when SGLang runs without one (then only the
    vocabulary size is compared)."""
    check_served(target, namespace, served)
    info = served[namespace]
    if tokenizer is None:
        vocab = int(info.get("vocab_size") or 0)
        if vocab and vocab != int(vocab_size):
            raise ValueError(f"{NAMESPACE_ENV}: namespace {namespace!r} of the corpus at {target} has a vocabulary "
                             f"of {vocab} ids, the model's has {vocab_size}")
        return f"namespace {namespace!r}: vocabulary {vocab or 'not declared'} (no tokenizer to compare)"
    probe = tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    try:
        return namespace_verdict(target, namespace, served, ModelIds(int(vocab_size), probe))
    except NamespaceMismatch as e:
        raise ValueError(str(e).replace("set --corpus-namespace", f"set {NAMESPACE_ENV}")) from None
