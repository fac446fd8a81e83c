"""Runs an ``Engine`` on its own thread: steps while there is work, sleeps when idle.

The HTTP API (asyncio) submits requests through ``submit``; the engine thread reports progress
through the request's ``on_update`` callback, which takes a snapshot, and hands a step's snapshots
to the event loop together (``Engine.after_updates``): one wake-up of the loop per step (a write to
its self-pipe and a handle to run), not one per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from dataclasses import dataclass

from ..step.sampling import SamplingParams
from .core import Engine
from .request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    output_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str
    request: Request


def _put_all(items: list[tuple[asyncio.Queue, Update]]) -> None:
    for queue, upd in items:
        queue.put_nowait(upd)


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self._idle_calls: deque[tuple[concurrent.futures.Future, object]] = deque()
        # A step's snapshots, by event loop, until Engine.after_updates hands them over (engine thread).
        self._updates: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Update]]] = {}
        engine.after_updates = self._hand_over

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        while self._idle_calls:
            self._idle_calls.popleft()[0].cancel()

    def submit(self, prompt_ids: list[int], params: SamplingParams, group: str | None = None,
               prompt_key: str | None = None, policy_version: int | None = None,
               progress: bool = True) -> tuple[Request, asyncio.Queue]:
        """Queues a request (ValueError for a bad one); updates arrive on the returned queue.
        ``group``: the corpus request group of the samples of one API request; ``prompt_key`` and
        ``policy_version``: its prompt history (``Engine.add_request``). ``progress=False``: only the
        final update (a non-streaming answer), not one per step: each costs the engine thread a copy of
        the output and a wake-up of the event loop (at 134 requests ~2 ms per step on 2 cores)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Update] = asyncio.Queue()

        def on_update(req: Request) -> None:  # engine thread
            if not (progress or req.finished):
                return
            upd = Update(list(req.output_ids), req.finished, req.finish_reason, req.text, req)
            self._updates.setdefault(loop, []).append((queue, upd))

        req = self.engine.add_request(prompt_ids, params, on_update=on_update, group=group, prompt_key=prompt_key,
                                      policy_version=policy_version)
        self._wake.set()
        return req, queue

    def _hand_over(self) -> None:
        """A step's snapshots to their event loops, one call each (engine thread)."""
        updates, self._updates = self._updates, {}
        for loop, items in updates.items():
            loop.call_soon_threadsafe(_put_all, items)

    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)
        self._wake.set()

    def abort_all(self) -> int:
        """Aborts every live request (Engine.abort_all); returns how many."""
        n = self.engine.abort_all()
        self._wake.set()
        return n

    def call_when_idle(self, fn) -> concurrent.futures.Future:
        """Runs ``fn()`` on the engine thread once no request is queued or running (between steps,
        so nothing reads the model meanwhile: a weight update) and returns its future. The caller
        stops new requests from coming in while it waits; a call cancelled before it ran is skipped."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        self._idle_calls.append((fut, fn))
        self._wake.set()
        return fut

    def _run_idle_calls(self) -> None:
        while self._idle_calls and not self.engine.has_work():
            fut, fn = self._idle_calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller reports it; the loop keeps serving
                fut.set_exception(e)

    def _run(self) -> None:
        while not self._stop:
            if self._idle_calls:
                self._run_idle_calls()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # a bug: fail the running requests, keep serving new ones
                log.exception("engine step failed")
                self.error = e
                self.engine.fail_all(f"internal error: {type(e).__name__}: {e}")
