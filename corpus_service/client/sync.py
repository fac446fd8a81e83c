"""Clients of a remote corpus.

- ``CorpusClient``: the engine's request-level API (start_request / extend / draft / finish) over
  one Session stream. start/extend/finish are buffered and travel with the next ``draft`` (or
  ``flush``), so a decode step is one small message each way.
- ``AsyncCorpusClient``: the same for asyncio (``corpus_service.client.aio``).
- ``RemoteNgramCorpus``: the SGLang-compatible drop-in (``corpus_service.client.sglang``).

Failures raise ``CorpusError`` subclasses; ``CorpusUnavailable`` means "draft locally or not at
all": the server is down, draining, or the circuit breaker is open (then it costs microseconds).
After a broken stream the next call opens a new session and replays every live request: the
replay is one message of its own with its own deadline (``replay_timeout``), not the step's, since
re-creating hundreds of long requests can take the server longer than a decode step's deadline
(which would otherwise miss, replay again, and never catch up). Steps that come while it is in
flight fail at once with ``CorpusDeadlineExceeded``; the first step after it goes on as usual.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client.circuit_breaker import CircuitBreaker
from corpus_service.client.policy import (CHANNEL_OPTIONS, RetryPolicy, announce_request, channel_target,
                                          check_response, decode_drafts, describe_of, settle_step, stats_of)
from corpus_service.client.request_log import RequestLog, group_key, history_args, req_id, token_array, token_runs
from corpus_service.engine.corpus import DraftBatch
from corpus_service.protocol.status import (TRANSIENT, CorpusDeadlineExceeded, CorpusError, CorpusUnavailable,
                                            from_rpc_error)
from corpus_service.security.tls import ClientTLS, auth_metadata, open_channel, resolve_tls, resolve_token

_CLOSE = object()
# Measured 2026-12-06: 128-256 live requests x 2-4K tokens (2.1 MB) took a loaded 2-core server
# 0.04-0.07 s to re-create; 10 s leaves room for far larger replays and still gives up on a hung peer.
DEFAULT_REPLAY_TIMEOUT = 10.0


class _Stream:
    """One Session stream: a sender queue and a reader thread matching responses to seq numbers."""

    def __init__(self, stub: pb_grpc.CorpusStub, metadata: tuple = ()) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.broken: CorpusError | None = None
        self.replayed = False
        self.replay: Future | None = None  # the replay in flight, alone on this stream
        self.replay_deadline = 0.0
        self._call = stub.Session(iter(self._q.get, _CLOSE), metadata=metadata or None)
        threading.Thread(target=self._read, name="corpus-session-reader", daemon=True).start()

    def send(self, msg: pb.SessionRequest) -> Future:
        fut: Future = Future()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            self._futures[msg.seq] = fut
        self._q.put(msg)
        return fut

    def _read(self) -> None:
        try:
            for resp in self._call:
                with self._lock:
                    fut = self._futures.pop(resp.seq, None)
                if fut is not None:  # None: the caller gave up (deadline) on this step
                    fut.set_result(resp)
            err: CorpusError = CorpusUnavailable("the corpus server closed the session")
        except grpc.RpcError as e:
            err = from_rpc_error(e)
        with self._lock:
            self.broken = err
            futures, self._futures = self._futures, {}
        for fut in futures.values():
            fut.set_exception(err)

    def close(self) -> None:
        self._q.put(_CLOSE)
        self._call.cancel()


class CorpusClient:
    def __init__(self, target: str, namespace: str = "default", *, timeout: float = 2.0,
                 retry: RetryPolicy | None = None, breaker: CircuitBreaker | None = None,
                 channel: grpc.Channel | None = None, max_pending_tokens: int = 1 << 20,
                 token: str | None = None, tls: ClientTLS | str | bool | None = None,
                 replay_timeout: float = DEFAULT_REPLAY_TIMEOUT) -> None:
        """``token``: the bearer token sent with every call (default: ``NGRAM_CORPUS_TOKEN``);
        ``tls``: a ClientTLS, a CA file, True (system roots), False, or None (``NGRAM_CORPUS_TLS_*``);
        ``replay_timeout``: seconds a new session's replay of the live requests may take (at least
        ``timeout``)."""
        if not 0 < float(replay_timeout) < float("inf"):
            raise ValueError(f"replay_timeout: expected a positive number of seconds, got {replay_timeout!r}")
        self.target, self.namespace, self.timeout = target, namespace, float(timeout)
        self.replay_timeout = max(float(replay_timeout), self.timeout)
        self.retry = retry or RetryPolicy()
        self.breaker = breaker or CircuitBreaker()
        token = resolve_token(token)
        self.metadata = auth_metadata(token)
        self._own_channel = channel is None
        grpc_target, lb = channel_target(target)  # several replicas: one round-robin channel
        self._channel = channel or open_channel(grpc_target, resolve_tls(tls), CHANNEL_OPTIONS + lb, aio=False, token=token)
        self.stub = pb_grpc.CorpusStub(self._channel)
        self._log = RequestLog()
        self._stream: _Stream | None = None
        self._seq = itertools.count(1)
        self._lock = threading.RLock()  # one step at a time: steps mutate the request log
        self.max_pending_tokens = max_pending_tokens

    # ------------------------------------------------------------------ request-level API

    def start_request(self, req_id_: object, prompt_ids: Sequence[int] | np.ndarray, group: str | None = None, *,
                      prompt_key: str | None = None, policy_version: int | None = None) -> None:
        """``group``: requests of one key (the n samples of one prompt) draft from each other.
        ``prompt_key`` and ``policy_version``: as ``NgramCorpus.start_request`` (the prompt history)."""
        rid, prompt, key = req_id(req_id_), token_array(prompt_ids, "prompt"), group_key(group)
        history = history_args(prompt_key, policy_version)
        with self._lock:
            if self._log.needs_flush_before_start(rid):
                self.flush()
            self._log.start(rid, prompt, key, history)
            self._maybe_flush()

    def extend(self, req_id_: object, token_ids: Sequence[int] | np.ndarray) -> None:
        with self._lock:
            self._log.extend(req_id(req_id_), token_array(token_ids, "tokens"))
            self._maybe_flush()

    def extend_many(self, items: Sequence[tuple[object, Sequence[int] | np.ndarray]]) -> None:
        """``extend`` for several requests (a verifier step's commits): one validation of all their
        tokens and one buffer update, all or none."""
        if not items:
            return
        rids, runs = token_runs(items)
        with self._lock:
            self._log.extend_many(rids, runs)
            self._maybe_flush()

    def finish(self, req_id_: object, *, rollout: bool = True) -> None:
        """``rollout=False``: the request ended without finishing (aborted); its output does not
        join its prompt key's history."""
        with self._lock:
            self._log.finish(req_id(req_id_), bool(rollout))

    def pending_start_tokens(self) -> int:
        """Prompt tokens of the started requests the server has not acknowledged yet: the next
        step carries them (a caller bounds a step's message by them, as vLLM's plugin does)."""
        with self._lock:
            return self._log.pending_start_tokens()

    def has_request(self, req_id_: object) -> bool:
        with self._lock:
            return self._log.is_live(req_id(req_id_))

    def draft(self, req_ids: Sequence[object], budget: int, timeout: float | None = None) -> DraftBatch:
        """Sends the buffered operations and drafts trees of at most ``budget`` nodes."""
        ids = [req_id(r) for r in req_ids]
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ValueError(f"budget: expected an int >= 1, got {budget!r}")
        with self._lock:
            for rid in ids:
                if not self._log.is_live(rid):
                    raise ValueError(f"unknown request id '{rid}' (never started, or finished)")
            return decode_drafts(self._step(ids, int(budget), timeout), len(ids))

    def flush(self, timeout: float | None = None) -> None:
        """Sends the buffered operations and waits for the acknowledgement."""
        with self._lock:
            if self._log.has_pending():
                self._step([], 0, timeout)

    # ------------------------------------------------------------------ other calls

    def synchronize(self, timeout: float | None = None) -> None:
        """Sends the buffered operations, then waits until the server applied every queued
        learned-corpus insert (inserts are asynchronous, as in the engine)."""
        self.flush(timeout)
        self.unary(self.stub.BatchPut, pb.BatchPutRequest(namespace=self.namespace, synchronize=True), timeout)

    def stats(self, timeout: float | None = None) -> dict[str, int | float]:
        """This namespace's statistics: counters as ints, seconds and ratios as floats."""
        resp = self.unary(self.stub.Stats, pb.StatsRequest(namespace=self.namespace), timeout)
        return stats_of(resp.namespaces[self.namespace])

    def describe_namespaces(self, timeout: float = 30.0) -> dict[str, dict]:
        """Every namespace this client may read: name -> ('vocab_size', 'tokenizer', 'tokenizer_probe', 'tokenizer_error'). A verifier compares ``tokenizer_probe`` with its
        own tokenizer's ids of ``ngram_common.tokenizer.PROBE_TEXT``. The default timeout leaves
        room for a server that is still loading a tokenizer (seconds for a GGUF)."""
        return describe_of(self.unary(self.stub.Stats, pb.StatsRequest(describe=True), timeout))

    def reset(self, timeout: float | None = None) -> None:
        self.unary(self.stub.Reset, pb.ResetRequest(namespace=self.namespace), timeout)

    def announce_policy_version(self, version: int, timeout: float | None = None) -> int:
        """The policy's weights changed: the namespace's policy version moves forward to ``version``
        (admin role; an older one raises CorpusFailedPrecondition). Returns the namespace's version."""
        v = announce_request(self.namespace, version)
        return int(self.unary(self.stub.AnnouncePolicyVersion, v, timeout).version)

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
            if self._own_channel:
                self._channel.close()

    def __enter__(self) -> "CorpusClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _maybe_flush(self) -> None:
        if self._log.pending_tokens() > self.max_pending_tokens:
            self.flush()

    def _step(self, draft_ids: list[str], budget: int, timeout: float | None) -> pb.SessionResponse:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        stream = self._stream
        earlier_replay = stream is not None and stream.replay is not None and stream.broken is None
        if not earlier_replay:
            self.breaker.check()  # (a replay in flight is the breaker's trial call: its outcome settles it)
        for attempt in itertools.count():
            try:
                if self._stream is None or self._stream.broken is not None:
                    self._stream, earlier_replay = _Stream(self.stub, self.metadata), False
                stream = self._stream
                # A replay an earlier step sent is only looked at (a hung peer costs no step its deadline);
                # one this step sends gets half the step's time, so that the step's own message has the rest.
                now = time.monotonic()
                if not self._replayed(stream, now if earlier_replay else now + (deadline - now) / 2):
                    break
                msg = self._log.build(next(self._seq), self.namespace, draft_ids, budget, replay=False)
                try:
                    resp = stream.send(msg).result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    # The step's fate is unknown: a new session replays the log, so both sides agree again.
                    raise CorpusDeadlineExceeded(f"no answer from the corpus within the deadline ({self.target})") from None
            except CorpusError as e:
                if e.code in TRANSIENT:
                    self._drop_stream()
                    self.breaker.record_failure(str(e))
                    left = deadline - time.monotonic()
                    if self.retry.should_retry(e, attempt, left):
                        time.sleep(self.retry.delay(attempt))
                        continue
                raise
            return settle_step(self.breaker, self._log, stream, resp)
        raise CorpusDeadlineExceeded(f"the corpus is still re-creating this client's {len(self._log.prompts)} live "
                                     f"requests in a new session ({self.target}); this step goes without it")

    def _replayed(self, stream: _Stream, deadline: float) -> bool:
        """Whether the server has every confirmed live request on this stream: the replay is sent
        once, alone, and waited for until ``deadline`` (a step's); False while it is still in flight
        within ``replay_timeout``. A replay that took longer, or failed, breaks the session (the
        next step opens another and replays again)."""
        if stream.replayed:
            return True
        if stream.replay is None:
            if not self._log.prompts:
                stream.replayed = True
                return True
            stream.replay = stream.send(self._log.restore(next(self._seq), self.namespace))
            stream.replay_deadline = time.monotonic() + self.replay_timeout
        try:
            resp = stream.replay.result(timeout=max(0.0, min(deadline, stream.replay_deadline) - time.monotonic()))
        except FutureTimeout:
            if time.monotonic() < stream.replay_deadline:
                return False
            raise CorpusDeadlineExceeded(f"the corpus did not re-create {len(self._log.prompts)} live requests within "
                                         f"replay_timeout {self.replay_timeout:g}s ({self.target})") from None
        self.breaker.record_success()
        stream.replay = None
        try:
            check_response(resp)
        except CorpusError:
            self._drop_stream()  # refused, so nothing of it was applied: the next step starts over
            raise
        stream.replayed = True
        return True

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def unary(self, method, request, timeout: float | None):
        self.breaker.check()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for attempt in itertools.count():
            try:
                resp = method(request, timeout=max(0.0, deadline - time.monotonic()), metadata=self.metadata or None)
            except grpc.RpcError as rpc_error:
                e = from_rpc_error(rpc_error)
                if e.code in TRANSIENT:
                    self.breaker.record_failure(str(e))
                    if self.retry.should_retry(e, attempt, deadline - time.monotonic()):
                        time.sleep(self.retry.delay(attempt))
                        continue
                raise e from None
            self.breaker.record_success()
            return resp
        raise AssertionError("unreachable")


__all__ = ["CircuitBreaker", "CorpusClient", "CorpusError", "CorpusUnavailable", "RetryPolicy"]
