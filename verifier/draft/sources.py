"""Where draft trees come from, behind one small interface (``DraftSource``): the request operations
(start, extend, finish), a draft of a batch's trees (``draft`` returns a ``Pending``: an in-process
answer is done at once, a remote one arrives later), ``close`` and ``stats``.

- ``InProcessSource``: an ``NgramCorpus`` in this process (``--corpus local``, and the mirror of a
  remote verifier's requests that drafts when the remote answer is not there).
- ``ChildProcessSource``: a ``CorpusClient`` in a child process (``verifier.draft.corpus_process``):
  the engine's side of a step is at most one pipe write and one non-blocking read, and the client's
  Python work (protobuf, gRPC's threads) never holds the engine's GIL. A child that dies is replaced
  in the background (``revive``); the drafter then replays its live requests into the new one.
- ``ThreadSource``: a ``CorpusClient`` driven by one worker thread of this process (every call, in
  order, so buffered start/extend/finish stay consistent). That thread shares the GIL with the
  engine's step loop, so it lowers the interpreter's switch interval (``GIL_SWITCH_INTERVAL_S``,
  never raising it): with Python's 5 ms default, an engine thread whose GPU step had finished waited
  up to 5 ms for the client thread's Python work to yield, against ~1 ms steps (H200, SmolLM2,
  batch 1: remote drafting went from 1,280 to 1,424 tok/s with it).

Remote sources hold the request operations (``held``) until ``send`` hands them to the client in
one piece: the drafter decides when (``Drafter.dispatch``), and ``draft`` sends them first, so a
draft request always follows every operation before it. Their failures come back as ``Note``s (``take_notes``): the drafter counts them
and its ``CorpusHealth`` says an outage once.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Protocol

from corpus_service import DraftBatch, NgramCorpus

from .calls import Call, Extend, Finish, StartRequest, apply
from .config import CorpusEndpoint, DraftConfig
from .corpus_process import FLUSH_AFTER_S, ClientProcess, ClientSettings, Note, Ticket, draft_capped, note_of

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 2e-4  # see the module docstring
# ThreadSource's wait per Drafter.await_ahead call (its wait lets the client thread take the GIL): the
# engine notices a finished GPU step up to this late when the remote answer is not back yet. The
# child process' answer is a non-blocking read instead, so the engine polls the GPU between reads as
# tightly as a local step's event wait spins: a 10 us select() slept ~60 us (the kernel's default
# 50 us timer slack), and the H200's batch-1 remote drafting step spent 23 us more in its forward
# phase than a local one (0.995 vs 0.972 ms; commit f19f6fc).
AWAIT_AHEAD_S = 1e-5
# A dead client process is replaced at once if it had run for STABLE_CHILD_S; otherwise (a crash
# loop, or a replacement that does not start) after a delay that doubles each time, up to the maximum.
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
STABLE_CHILD_S = 60.0
# A short circuit-breaker cool-down: a trial against a dead corpus fails fast (the channel is in
# backoff), while a long one would delay resuming speculation after a restart (docs/reliability.md
# promises 2 s; the channel's reconnect backoff is at most 1 s).
BREAKER_COOLDOWN_S = 0.5


class Pending(Protocol):
    """A draft asked of a source: ``done()`` once its answer (``batch``) or its failure (``error``)
    is in. ``capped``: a deep tree the corpus refused, asked again at a step's budget."""

    batch: DraftBatch | None
    error: Note | None
    capped: bool
    asked_at: float

    def done(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...

    def result(self, timeout: float) -> DraftBatch | None: ...


class DraftSource(Protocol):
    target: str

    def start(self, req_id: str, prompt: list[int], group: str | None = None, *, prompt_key: str | None = None,
              policy_version: int | None = None) -> None:
        """``prompt_key``/``policy_version``: the prompt history's key and the sampling policy's
        version (``NgramCorpus.start_request``)."""

    def extend(self, items: list[tuple[str, list[int]]]) -> None: ...

    def finish(self, req_id: str, rollout: bool = True) -> None:
        """``rollout=False``: an aborted or failed request, kept out of its prompt key's history."""

    def draft(self, req_ids: list[str], nodes: int, budget: int) -> Pending: ...

    def close(self, flush: bool = True) -> None: ...

    def stats(self) -> dict[str, int | float]: ...


class Answered:
    """A ``Pending`` that is done when made (an in-process draft)."""

    __slots__ = ("batch", "error", "capped", "asked_at")

    def __init__(self, batch: DraftBatch | None, error: Note | None = None) -> None:
        self.batch, self.error, self.capped, self.asked_at = batch, error, False, time.monotonic()

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True

    def result(self, timeout: float) -> DraftBatch | None:
        return self.batch


class InProcessSource:
    """An ``NgramCorpus`` in this process: every operation runs now, natively; a bad call (an
    unknown request) raises at once, as the corpus does: it is the caller's mistake, not an outage."""

    target = "local"

    def __init__(self, corpus: NgramCorpus) -> None:
        self.corpus = corpus

    def start(self, req_id: str, prompt: list[int], group: str | None = None, *, prompt_key: str | None = None,
              policy_version: int | None = None) -> None:
        self.corpus.start_request(req_id, prompt, group=group, prompt_key=prompt_key, policy_version=policy_version)

    def extend(self, items: list[tuple[str, list[int]]]) -> None:
        ids, runs = zip(*items)
        self.corpus.extend_runs(ids, runs)  # the lists read natively (no per-token Python loop)

    def finish(self, req_id: str, rollout: bool = True) -> None:
        if self.corpus.has_request(req_id):
            self.corpus.finish(req_id, rollout=rollout)

    def draft(self, req_ids: list[str], nodes: int, budget: int) -> Answered:
        return Answered(self.corpus.draft(req_ids, budget))

    def close(self, flush: bool = True) -> None:
        pass  # the corpus is the caller's (an external corpus loaded into it may outlive the drafter)

    def stats(self) -> dict[str, int | float]:
        return self.corpus.stats()


class _RemoteSource:
    """What both remote sources share: the held operations and the notes of failed calls."""

    target: str
    await_s = 0.0  # Drafter.await_ahead's default wait for an answer still out
    dead = ""  # why no client is running now ("" while one is)

    def __init__(self, endpoint: CorpusEndpoint, config: DraftConfig) -> None:
        self.target = endpoint.target
        self.settings = ClientSettings(endpoint.target, namespace=endpoint.namespace, timeout_s=config.corpus_timeout_s,
                                       breaker_cooldown_s=BREAKER_COOLDOWN_S, token=endpoint.token, tls=endpoint.tls)
        self.held: list[Call] = []

    def start(self, req_id: str, prompt: list[int], group: str | None = None, *, prompt_key: str | None = None,
              policy_version: int | None = None) -> None:
        self.held.append(StartRequest(req_id, list(prompt), group, prompt_key, policy_version))

    def extend(self, items: list[tuple[str, list[int]]]) -> None:
        self.held.append(Extend(items))

    def finish(self, req_id: str, rollout: bool = True) -> None:
        self.held.append(Finish(req_id, rollout))

    def send(self) -> None:
        """Hands the held operations to the client, in order."""
        if self.held:
            calls, self.held = self.held, []
            self._send(calls)

    def _send(self, calls: list[Call]) -> None:
        raise NotImplementedError

    def revive(self) -> bool:
        """Whether a replacement client took over just now (its live requests must be replayed)."""
        return False

    def tick(self) -> None:
        """Called once per dispatch: a client that paces itself does nothing."""


class ChildProcessSource(_RemoteSource):
    """A ``CorpusClient`` in a child process (``ClientProcess``), replaced if it dies."""

    def __init__(self, endpoint: CorpusEndpoint, config: DraftConfig) -> None:
        super().__init__(endpoint, config)
        self.proc = ClientProcess(self.settings)
        self.restarts = 0
        self._restart: _Restart | None = None
        self._restart_delay = RESTART_DELAY_S
        self._restart_at: float | None = None  # when to start a replacement (None: no death handled)
        self._child_since = time.monotonic()

    @property
    def dead(self) -> str:
        return self.proc.dead

    def _send(self, calls: list[Call]) -> None:
        self.proc.calls(calls)  # the child sends them on at least every FLUSH_AFTER_S

    def draft(self, req_ids: list[str], nodes: int, budget: int) -> Ticket:
        self.send()  # a draft follows every operation before it
        return self.proc.draft(req_ids, nodes, budget)

    def take_notes(self) -> list[Note]:
        notes, self.proc.errors = self.proc.errors, []
        return notes

    def revive(self) -> bool:
        """The client process died: a replacement is started in the background (after a delay that
        doubles while replacements fail to start) and takes over once ready. Returns whether it
        took over now."""
        now = time.monotonic()
        r = self._restart
        if r is None:
            if self._restart_at is None:  # this death is new
                if now - self._child_since >= STABLE_CHILD_S:
                    self._restart_delay, self._restart_at = RESTART_DELAY_S, now
                else:  # it died young
                    self._back_off(now)
            if now >= self._restart_at:
                self._restart = _Restart(self.settings)
            return False
        if not r.done.is_set():
            return False
        self._restart = None
        if r.proc is None:
            self._back_off(now)
            log.warning("corpus %s: a new client process did not start (%s); next try in %.1f s",
                        self.target, r.error, self._restart_at - now)
            return False
        self.proc.close(timeout=0.1)
        self.proc, self._restart_at, self._child_since = r.proc, None, now
        self.held = []  # the dead child's calls: the drafter replays every live request instead
        self.restarts += 1
        return True

    def _back_off(self, now: float) -> None:
        """The next replacement waits the current delay, and the one after twice as long."""
        self._restart_at = now + self._restart_delay
        self._restart_delay = min(2 * self._restart_delay, MAX_RESTART_DELAY_S)

    def close(self, flush: bool = True) -> None:
        """``flush``: held and buffered calls go out first; else the child is stopped at once, so
        nothing more reaches the corpus."""
        if self._restart is not None:
            self._restart.abandon()
            self._restart = None
        if flush:
            if self.held and not self.dead:
                self.send()
            self.proc.close()
        else:
            self.held = []
            self.proc.kill()

    def stats(self) -> dict[str, int | float]:
        return {"client_pid": self.proc.pid, "client_restarts": self.restarts}


class FutureTicket:
    """A ``Pending`` draft run on ThreadSource's worker thread."""

    __slots__ = ("future", "asked_at")

    def __init__(self, future: Future, asked_at: float) -> None:
        self.future, self.asked_at = future, asked_at

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float) -> bool:
        wait_futures([self.future], timeout=timeout)
        return self.future.done()

    def result(self, timeout: float) -> DraftBatch | None:
        """Waits for the answer (TimeoutError after ``timeout`` seconds); None after an error."""
        try:
            return self.future.result(timeout=timeout)[0]
        except FutureTimeout:
            raise TimeoutError(f"no answer from the corpus client thread within {timeout} s") from None

    @property
    def batch(self) -> DraftBatch | None:
        return self.future.result()[0]

    @property
    def capped(self) -> bool:
        return self.future.result()[1]

    @property
    def error(self) -> Note | None:
        return self.future.result()[2]


