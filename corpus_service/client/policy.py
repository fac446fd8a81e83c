"""What the sync and asyncio clients share: channel options, the retry schedule, response decoding."""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass

import grpc

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service.engine.corpus import DraftBatch, typed_stats
from corpus_service.engine.prompt_keys import check_policy_version
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusError, code_from_value, to_exception

# Keepalive: a client pings its connection every KEEPALIVE_TIME_MS, calls or none, so that a
# server that went away (or a NAT that forgot the flow) is noticed in seconds, not at the next
# call's deadline. Both ends must agree: gRPC's server defaults take one ping per 5 minutes without
# data and answer the third early one with a "too_many_pings" GOAWAY (the verifier's corpus client
# got one). The corpus server accepts pings twice as often as this
# (corpus_service/server/grpc_server.py keepalive_options; tests/corpus_service/test_keepalive.py).
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000  # a ping unanswered this long: the connection is dead


def keepalive_options(time_ms: int = KEEPALIVE_TIME_MS, timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> tuple:
    """A client channel's keepalive options (time_ms: a test's shorter interval)."""
    if not (isinstance(time_ms, int) and isinstance(timeout_ms, int) and time_ms >= 1 and timeout_ms >= 1):
        raise ValueError(f"keepalive: expected positive int milliseconds, got time {time_ms!r}, timeout {timeout_ms!r}")
    return (("grpc.keepalive_time_ms", time_ms),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),  # an idle channel is checked too
            ("grpc.http2.max_pings_without_data", 0))  # (default 2: pinging would stop on an idle stream)


# Reconnect quickly after a server restart (gRPC's default backoff starts at 1 s and grows to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
) + keepalive_options()


def stats_of(ns: pb.NamespaceStats) -> dict[str, int | float]:
    """A namespace's statistics: counters as ints, the rest as floats (a server older than
    ``counters`` sends only doubles: they are typed by the engine's rule)."""
    out = typed_stats(dict(ns.values))
    out.update(ns.counters)
    return out


def describe_of(resp: pb.StatsResponse) -> dict[str, dict]:
    """name -> {"vocab_size", "tokenizer", "tokenizer_probe", "tokenizer_error"} of a Stats answer."""
    return {name: {"vocab_size": int(s.vocab_size), "tokenizer": s.tokenizer,
                   "tokenizer_probe": [int(t) for t in s.tokenizer_probe], "tokenizer_error": s.tokenizer_error}
            for name, s in sorted(resp.namespaces.items())}


def announce_request(namespace: str, version: object) -> pb.AnnouncePolicyVersionRequest:
    """An AnnouncePolicyVersion request, its version checked first (ValueError, TypeError)."""
    v = check_policy_version(version, "version")
    if v < 0:
        raise ValueError("version: expected a non-negative int, got None")
    return pb.AnnouncePolicyVersionRequest(namespace=namespace, version=v)


def channel_target(target: str | list[str] | tuple[str, ...]) -> tuple[str, tuple]:
    """A gRPC target and extra channel options for one corpus or several replicas.

    ``"host:port"`` is one server. Several endpoints (a list, or ``"127.0.0.1:a,127.0.0.1:b"``)
    become one channel over all of them (``ipv4:``/``ipv6:`` target) and ``dns:///NAME:PORT`` (a
    headless Service) one over every address the name resolves to; both balance round-robin, and a
    replica that goes away drops out of the rotation, so a broken session reconnects to another."""
    if isinstance(target, (list, tuple)):
        target = ",".join(target)
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target: expected 'host:port', 'host:port,host:port,...' or 'dns:///name:port', got {target!r}")
    rr = (("grpc.lb_policy_name", "round_robin"),)
    if target.startswith("dns:"):
        return target, rr
    parts = [p.strip() for p in target.split(",") if p.strip()]
    if len(parts) == 1:
        return parts[0], ()
    scheme = "ipv6" if all(p.startswith("[") for p in parts) else "ipv4"
    for p in parts:
        host = p.rsplit(":", 1)[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"target: several endpoints must be IP addresses (use dns:///NAME:PORT for a name "
                             f"with several addresses), got {p!r}") from None
    return f"{scheme}:{','.join(parts)}", rr


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries on UNAVAILABLE with exponential backoff and jitter, within the call's deadline."""

    retries: int = 2
    backoff_s: float = 0.02
    max_backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries: expected an int >= 0, got {self.retries!r}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoff: expected 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}")

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)

    def should_retry(self, err: CorpusError, attempt: int, time_left: float) -> bool:
        return err.code == grpc.StatusCode.UNAVAILABLE and attempt < self.retries and time_left > self.delay(attempt)


def check_response(resp: pb.SessionResponse) -> None:
    if resp.HasField("error"):
        raise to_exception(code_from_value(resp.error.code), resp.error.message)


def settle_step(breaker, log, stream, resp: pb.SessionResponse) -> pb.SessionResponse:
    """A step's reply arrived: the transport worked (breaker), then the step was refused (the
    error is raised) or applied (the log commits it; the session is replayed). A refused step's
    operations are dropped from the log, except when only its draft request was refused (the
    server checks the operations first, so they were valid, and nothing was applied): they stay
    pending for the next step, as a caller whose start and extends returned without error expects
    (a pipelined verifier retries a too-deep tree at a smaller budget right after)."""
    breaker.record_success()
    try:
        check_response(resp)
    except CorpusError:
        if not resp.error.draft_only:  # set by the server only after every other operation passed its checks
            log.discard()
        raise
    stream.replayed = True
    log.commit()
    return resp


def decode_drafts(resp: pb.SessionResponse, n: int) -> DraftBatch:
    if n == 0:
        return DraftBatch(*(arrays.np.zeros((0, 0), dt) for dt in ("int32", "int32", "float32")), arrays.np.zeros(0, "int32"))
    return arrays.unpack_drafts(resp.drafts, n)
