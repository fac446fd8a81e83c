"""The environment an engine plugin reads: where the corpus is and how to reach it.

One dataclass for every engine's plugin, so SGLang and vLLM replicas of one fleet are configured
the same way. Token and TLS reuse the client's variables (``corpus_service.security.tls``):
``NGRAM_CORPUS_TOKEN``, ``NGRAM_CORPUS_TLS_CA``, ``NGRAM_CORPUS_TLS_CLIENT_CERT``,
``NGRAM_CORPUS_TLS_CLIENT_KEY``; ``CorpusClient`` reads them itself."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from corpus_service.engine.namespaces import check_namespace_name

TARGET_ENV = "NGRAM_CORPUS_TARGET"  # host:port of the corpus' gRPC (several: comma-separated replicas)
NAMESPACE_ENV = "NGRAM_CORPUS_NAMESPACE"  # the namespace of the engine's tokenizer
TIMEOUT_ENV = "NGRAM_CORPUS_TIMEOUT"  # seconds one corpus call may take before the step goes without it
CONNECT_TIMEOUT_ENV = "NGRAM_CORPUS_CONNECT_TIMEOUT"  # seconds to reach the corpus at start
RETRY_ENV = "NGRAM_CORPUS_RETRY_SECONDS"  # while the corpus is away: how often to try it again
# seconds a new session may take to re-create the live requests (vLLM's plugin: SGLang's calls keep no session)
REPLAY_TIMEOUT_ENV = "NGRAM_CORPUS_REPLAY_TIMEOUT"
# prompt tokens the vLLM plugin starts on the corpus per step; more new requests wait for later steps
MAX_START_TOKENS_ENV = "NGRAM_CORPUS_MAX_START_TOKENS"
DEFAULT_TIMEOUT = 0.05  # a step never waits longer than this for drafts from the corpus
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_RETRY_SECONDS = 2.0
# Not a step's deadline: a replay of hundreds of long requests outlasts one (corpus_service/client/sync.py).
DEFAULT_REPLAY_TIMEOUT = 10.0
# A step's message must be applied within its deadline: measured 2026-12-06 (2-core host, 50 ms), one step
# starting 128 x 4K prompts at once missed again and again (no drafts in 10 s); 64K a step drafted from the
# first step and had all 128 started after 8 steps (0.2 s), none missed.
DEFAULT_MAX_START_TOKENS = 1 << 16


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {raw!r}")
    return value


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a whole number of tokens, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: expected a positive number of tokens, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class IntegrationSettings:
    target: str  # the corpus' gRPC address
    namespace: str = "default"
    timeout: float = DEFAULT_TIMEOUT  # per call
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    retry_seconds: float = DEFAULT_RETRY_SECONDS
    replay_timeout: float = DEFAULT_REPLAY_TIMEOUT  # steps meanwhile go without the corpus, never wait for it
    # vLLM's plugin: a step's new requests start on the corpus up to this many prompt tokens (unacknowledged
    # starts included), the rest at later steps, oldest first; one longer prompt alone still starts
    max_start_tokens: int = DEFAULT_MAX_START_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError(f"{TARGET_ENV}: expected host:port, got {self.target!r}")
        check_namespace_name(self.namespace)
        for name in ("timeout", "connect_timeout", "retry_seconds", "replay_timeout"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        if isinstance(self.max_start_tokens, bool) or not isinstance(self.max_start_tokens, int) \
                or self.max_start_tokens <= 0:
            raise ValueError(f"max_start_tokens: expected a positive int, got {self.max_start_tokens!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "IntegrationSettings | None":
        """None when ``NGRAM_CORPUS_TARGET`` is unset or empty (the plugin stays inert);
        ``ValueError`` naming the variable when one is set to something unusable."""
        env = os.environ if env is None else env
        target = (env.get(TARGET_ENV) or "").strip()
        if not target:
            return None
        return cls(target=target, namespace=(env.get(NAMESPACE_ENV) or "default").strip(),
                   timeout=_seconds(env, TIMEOUT_ENV, DEFAULT_TIMEOUT),
                   connect_timeout=_seconds(env, CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT),
                   retry_seconds=_seconds(env, RETRY_ENV, DEFAULT_RETRY_SECONDS),
                   replay_timeout=_seconds(env, REPLAY_TIMEOUT_ENV, DEFAULT_REPLAY_TIMEOUT),
                   max_start_tokens=_count(env, MAX_START_TOKENS_ENV, DEFAULT_MAX_START_TOKENS))