class ThreadSource(_RemoteSource):
    """A ``CorpusClient`` on one worker thread of this process."""

    await_s = AWAIT_AHEAD_S

    def __init__(self, endpoint: CorpusEndpoint, config: DraftConfig) -> None:
        super().__init__(endpoint, config)
        from corpus_service.client import CircuitBreaker, CorpusClient

        s = self.settings
        self.client = CorpusClient(s.target, namespace=s.namespace, timeout=s.timeout_s, token=s.token, tls=s.tls,
                                   breaker=CircuitBreaker(failure_threshold=2, cooldown_s=s.breaker_cooldown_s))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="corpus-client")
        self._notes: list[Note] = []  # appended on the worker thread, taken on the engine's
        self._sent_at = time.monotonic()  # the last draft or flush that carried buffered calls
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:  # process-wide; never raised
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    def _send(self, calls: list[Call]) -> None:
        self._pool.submit(self._run_calls, calls)

    def _run_calls(self, calls: list[Call]) -> None:
        from corpus_service.client import CorpusError

        for call in calls:
            try:
                apply(self.client, call)
            except (CorpusError, ValueError) as e:  # never let the corpus fail a request
                self._notes.append(note_of(e))

    def draft(self, req_ids: list[str], nodes: int, budget: int) -> FutureTicket:
        self.send()  # a draft follows every operation before it
        self._sent_at = asked_at = time.monotonic()
        return FutureTicket(self._pool.submit(self._draft, list(req_ids), nodes, budget), asked_at)

    def _draft(self, req_ids: list[str], nodes: int, budget: int) -> tuple[DraftBatch | None, bool, Note | None]:
        from corpus_service.client import CorpusError

        try:
            batch, capped = draft_capped(self.client, req_ids, nodes, budget)
            return batch, capped, None
        except (CorpusError, ValueError) as e:
            return None, False, note_of(e)

    def take_notes(self) -> list[Note]:
        n = len(self._notes)
        notes = self._notes[:n]
        del self._notes[:n]  # (list slicing is atomic under the GIL: a note appended meanwhile stays)
        return notes

    def tick(self) -> None:
        """The client buffers calls until a draft request carries them; where none has for a while
        (the engine is not drafting), they go out anyway (the child process paces itself the same
        way: FLUSH_AFTER_S)."""
        if time.monotonic() - self._sent_at >= FLUSH_AFTER_S:
            self._sent_at = time.monotonic()
            self._pool.submit(self._flush)

    def _flush(self) -> None:
        from corpus_service.client import CorpusError

        try:
            self.client.flush()
        except (CorpusError, ValueError) as e:
            self._notes.append(note_of(e))

    def close(self, flush: bool = True) -> None:
        """``flush``: the calls queued on the client thread, then what the client buffers, go out
        first (for at most the client's timeout: a corpus that is down cannot hold the close up)."""
        if flush:
            self.send()
            last = self._pool.submit(self._flush)
            try:
                last.result(timeout=self.client.timeout)
            except FutureTimeout:
                log.warning("corpus %s: the last calls were not sent within %.1f s", self.target, self.client.timeout)
        else:
            self.held = []
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def stats(self) -> dict[str, int | float]:
        return {}


class _Restart:
    """A replacement ``ClientProcess`` started on a thread (its start waits for the child's imports
    and client: too long for an engine step)."""

    def __init__(self, settings: ClientSettings) -> None:
        self.proc: ClientProcess | None = None
        self.error = ""
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        threading.Thread(target=self._run, args=(settings,), name="corpus-client-restart", daemon=True).start()

    def _run(self, settings: ClientSettings) -> None:
        try:
            proc = ClientProcess(settings)
        except Exception as e:  # reported by the source, which tries again later
            self.error = f"{type(e).__name__}: {e}"
            proc = None
        with self._lock:
            if self._abandoned and proc is not None:
                proc.close(timeout=0.5)
                proc = None
            self.proc = proc
        self.done.set()

    def abandon(self) -> None:
        """The source closes: a process started after this is closed by the thread."""
        with self._lock:
            self._abandoned = True
            if self.proc is not None:
                self.proc.close(timeout=0.5)
                self.proc = None


def remote_source(endpoint: CorpusEndpoint, config: DraftConfig) -> ChildProcessSource | ThreadSource:
    """The remote source ``config.remote_client`` names."""
    if config.remote_client == "process":
        return ChildProcessSource(endpoint, config)
    return ThreadSource(endpoint, config)
