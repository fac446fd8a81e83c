"""The gRPC servicer (grpc.aio): Session streams, SGLang-style unary calls, stats, reset.

Engine calls release the GIL; steps that draft more than ``inline_work`` nodes run on the thread
pool so one client's large batch does not stall every other stream, while small steps run on the
loop itself (a thread hop costs about as much as drafting a few trees).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from corpus_service._proto.ngram_corpus.v1 import corpus_pb2 as pb
from corpus_service._proto.ngram_corpus.v1 import corpus_pb2_grpc as pb_grpc
from corpus_service.admin.catalog import Catalog
from corpus_service.client.policy import KEEPALIVE_TIME_MS
from corpus_service.names import check_corpus_name
from corpus_service.protocol import arrays
from corpus_service.protocol.status import CorpusError, DraftRefused, message_for, status_for
from corpus_service.security.auth import AuthError, Principal, Role, current_principal
from corpus_service.security.rate_limit import RateLimited, RateLimiter, peer_host
from corpus_service.server.handlers import Malformed
from corpus_service.server.housekeeping import Housekeeping
from corpus_service.server.policy_versions import announce, publish_rollout
from corpus_service.server.session import Session, check_flat_tokens, check_history_fields, check_req_ids, check_tokens
from corpus_service.server.state import ServiceState

log = logging.getLogger("corpus_service.server")
MAX_CLIENT_ID_CHARS = 128


def keepalive_options(client_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    """What the server accepts of its clients' keepalive pings (corpus_service/client/policy.py):
    pings on idle connections, as often as every half of the clients' interval (timers drift), so
    that a client's pings never count as strikes towards a "too_many_pings" GOAWAY."""
    return [("grpc.keepalive_permit_without_calls", 1),
            # (the receiving side's limit, the one gRPC's servers enforce; a sender's own is
            # grpc.http2.min_time_between_pings_ms)
            ("grpc.http2.min_ping_interval_without_data_ms", max(1, client_time_ms // 2)),
            ("grpc.http2.max_ping_strikes", 2)]


def _unary(method: Callable) -> Callable:
    """Maps exceptions to status codes, refuses calls while draining, records metrics."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: "CorpusServicer", request, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if self.state.draining:
                raise CorpusError("the corpus server is draining (shutting down)", grpc.StatusCode.UNAVAILABLE)
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise CorpusError(f"{name}: deadline exceeded before the call started", grpc.StatusCode.DEADLINE_EXCEEDED)
            if isinstance(request, Malformed):
                raise CorpusError(f"{name}: {request.describe()}", grpc.StatusCode.INVALID_ARGUMENT)
            return await method(self, request, context)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status code
            code = status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", name)
            elif isinstance(e, RateLimited):
                context.set_trailing_metadata((("retry-after", f"{e.retry_after_s:.3f}"),))
            await context.abort(code, message_for(e))
        finally:
            self.state.metrics.rpc_total.labels(name, code.name).inc()
            self.state.metrics.rpc_latency.labels(name).observe(time.perf_counter() - t0)

    return wrapper


try:  # what grpc.aio's own write raises when the call is gone; grpc.aio does not re-export it
    from grpc._cython.cygrpc import ExecuteBatchError
except ImportError:  # a grpcio without it: the context's own state is the only sign left
    class ExecuteBatchError(Exception):
        pass


def stream_gone(context: grpc.aio.ServicerContext, error: Exception) -> bool:
    """A write failed because the client cancelled the call or its connection went away: gRPC's
    core refuses the send (ExecuteBatchError) before the context learns of the cancellation."""
    return isinstance(error, ExecuteBatchError) or context.cancelled() or context.done()


def _check_client_id(client_id: str) -> str:
    if len(client_id) > MAX_CLIENT_ID_CHARS or "/" in client_id:
        raise CorpusError(f"client_id: expected at most {MAX_CLIENT_ID_CHARS} characters without '/', got {client_id!r:.80}",
                          grpc.StatusCode.INVALID_ARGUMENT)
    return f"u:{client_id}/"


class CorpusServicer(pb_grpc.CorpusServicer):
    def __init__(self, state: ServiceState, catalog: "Catalog") -> None:
        self.state = state
        self.catalog = catalog  # external corpora go through it: REST lists and persists what gRPC loads
        self._housekeeping = Housekeeping(state)  # idle BatchGet state, memory reclaim

    # ------------------------------------------------------------------ who may call what

    def _allow(self, namespace: str, role: Role) -> Principal | None:
        """The caller may use ``namespace`` as ``role`` (checked before the namespace's existence,
        so a scoped client cannot probe for others). No-op without --client-tokens."""
        principal = current_principal()
        if principal is not None:
            try:
                principal.require(role, namespace)
            except AuthError:
                self.state.metrics.auth_refused.labels("grpc", "PERMISSION_DENIED").inc()
                raise
        return principal

    def _limit(self, limiter: RateLimiter, principal: Principal | None, context) -> None:
        if limiter.enabled:
            try:
                limiter.acquire(principal.name if principal is not None else peer_host(context.peer() or ""))
            except RateLimited:
                self.state.metrics.rate_limited.labels("grpc", limiter.what).inc()
                raise

    # ------------------------------------------------------------------ streaming session

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest], context) -> None:
        state = self.state
        if state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the corpus server is draining (shutting down)")
        principal = current_principal()
        self._housekeeping.ensure_running()
        session = Session(state)
        state.live_sessions += 1
        state.metrics.sessions.inc()
        steps = state.metrics.rpc_total
        steps_ok = steps.labels("Session", grpc.StatusCode.OK.name)
        latency = state.metrics.rpc_latency.labels("Session")
        draft_nodes: dict[str, object] = {}  # namespace -> its histogram child (labels() takes a lock)
        inline_work = state.config.inline_work
        try:
            async for msg in request_iterator:
                if state.draining:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the corpus server is draining (shutting down)")
                if isinstance(msg, Malformed):  # no seq to answer in-band: the sender is broken, end the stream
                    steps.labels("Session", grpc.StatusCode.INVALID_ARGUMENT.name).inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Session: {msg.describe()}")
                t0 = time.perf_counter()
                out = pb.SessionResponse(seq=msg.seq)
                try:
                    if principal is not None:
                        self._allow(msg.namespace, Role.DRAFT)
                    step = session.parse(msg)
                    if step.work() <= inline_work:
                        nodes = session.apply(step, out)
                    else:
                        nodes = await state.run(session.apply, step, out)
                    if step.draft:
                        hist = draft_nodes.get(step.namespace)
                        if hist is None:
                            hist = draft_nodes[step.namespace] = state.metrics.draft_nodes.labels(step.namespace)
                        hist.observe(nodes / len(step.draft))
                    steps_ok.inc()
                except Exception as e:  # noqa: BLE001 - answered in-band, the session lives on
                    code = status_for(e)
                    if code == grpc.StatusCode.INTERNAL:
                        log.exception("session step failed")
                    out = pb.SessionResponse(seq=msg.seq, error=pb.Error(code=code.value[0], message=message_for(e),
                                                                         draft_only=isinstance(e, DraftRefused)))
                    steps.labels("Session", code.name).inc()
                latency.observe(time.perf_counter() - t0)
                # Written here, not yielded: when the client cancels while it is not reading, the
                # write fails in this frame and the stream ends quietly, where a generator's failed
                # write would be logged by gRPC with a traceback.
                try:
                    await context.write(out)
                except Exception as e:  # noqa: BLE001 - only a stream the client gave up on ends here
                    if not stream_gone(context, e):
                        raise
                    log.debug("session %d: cancelled by the client (%s)", session.id, type(e).__name__)
                    state.metrics.sessions_cancelled.inc()
                    return
        except asyncio.CancelledError:  # the client cancelled while the handler awaited (gRPC cancels it)
            if not state.draining:
                log.debug("session %d: cancelled by the client", session.id)
                state.metrics.sessions_cancelled.inc()
            raise
        finally:
            # Synchronous on purpose: a cancelled stream's handler must not await here (a second
            # cancellation would skip the cleanup and leak the session's requests until their TTL).
            state.live_sessions -= 1
            session.close()

    # ------------------------------------------------------------------ SGLang-style unary calls

    @_unary
    async def BatchGet(self, request: pb.BatchGetRequest, context) -> pb.BatchGetResponse:
        cfg = self.state.config
        self._allow(request.namespace, Role.DRAFT)
        corpus = self.state.corpus(request.namespace)
        prefix = _check_client_id(request.client_id)
        ids, lens, flat = arrays.unpack_flat_runs(request.windows, "windows")
        check_req_ids(ids, "windows.req_ids", cfg.max_batch)
        total_lens = arrays.unpack(request.total_lens, arrays.I64, "total_lens", len(ids))
        k = request.draft_token_num
        if not 2 <= k <= cfg.max_budget + 1:
            raise ValueError(f"draft_token_num: expected an int in [2, {cfg.max_budget + 1}], got {k}")
        if flat.size > cfg.max_tokens_per_message:
            raise CorpusError(f"windows carry more than max_tokens_per_message = {cfg.max_tokens_per_message} tokens",
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
        check_flat_tokens(flat, corpus.config.vocab_size, "windows")
        bad = np.flatnonzero((lens == 0) | (total_lens < lens))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"windows: request '{ids[i]}' needs a non-empty window no longer than its "
                             f"total length, got {int(lens[i])} tokens and total_lens {int(total_lens[i])}")
        windows = arrays.split_flat(lens, flat)
        keys, versions = check_history_fields(request.prompt_keys, request.policy_versions, len(ids), "BatchGet")
        # Replicated, a request's rollout goes through the log (EraseMatchState), not into this engine.
        history = {"prompt_keys": keys, "policy_versions": versions, "keep_rollouts": self.state.chunkers is None} \
            if keys is not None or versions is not None else {}

        def run() -> tuple[np.ndarray, np.ndarray]:
            return corpus.batch_get([prefix + r for r in ids], windows, total_lens.tolist(), draft_token_num=k, **history)

        drafts, mask = await self._batch_get_bounded(request.namespace, prefix, corpus, ids, lens, total_lens, run)
        return pb.BatchGetResponse(draft_token_num=k, drafts=arrays.pack(drafts), mask=arrays.pack(mask, arrays.U8))

    async def _batch_get_bounded(self, namespace: str, prefix: str, corpus, ids, lens, total_lens, run):
        """Runs a BatchGet engine call within its client's limits and the live-request budget
        (batch_clients.py). The call's state is settled when the engine is done with it, even if
        the RPC was cancelled meanwhile: the engine call runs to its end either way."""
        state = self.state
        clients = state.batch_clients
        self._housekeeping.ensure_running()
        client = clients.client(namespace, prefix)
        tb, max_tokens = state.token_bytes[namespace], corpus.config.max_request_tokens
        try:
            adm = clients.admit(client, ids, lens, total_lens, tb, max_tokens)
        except BaseException:
            clients.done(client)
            raise

        def settle(fut: asyncio.Future) -> None:
            applied = not fut.cancelled() and fut.exception() is None
            erase = clients.settle(adm, applied, tb, max_tokens)
            if erase:  # a failed call may have created some of its new ids before it failed
                corpus.erase_match_state(erase)

        fut = asyncio.ensure_future(state.run(run))
        fut.add_done_callback(settle)
        return await asyncio.shield(fut)

    @_unary
    async def BatchPut(self, request: pb.BatchPutRequest, context) -> pb.BatchPutResponse:
        cfg = self.state.config
        self._limit(self.state.put_limit, self._allow(request.namespace, Role.DRAFT), context)
        corpus = self.state.corpus(request.namespace)
        n = len(request.lengths) // 4
        if n > cfg.max_batch:
            raise CorpusError(f"BatchPut: {n} sequences exceed max_batch = {cfg.max_batch}", grpc.StatusCode.RESOURCE_EXHAUSTED)
        runs = arrays.split_runs(request.lengths, request.tokens, n, "BatchPut")
        total = sum(r.size for r in runs)
        if total > cfg.max_tokens_per_message:
            raise CorpusError(f"BatchPut: {total} tokens exceed max_tokens_per_message = {cfg.max_tokens_per_message}",
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
        check_tokens(runs, corpus.config.vocab_size, "BatchPut")

        def run() -> None:
            corpus.batch_put(runs)
            if request.synchronize:
                corpus.synchronize()

        if self.state.chunkers is not None:  # replicated: every replica learns them from the log
            replica = self.state.replica
            refused = sum(r.size for r in runs if not replica.publisher.add_chunk(request.namespace, np.array(r, np.int32)))
            if refused:  # counted and logged by the publisher; the caller hears it too
                raise CorpusError(f"BatchPut: {refused} of {total} tokens refused: the commit log buffer is full "
                                  f"(broker down or slower than the commits); retry later",
                                  grpc.StatusCode.RESOURCE_EXHAUSTED)
            if request.synchronize:  # read-your-writes: visible here before the answer
                left = context.time_remaining()
                await replica.wait_visible(min(30.0, left - 0.05) if left is not None else 30.0)
            return pb.BatchPutResponse(tokens=total)
        await self.state.run(run)
        return pb.BatchPutResponse(tokens=total)

    @_unary
    async def EraseMatchState(self, request: pb.EraseMatchStateRequest, context) -> pb.EraseMatchStateResponse:
        self._allow(request.namespace, Role.DRAFT)
        corpus = self.state.corpus(request.namespace)
        prefix = _check_client_id(request.client_id)
        ids = list(request.req_ids)
        check_req_ids(ids, "req_ids", self.state.config.max_batch)

        def erase() -> None:
            if self.state.chunkers is not None:  # replicated: keyed requests' rollouts go to the log
                for rid in ids:
                    if corpus.has_request(prefix + rid):
                        publish_rollout(self.state, request.namespace, corpus, prefix + rid)
            corpus.erase_match_state([prefix + r for r in ids])

        await self.state.run(erase)
        client = self.state.batch_clients.find(request.namespace, prefix)
        if client is not None:  # their budget and the client's room are free again
            self.state.batch_clients.erase(client, ids, self.state.token_bytes[request.namespace])
        return pb.EraseMatchStateResponse()

    # ------------------------------------------------------------------ external corpora

    @_unary
    async def LoadExternalCorpus(self, request_iterator, context) -> pb.LoadExternalCorpusResponse:
        corpus, ns, name, loaded, begun = None, "", "", 0, False
        try:
            async for chunk in request_iterator:
                if isinstance(chunk, Malformed):
                    raise ValueError(f"LoadExternalCorpus: {chunk.describe()}")
                if corpus is None:
                    self._limit(self.state.admin_limit, self._allow(chunk.namespace, Role.ADMIN), context)
                    if self.state.chunkers is not None:
                        raise CorpusError("LoadExternalCorpus: a replicated corpus loads external corpora through "
                                          "the REST upload (PUT /v1/namespaces/NS/corpora/NAME), which every "
                                          "replica builds", grpc.StatusCode.FAILED_PRECONDITION)
                    ns, corpus = chunk.namespace, self.state.corpus(chunk.namespace)
                    name = check_corpus_name(chunk.name)
                    await self.state.run(self.catalog.begin_load, ns, name)  # staged, with its data file
                    begun = True
                elif chunk.namespace not in ("", ns) or chunk.name not in ("", name):
                    raise ValueError("LoadExternalCorpus: every chunk must name the same namespace and corpus")
                tokens = arrays.unpack(chunk.tokens, arrays.I32, "tokens")
                check_tokens([tokens], corpus.config.vocab_size, "tokens")
                await self.state.run(self.catalog.load_chunk, ns, name, tokens)
                loaded += tokens.size
        except BaseException:
            if begun:  # not another call's load of the same name
                self.catalog.abort_load(ns, name)
            raise
        if corpus is None:
            raise ValueError("LoadExternalCorpus: the stream carried no chunk")
        return pb.LoadExternalCorpusResponse(loaded_tokens=loaded)

    @_unary
    async def CommitExternalCorpus(self, request: pb.CommitExternalCorpusRequest, context) -> pb.CommitExternalCorpusResponse:
        self._limit(self.state.admin_limit, self._allow(request.namespace, Role.ADMIN), context)
        self.state.corpus(request.namespace)
        name = check_corpus_name(request.name)
        # Visible and durable (data file + manifest, listed by REST) before it answers.
        count = await self.state.run(self.catalog.commit_load, request.namespace, name, request.expected_tokens)
        return pb.CommitExternalCorpusResponse(tokens=count)

    @_unary
    async def RemoveExternalCorpus(self, request: pb.RemoveExternalCorpusRequest, context) -> pb.RemoveExternalCorpusResponse:
        self._limit(self.state.admin_limit, self._allow(request.namespace, Role.ADMIN), context)
        self.state.corpus(request.namespace)
        # The catalog's delete, as REST's: tombstone, data file, engine, replicas.
        await self.catalog.delete(request.namespace, check_corpus_name(request.name))
        return pb.RemoveExternalCorpusResponse()

    @_unary
    async def ListExternalCorpora(self, request: pb.ListExternalCorporaRequest, context) -> pb.ListExternalCorporaResponse:
        self._allow(request.namespace, Role.READ)
        corpus = self.state.corpus(request.namespace)
        return pb.ListExternalCorporaResponse(corpora=corpus.list_external_corpora())

    # ------------------------------------------------------------------ inspection

    @_unary
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        principal = self._allow(request.namespace, Role.READ) if request.namespace else current_principal()
        names = [request.namespace] if request.namespace else \
            [ns for ns in sorted(self.state.specs) if principal is None or principal.may(Role.READ, ns)]
        out = pb.StatsResponse()
        for ns in names:
            corpus = self.state.corpus(ns)
            s = out.namespaces[ns]
            stats = corpus.stats()
            s.values.update(stats)  # every statistic as a double: what clients older than `counters` read
            s.counters.update({k: v for k, v in stats.items() if isinstance(v, int)})
            s.external_corpora.update(corpus.list_external_corpora())
            s.sessions = self.state.live_sessions
            s.vocab_size = corpus.config.vocab_size
            s.tokenizer = self.state.tokenizers.name(ns)
            probe = self.state.tokenizer_probe(ns)
            if request.describe or probe.done():  # a plain Stats never waits on a tokenizer load
                s.tokenizer_probe.extend(await probe)
            s.tokenizer_error = self.state.tokenizer_errors.get(ns, "")
        return out

    @_unary
    async def Reset(self, request: pb.ResetRequest, context) -> pb.ResetResponse:
        self._limit(self.state.admin_limit, self._allow(request.namespace, Role.ADMIN), context)
        corpus = self.state.corpus(request.namespace)
        if self.state.chunkers is not None:  # replicated: every replica resets at the same log position
            self.state.replica.publisher.add_marker(["z", request.namespace])
            return pb.ResetResponse()
        await self.state.run(corpus.reset)
        self.state.batch_clients.drop_namespace(request.namespace)  # the engine dropped their requests
        return pb.ResetResponse()

    @_unary
    async def AnnouncePolicyVersion(self, request: pb.AnnouncePolicyVersionRequest,
                                    context) -> pb.AnnouncePolicyVersionResponse:
        self._limit(self.state.admin_limit, self._allow(request.namespace, Role.ADMIN), context)
        version = await announce(self.state, request.namespace, request.version)
        return pb.AnnouncePolicyVersionResponse(version=version)


__all__ = ["CorpusServicer"]
