"""AsyncCorpusClient: ``CorpusClient`` for asyncio (grpc.aio), same semantics and errors.

Every call is awaitable, as every ``CorpusClient`` call may block: ``start_request``, ``extend``,
``extend_many`` and ``finish`` buffer their operation (it rides on the next ``draft`` or ``flush``)
and send it themselves only when they must, as the sync client does: a restart of an id finished in
the pending step is flushed first, and more than ``max_pending_tokens`` buffered tokens are flushed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.client.circuit_breaker import CircuitBreaker
from corpus_service.client.policy import (CHANNEL_OPTIONS, RetryPolicy, announce_request, channel_target, decode_drafts,
                                          describe_of, settle_step, stats_of)
from corpus_service.client.request_log import RequestLog, group_key, history_args, req_id, token_array, token_runs
from corpus_service.engine.corpus import DraftBatch
from corpus_service.protocol.status import (TRANSIENT, CorpusDeadlineExceeded, CorpusError, CorpusUnavailable,
                                            from_rpc_error)
from corpus_service.security.tls import ClientTLS, auth_metadata, open_channel, resolve_tls, resolve_token


class _AioStream:
    """One Session stream. A step writes its message and reads the reply in the calling task: no
    reader task and no future between them (each hop costs an event-loop iteration, ~0.1 ms a step).
    One step at a time (the client's lock); a step that gave up (deadline) leaves the stream broken,
    so no stale reply is ever read. A server that ended the stream is seen through ``call.done()``."""

    def __init__(self, stub: pb_grpc.CorpusStub, metadata: tuple = ()) -> None:
        self._call = stub.Session(metadata=metadata or None)
        self.broken: CorpusError | None = None
        self.replayed = False
        self._closed = False

    def usable(self) -> bool:
        return self.broken is None and not self._call.done()

    async def exchange(self, msg: pb.SessionRequest, timeout: float) -> pb.SessionResponse:
        """Sends ``msg`` and returns its reply; CorpusDeadlineExceeded after ``timeout`` seconds.
        The deadline cancels this task, not only the call: a call cancelled before its stream's
        headers were sent (a peer that accepts the connection and never answers) leaves grpc.aio's
        write waiting for them forever, whatever the call's state (grpcio 1.85)."""
        if self.broken is not None:
            raise self.broken
        try:
            async with asyncio.timeout(timeout):
                return await self._exchange(self._call, msg)
        except TimeoutError as e:
            if isinstance(e, CorpusError):  # (CorpusDeadlineExceeded is a TimeoutError too)
                raise
            self._expire()
            raise self.broken from None

    async def _exchange(self, call, msg: pb.SessionRequest) -> pb.SessionResponse:
        written = False
        try:
            try:
                await call.write(msg)
                written = True
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass  # the read below reports the call's status
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise self._fail(CorpusUnavailable("the corpus server closed the session"))
                if resp.seq == msg.seq:
                    return resp
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            if not written and err.code == grpc.StatusCode.INTERNAL:
                # The transport dropped the stream under the write (a killed server): gRPC reports
                # "Internal error from Core"; the step never arrived, so it is safe to retry elsewhere.
                err = CorpusUnavailable(f"the session stream broke: {e.details()}")
            raise self._fail(self.broken or err) from None
        except asyncio.InvalidStateError:
            raise self._fail(self.broken or CorpusUnavailable("the session stream is closed")) from None
        except asyncio.CancelledError:
            if self.broken is None and not self._closed:
                raise  # the caller was cancelled, or the deadline (exchange turns that into its error)
            raise self._fail(self.broken or CorpusUnavailable("the session stream was closed")) from None

    def _expire(self) -> None:
        # The step's fate is unknown: a new session replays the log, so both sides agree again.
        self._fail(CorpusDeadlineExceeded("no answer from the corpus within the deadline"))
        self._call.cancel()

    def _fail(self, err: CorpusError) -> CorpusError:
        if self.broken is None:
            self.broken = err
        return self.broken

    def close(self) -> None:
        self._closed = True
        self._call.cancel()


class AsyncCorpusClient:
    def __init__(self, target: str, namespace: str = "default", *, timeout: float = 2.0,
                 retry: RetryPolicy | None = None, breaker: CircuitBreaker | None = None,
                 channel: grpc.aio.Channel | None = None, max_pending_tokens: int = 1 << 20,
                 token: str | None = None, tls: ClientTLS | str | bool | None = None) -> None:
        self.target, self.namespace, self.timeout = target, namespace, float(timeout)
        self.retry = retry or RetryPolicy()
        self.breaker = breaker or CircuitBreaker()
        token = resolve_token(token)  # token and tls as in CorpusClient
        self.metadata = auth_metadata(token)
        self._own_channel = channel is None
        grpc_target, lb = channel_target(target)  # several replicas: one round-robin channel
        self._channel = channel or open_channel(grpc_target, resolve_tls(tls), CHANNEL_OPTIONS + lb, aio=True, token=token)
        self.stub = pb_grpc.CorpusStub(self._channel)
        self._log = RequestLog()
        self._stream: _AioStream | None = None
        self._seq = itertools.count(1)
        self._lock = asyncio.Lock()  # one step at a time: steps mutate the request log
        self.max_pending_tokens = max_pending_tokens

    # Buffered operations: they touch the local log and send only when they must (see above).
    async def start_request(self, req_id_: object, prompt_ids: Sequence[int] | np.ndarray,
                            group: str | None = None, *, prompt_key: str | None = None,
                            policy_version: int | None = None) -> None:
        """``group``: requests of one key (the n samples of one prompt) draft from each other.
        ``prompt_key`` and ``policy_version``: as ``NgramCorpus.start_request`` (the prompt history)."""
        rid, prompt, key = req_id(req_id_), token_array(prompt_ids, "prompt"), group_key(group)
        history = history_args(prompt_key, policy_version)
        if self._log.needs_flush_before_start(rid):  # a step applies starts before finishes
            await self.flush()
        self._log.start(rid, prompt, key, history)
        await self._maybe_flush()

    async def extend(self, req_id_: object, token_ids: Sequence[int] | np.ndarray) -> None:
        self._log.extend(req_id(req_id_), token_array(token_ids, "tokens"))
        await self._maybe_flush()

    async def extend_many(self, items: Sequence[tuple[object, Sequence[int] | np.ndarray]]) -> None:
        """``extend`` for several requests (a verifier step's commits): one validation of all their
        tokens, all or none (a per-request ``extend`` validates each run with numpy calls of its own)."""
        if items:
            self._log.extend_many(*token_runs(items))
            await self._maybe_flush()

    async def finish(self, req_id_: object, *, rollout: bool = True) -> None:
        """``rollout=False``: the request ended without finishing (aborted); its output does not
        join its prompt key's history."""
        self._log.finish(req_id(req_id_), bool(rollout))

    async def _maybe_flush(self) -> None:
        if self._log.pending_tokens() > self.max_pending_tokens:
            await self.flush()

    def has_request(self, req_id_: object) -> bool:
        return self._log.is_live(req_id(req_id_))

    def must_flush_before_start(self, req_id_: object) -> bool:
        """Whether starting this id sends the pending step first: it was finished in that step (a
        step applies starts before finishes), so ``start_request`` flushes before it buffers."""
        return self._log.needs_flush_before_start(req_id(req_id_))

    async def draft(self, req_ids: Sequence[object], budget: int, timeout: float | None = None) -> DraftBatch:
        ids = [req_id(r) for r in req_ids]
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ValueError(f"budget: expected an int >= 1, got {budget!r}")
        for rid in ids:
            if not self._log.is_live(rid):
                raise ValueError(f"unknown request id '{rid}' (never started, or finished)")
        async with self._lock:
            return decode_drafts(await self._step(ids, int(budget), timeout), len(ids))

    async def flush(self, timeout: float | None = None) -> None:
        async with self._lock:
            if self._log.has_pending():
                await self._step([], 0, timeout)

    async def synchronize(self, timeout: float | None = None) -> None:
        """Sends the buffered operations, then waits until the server applied every queued
        learned-corpus insert (inserts are asynchronous, as in the engine)."""
        await self.flush(timeout)
        await self.unary(self.stub.BatchPut, pb.BatchPutRequest(namespace=self.namespace, synchronize=True), timeout)

    async def stats(self, timeout: float | None = None) -> dict[str, int | float]:
        """This namespace's statistics: counters as ints, seconds and ratios as floats."""
        resp = await self.unary(self.stub.Stats, pb.StatsRequest(namespace=self.namespace), timeout)
        return stats_of(resp.namespaces[self.namespace])

    async def describe_namespaces(self, timeout: float = 30.0) -> dict[str, dict]:
        """Every namespace this client may read: name -> ('vocab_size', 'tokenizer', 'tokenizer_probe', 'tokenizer_error'). A verifier compares ``tokenizer_probe`` with its
        own tokenizer's ids of ``ngram_common.tokenizer.PROBE_TEXT``. The default timeout leaves
        room for a server that is still loading a tokenizer (seconds for a GGUF)."""
        return describe_of(await self.unary(self.stub.Stats, pb.StatsRequest(describe=True), timeout))

    async def reset(self, timeout: float | None = None) -> None:
        await self.unary(self.stub.Reset, pb.ResetRequest(namespace=self.namespace), timeout)

    async def announce_policy_version(self, version: int, timeout: float | None = None) -> int:
        """The policy's weights changed: the namespace's policy version moves forward to ``version``
        (admin role; an older one raises CorpusFailedPrecondition). Returns the namespace's version."""
        request = announce_request(self.namespace, version)
        return int((await self.unary(self.stub.AnnouncePolicyVersion, request, timeout)).version)

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncCorpusClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _step(self, draft_ids: list[str], budget: int, timeout: float | None) -> pb.SessionResponse:
        self.breaker.check()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for attempt in itertools.count():
            try:
                if self._stream is None or not self._stream.usable():
                    self._drop_stream()
                    self._stream = _AioStream(self.stub, self.metadata)
                stream = self._stream
                msg = self._log.build(next(self._seq), self.namespace, draft_ids, budget, replay=not stream.replayed)
                try:
                    resp = await stream.exchange(msg, max(0.0, deadline - time.monotonic()))
                except CorpusDeadlineExceeded:
                    raise CorpusDeadlineExceeded(f"no answer from the corpus within the deadline ({self.target})") from None
            except CorpusError as e:
                if e.code in TRANSIENT:
                    self._drop_stream()
                    self.breaker.record_failure(str(e))
                    if self.retry.should_retry(e, attempt, deadline - time.monotonic()):
                        await asyncio.sleep(self.retry.delay(attempt))
                        continue
                raise
            return settle_step(self.breaker, self._log, stream, resp)
        raise AssertionError("unreachable")

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    async def unary(self, method, request, timeout: float | None):
        self.breaker.check()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for attempt in itertools.count():
            try:
                resp = await method(request, timeout=max(0.0, deadline - time.monotonic()), metadata=self.metadata or None)
            except grpc.RpcError as rpc_error:
                e = from_rpc_error(rpc_error)
                if e.code in TRANSIENT:
                    self.breaker.record_failure(str(e))
                    if self.retry.should_retry(e, attempt, deadline - time.monotonic()):
                        await asyncio.sleep(self.retry.delay(attempt))
                        continue
                raise e from None
            self.breaker.record_success()
            return resp
        raise AssertionError("unreachable")
