"""``DraftConfig``: how a verifier drafts, one validated dataclass (its fields are ``ngram-verifier
serve`` flags of the same names, nested in ``VerifierConfig.draft``), and ``CorpusEndpoint``: which
corpus service to draft from, as whom."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..flags import flag
from .ask_gate import AskGateConfig

REMOTE_DRAFT_MODES = ("pipelined", "sync")
REMOTE_CLIENTS = ("process", "thread")
REMOTE_ASKS = ("adaptive", "always")


def auto_draft_threads() -> int:
    """Threads for the in-process corpus' batch drafts: a quarter of the CPUs, 1 to 4 (the engine
    thread waits on the GPU meanwhile; the corpus client and server have the rest)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass(frozen=True, slots=True)
class DraftConfig:
    remote_drafts: str = flag(
        "pipelined", "how steps use the corpus service's trees: 'pipelined' merges the tree asked one step ahead "
        "and never waits; 'sync' waits up to --draft-timeout-s for a fresh tree every step (verifier/draft/drafter.py)",
        ", ".join(REMOTE_DRAFT_MODES))
    remote_client: str = flag(
        "process", "where the corpus service's client runs: 'process' (a child process: its Python work never "
        "takes the engine's GIL) or 'thread' (verifier/draft/sources.py)", ", ".join(REMOTE_CLIENTS))
    remote_asks: str = flag(
        "adaptive", "when a pipelined verifier asks the corpus service for trees: 'adaptive' (where its trees add "
        "accepted tokens, measured; verifier/draft/ask_gate.py) or 'always' (every step)", ", ".join(REMOTE_ASKS))
    remote_ask_min_gain: float = flag(
        0.02, "adaptive asks: the share of delivered tokens that only the remote trees drafted below which asks "
        "thin out", "a number 0..1")
    remote_ask_max_interval: int = flag(32, "adaptive asks: the most steps between two asks", "an int >= 1")
    remote_ask_window_tokens: int = flag(256, "adaptive asks: delivered tokens per decision of the ask interval "
                                         "(batch 1: about 90 steps)", "an int >= 1")
    draft_threads: int = flag(
        0, "threads drafting one batch in the in-process corpus (local, or the remote mode's mirror), for batches "
        "of at least 8 requests per thread", "0 (a quarter of the CPUs, 1 to 4) or 1..64")
    draft_timeout_s: float = flag(0.05, "sync remote drafts: the longest wait before drafting in process",
                                  "seconds > 0")
    corpus_timeout_s: float = flag(1.0, "the corpus client's deadline per call, retries included (in the background)",
                                   "seconds > 0")

    def __post_init__(self) -> None:
        if self.remote_drafts not in REMOTE_DRAFT_MODES:
            raise ValueError(f"remote_drafts: expected one of {', '.join(REMOTE_DRAFT_MODES)}, "
                             f"got {self.remote_drafts!r}")
        if self.remote_client not in REMOTE_CLIENTS:
            raise ValueError(f"remote_client: expected one of {', '.join(REMOTE_CLIENTS)}, got {self.remote_client!r}")
        if self.remote_asks not in REMOTE_ASKS:
            raise ValueError(f"remote_asks: expected one of {', '.join(REMOTE_ASKS)}, got {self.remote_asks!r}")
        self.ask_gate  # validates min_gain and max_interval
        if isinstance(self.draft_threads, bool) or not 0 <= self.draft_threads <= 64:
            raise ValueError(f"draft_threads: expected 0 (auto) or 1..64, got {self.draft_threads}")
        if not self.draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s: expected > 0, got {self.draft_timeout_s}")
        if not self.corpus_timeout_s > 0:
            raise ValueError(f"corpus_timeout_s: expected > 0, got {self.corpus_timeout_s}")

    @property
    def ask_gate(self) -> AskGateConfig:
        return AskGateConfig(min_gain=self.remote_ask_min_gain, window_tokens=self.remote_ask_window_tokens,
                             max_interval=self.remote_ask_max_interval)

    @property
    def threads(self) -> int:
        """``draft_threads`` with 0 resolved (``auto_draft_threads``)."""
        return self.draft_threads or auto_draft_threads()

    @property
    def pipelined(self) -> bool:
        return self.remote_drafts == "pipelined"


@dataclass(frozen=True, slots=True)
class CorpusEndpoint:
    """A corpus service to draft from: ``target`` (HOST:PORT, 'H1:P1,H2:P2' or 'dns:///NAME:PORT'), the
    namespace drafted from and fed, the bearer token and the PEM CA file for TLS."""

    target: str
    namespace: str = "default"
    token: str | None = None
    tls: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or ":" not in self.target:
            raise ValueError(f"corpus: expected HOST:PORT of a corpus service, got {self.target!r}")
        if not self.namespace:
            raise ValueError("namespace: expected a namespace name, got ''")

    def __repr__(self) -> str:  # the token stays out of logs
        return f"CorpusEndpoint({self.target!r}, namespace={self.namespace!r}, tls={self.tls!r})"
