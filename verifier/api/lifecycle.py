"""A request's life around the engine: admission bounded by the engine's waiting queue, a client
that leaves noticed at once (its samples aborted, their slots and queue entries freed), and the
drain of a shutdown (SIGTERM: new requests refused, running ones given a deadline, then aborted).

Without these, a flood of requests that were sent and dropped kept the engine decoding for nobody:
uvicorn never cancels a handler whose client disconnected, so a non-streaming request ran to its
end, and the queue had no bound (issue 44: 1,500 requests of 16 samples left 23,558 samples waiting,
and SIGTERM did not stop the process).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from ..engine.core import Engine
from ..engine.runner import EngineLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    # Samples queued and not running yet (an API request of n samples counts n). Beyond it new
    # requests get 429; a request always gets in while nothing waits, whatever its size.
    max_waiting: int = 1024
    # Their tokens, prompt + max_tokens each (the prefill to run and the output to decode): a bound on
    # the queue's memory and on how long a newcomer waits behind it.
    max_waiting_tokens: int = 1 << 20
    # SIGTERM: how long running requests may take to finish before they are aborted (seconds).
    shutdown_timeout: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or not 1 <= self.max_waiting <= 1 << 24:
            raise ValueError(f"max_waiting: expected an int 1..2^24, got {self.max_waiting!r}")
        if (isinstance(self.max_waiting_tokens, bool) or not isinstance(self.max_waiting_tokens, int)
                or not 1 <= self.max_waiting_tokens <= 1 << 40):
            raise ValueError(f"max_waiting_tokens: expected an int 1..2^40, got {self.max_waiting_tokens!r}")
        if not (isinstance(self.shutdown_timeout, (int, float)) and 0 <= self.shutdown_timeout <= 3600):
            raise ValueError(f"shutdown_timeout: expected seconds 0..3600, got {self.shutdown_timeout!r}")


class Lifecycle:
    """The API's admission gate and its counters (registered in the API's /metrics registry)."""

    def __init__(self, loop: EngineLoop, config: LifecycleConfig, registry: CollectorRegistry) -> None:
        self.loop, self.engine, self.config = loop, loop.engine, config
        self.draining = False
        self.refused = Counter("ngram_verifier_http_refused", "requests refused before they reached the engine, by why "
                               "(queue_requests, queue_tokens: 429; draining: 503 during shutdown)", ["route", "reason"],
                               registry=registry)
        self.abandoned = Counter("ngram_verifier_http_abandoned", "requests whose client left before the answer "
                                 "(their samples aborted)", ["route"], registry=registry)
        registry.register(_QueueCollector(self.engine, config))

    def refusal(self, route: str, samples: int, tokens_each: int) -> JSONResponse | None:
        """None if a request of ``samples`` samples of ``tokens_each`` tokens may be queued now, else
        the answer that refuses it (429 or 503, with Retry-After and an OpenAI-shaped error body)."""
        if self.draining:
            return self._refuse(route, 503, "draining", "the server is shutting down: send the request to another "
                                "replica or retry later", max(1, math.ceil(self.config.shutdown_timeout)))
        waiting, tokens = self.engine.waiting_load()
        if not waiting:  # an empty queue takes any request: a large one is never refused for good
            return None
        c = self.config
        if waiting + samples > c.max_waiting:
            return self._refuse(route, 429, "queue_requests", f"the server is busy: {waiting} samples wait (at most "
                                f"{c.max_waiting}, --max-waiting); retry later", 1)
        if tokens + samples * tokens_each > c.max_waiting_tokens:
            return self._refuse(route, 429, "queue_tokens", f"the server is busy: {tokens} tokens wait (at most "
                                f"{c.max_waiting_tokens}, --max-waiting-tokens; this request adds {samples} x "
                                f"{tokens_each}); retry later", 1)
        return None

    def _refuse(self, route: str, status: int, reason: str, message: str, retry_after: int) -> JSONResponse:
        self.refused.labels(route, reason).inc()
        kind = "rate_limit_exceeded" if status == 429 else "server_shutting_down"
        body = {"error": {"message": message, "type": "server_error" if status >= 500 else "rate_limit_error",
                          "param": None, "code": kind}}
        return JSONResponse(body, status_code=status, headers={"Retry-After": str(retry_after)})

    async def left(self, request: Request) -> bool:
        """Whether the client has left already (it sent the request and closed the connection): checked
        before its samples are queued, so that none is prefilled for nobody (on a CPU one prefill of
        8 x 500 tokens of SmolLM2 took tens of seconds, which every newcomer then waited for). uvicorn
        reads nothing after a request until the handler reads its body, so a close sent right behind
        the request reaches it a few turns of the event loop later: the end of stream read (after this
        handler's next turn), then the connection's close (the turn after). Four turns cover it."""
        for _ in range(4):
            await asyncio.sleep(0)
        return await request.is_disconnected()

    async def answered(self, request: Request, queues: list[asyncio.Queue]) -> bool:
        """Waits for every queue's final update: True; False as soon as the client disconnects
        (the caller aborts the samples). uvicorn reports a disconnect only to a handler that reads
        its receive channel, which a non-streaming handler otherwise never does after the body."""

        async def finished() -> None:
            for q in queues:
                while not (await q.get()).finished:
                    pass

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass  # (the body was read already: nothing else arrives)

        done, left = asyncio.ensure_future(finished()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait((done, left), return_when=asyncio.FIRST_COMPLETED)
            return done.done()
        finally:
            done.cancel()
            left.cancel()

    def abandon(self, route: str, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.loop.abort(rid)
        self.abandoned.labels(route).inc()


class _QueueCollector:
    """The engine's queue as the admission bound sees it."""

    def __init__(self, engine: Engine, config: LifecycleConfig) -> None:
        self.engine, self.config = engine, config

    def collect(self):
        waiting, tokens = self.engine.waiting_load()
        yield GaugeMetricFamily("ngram_verifier_waiting_tokens", "tokens of the queued requests (prompt + max_tokens "
                                "each), bounded by --max-waiting-tokens", value=tokens)
        yield GaugeMetricFamily("ngram_verifier_waiting_samples", "samples queued and not running, bounded by "
                                "--max-waiting", value=waiting)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGTERM, SIGINT) drains the engine: new requests get 503,
    the listening socket closes, running requests have ``shutdown_timeout`` seconds to finish, then
    every live request is aborted so that its handler answers and the process can exit."""

    def __init__(self, config: uvicorn.Config, life: Lifecycle) -> None:
        super().__init__(config)
        self.life = life

    async def shutdown(self, sockets=None) -> None:
        self.life.draining = True
        deadline = asyncio.ensure_future(self._abort_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_at_deadline(self) -> None:
        engine, timeout = self.life.engine, self.life.config.shutdown_timeout
        end = time.monotonic() + timeout
        live = engine.num_live()
        log.info("shutting down: %d requests live, %.1f s to finish", live, timeout)
        while engine.num_live() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if n := self.life.loop.abort_all():
            log.warning("shutdown deadline (%.1f s) passed: aborted %d live requests", timeout, n)
