"""The remote corpus' client in a child process, so that its Python work never takes the engine's GIL.

A ``CorpusClient`` in the verifier's process runs three Python threads per step (the caller's,
gRPC's request consumer and the session reader: protobuf, futures, numpy), and every one of them
competes with the engine thread for the interpreter lock. Measured on this project's 2-core CPU,
those threads spend 0.3 ms of CPU per batch-1 step; on the H200 host a remote-drafting step took
~70 us more wall time than an in-process one (1.42 vs 1.35 ms), most of it waiting for the lock.

``ClientProcess`` starts ``python -m verifier.draft.corpus_process`` and talks to it over its stdin and
stdout: length-prefixed, versioned frames of typed messages (``verifier.draft.messages``), written
and read without blocking. The engine's side of
a step is at most one ``os.write`` of its queued calls and draft request (calls no draft request
needs are held for a few steps: ``verifier.draft.drafter.HOLD_CALLS_S``), and one non-blocking ``os.read``
when it wants the answer; the child owns an ``AsyncCorpusClient`` on one event loop (its session,
retries, circuit breaker and the replay of live requests after a server restart), runs every call
in order, and sends buffered calls on its own when no draft request has for ``FLUSH_AFTER_S``.

The messages are typed and versioned (``verifier.draft.messages``): each frame is checked on
receipt, and one that is not what this side expects stops the exchange with a clear error.

An outage is reported once: the first call that finds the corpus unreachable sends its error, later
failed flushes send nothing (a draft's error is its answer, always sent), and once the corpus
answers again (a draft, or a Stats probe every ``PROBE_S`` while it is down) the child sends
``REACHABLE_NOTE``; the parent's ``corpus_service.client.health.CorpusHealth`` logs the two.

If the child dies, every pending and later draft reports an error; requests are never failed by
it. The drafter drafts in process meanwhile, says so once, and starts a replacement in the
background, replaying its live requests into it (``verifier.draft.drafter``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field

from corpus_service import DraftBatch

from .calls import Call, apply
from .messages import (REACHABLE_NOTE, TO_CHILD, TO_PARENT, Calls, ClientSettings, Close, Configure, DraftAsk, Failure,
                       Frames, Note, Reachable, Ready, Trees, encode, note_of)

__all__ = ["ClientProcess", "ClientSettings", "Note", "REACHABLE_NOTE", "Ticket", "draft_capped", "note_of",
           "FLUSH_AFTER_S", "child_command"]

log = logging.getLogger(__name__)

# The client buffers starts, commits and finishes until a draft request carries them. An engine that
# does not draft (a large batch where drafting does not pay, a corpus asked for nothing) still hands
# its commits over (at least every verifier.draft.drafter.HOLD_CALLS_S while it steps): the child sends
# what it holds at least this often, so the shared corpus (and every other replica drafting from
# it) learns this verifier's outputs anyway.
FLUSH_AFTER_S = 0.1
_READ_BYTES = 1 << 16
# While the corpus is down the child asks it for its Stats this often (a flush with nothing pending
# sends nothing, so it cannot tell that the corpus is back).
PROBE_S = 0.5


@dataclass
class Ticket:
    """A draft asked of the child: ``done`` once its answer (or an error) arrived."""

    owner: ClientProcess
    id: int
    done_: bool = False
    batch: DraftBatch | None = None
    error: Note | None = None
    capped: bool = False  # the corpus refused the deep tree; this one has ``budget`` nodes
    asked_at: float = 0.0  # time.monotonic() when it was asked

    def done(self) -> bool:
        if not self.done_:
            self.owner.poll()
        return self.done_

    def wait(self, timeout: float) -> bool:
        return self.owner.wait(self, timeout)

    def result(self, timeout: float) -> DraftBatch | None:
        """Waits for the answer (TimeoutError after ``timeout`` seconds); None after an error."""
        if not self.wait(timeout):
            raise TimeoutError(f"no answer from the corpus client process within {timeout} s")
        return self.batch


@dataclass
class ClientProcess:
    """``start_timeout_s``: how long the constructor waits for the child's client to exist (imports
    and the client's own checks: a bad target or TLS setting raises ValueError here, as an
    in-process client's constructor would)."""

    settings: ClientSettings
    start_timeout_s: float = 60.0
    errors: list[Note] = field(default_factory=list)  # notes from the child, taken by the drafter
    dead: str = ""

    def __post_init__(self) -> None:
        self._tickets: dict[int, Ticket] = {}
        self._next = 0
        self._out = bytearray()
        self._frames = Frames(TO_PARENT)
        self._proc = subprocess.Popen(child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._wfd, self._rfd = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        os.set_blocking(self._wfd, False)
        os.set_blocking(self._rfd, False)
        self._ready = False
        self._send(Configure(self.settings))
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready and not self.dead and time.monotonic() < deadline:
            select.select([self._rfd], [], [], max(0.0, deadline - time.monotonic()))
            self.poll()
        if not self._ready:
            why = self.errors[0].text if self.errors else f"no answer within {self.start_timeout_s} s"
            self.close()
            raise ValueError(f"corpus client for {self.settings.target}: {why}")

    # ------------------------------------------------------------------ parent side

    @property
    def pid(self) -> int:
        """The child's process id (benchmarks read its CPU time)."""
        return self._proc.pid

    def calls(self, calls: list[Call]) -> None:
        """Runs the client's methods in the child, in order, without waiting."""
        if calls:
            self._send(Calls(calls))

    def draft(self, req_ids: list[str], nodes: int, budget: int) -> Ticket:
        self._next += 1
        t = self._tickets[self._next] = Ticket(self, self._next, asked_at=time.monotonic())
        if self.dead:
            self._finish(t, None, Note("UNAVAILABLE", self.dead))
        else:
            self._send(DraftAsk(t.id, req_ids, nodes, budget))
        return t

    def poll(self) -> None:
        """Takes whatever the child has answered, without blocking; sends what was held back."""
        if self._out:
            self._flush()
        while not self.dead:
            try:
                data = os.read(self._rfd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                self._died(f"reading from it failed: {e}")
                return
            if not data:
                self._died("it exited")
                return
            try:
                msgs = self._frames.feed(data)
            except Exception as e:  # not our frames: nothing more from this child can be trusted
                self._proc.kill()
                self._died(f"it wrote a bad frame: {type(e).__name__}: {e}")
                return
            for msg in msgs:
                self._receive(msg)
            if len(data) < _READ_BYTES:  # the pipe is drained (a read that would fail costs an exception)
                return

    def wait(self, ticket: Ticket, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for a draft's answer."""
        deadline = time.monotonic() + timeout
        while not ticket.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([self._rfd], [self._wfd] if self._out else [], [], left)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is held back and a close (for up to ``timeout`` seconds: a stuck child is
        killed, never waited on forever), then waits for the child to exit."""
        deadline = time.monotonic() + timeout
        if self._proc.poll() is None and not self.dead:
            self._send(Close())
            while self._out and not self.dead and time.monotonic() < deadline:
                select.select([], [self._wfd], [], max(0.0, deadline - time.monotonic()))
                self._flush()
        for f in (self._proc.stdin, self._proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self._proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self.dead = self.dead or "closed"

    def kill(self) -> None:
        """Stops the child at once: nothing it still holds reaches the corpus."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self.close(timeout=0.1)

    def _send(self, msg) -> None:
        if self.dead:
            return
        self._out += encode(msg)
        self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                n = os.write(self._wfd, self._out)
                del self._out[:n]
        except BlockingIOError:
            pass  # the pipe is full: the rest goes with the next send or poll
        except OSError as e:
            self._died(f"writing to it failed: {e}")

    def _receive(self, msg) -> None:
        kind = type(msg)  # one of TO_PARENT: Frames checked it
        if kind is Trees:
            t = self._tickets.get(msg.ticket)
            if t is not None:
                t.capped = msg.capped
                self._finish(t, msg.batch, None)
        elif kind is Failure:
            t = self._tickets.get(msg.ticket) if msg.ticket is not None else None
            if t is not None:
                self._finish(t, None, msg.note)
            else:
                self.errors.append(msg.note)
        elif kind is Reachable:
            self.errors.append(REACHABLE_NOTE)
        elif kind is Ready:
            self._ready = True

    def _finish(self, t: Ticket, batch: DraftBatch | None, error: Note | None) -> None:
        t.batch, t.error, t.done_ = batch, error, True
        self._tickets.pop(t.id, None)

    def _died(self, why: str) -> None:
        code = self._proc.poll()
        self.dead = f"CorpusUnavailable: the corpus client process stopped ({why}; exit code {code})"
        note = Note("UNAVAILABLE", self.dead)
        for t in list(self._tickets.values()):
            self._finish(t, None, note)
        self.errors.append(note)


# The child's first statement: the parent's module search path in place of its own. ``python -m``
# (and ``-c``) put the current directory first, so a verifier installed with a plain ``pip install .``
# and started from the checkout's root had its child import the checkout's ``corpus_service``, which
# has no compiled ``_native``, and exit (the verifier with it, code 2). ``-P`` (3.11+) drops only that
# entry; a benchmark may also have put the package on the parent's sys.path.
_CHILD_BOOT = ("import sys; sys.path[:] = sys.argv[1:]; del sys.argv[1:]; "
               "from verifier.draft.corpus_process import main; sys.exit(main())")


def child_command() -> list[str]:
    """The client process' command line: it imports what this process imported, from wherever it
    runs (a relative or empty entry of this process' path is resolved against its directory now)."""
    return [sys.executable, "-c", _CHILD_BOOT, *(os.path.abspath(p) for p in sys.path)]


def draft_capped(client, req_ids: list[str], nodes: int, budget: int) -> tuple[DraftBatch, bool]:
    """``client.draft`` of ``nodes``-node trees (a pipelined deep tree), retried at ``budget`` if
    the corpus refuses trees that large (its --max-budget); returns the trees and whether they were
    cut to ``budget``. Both clients use it: the child here, the thread client in verifier.draft.drafter."""
    from corpus_service.client import CorpusError

    try:
        return client.draft(req_ids, nodes), False
    except (CorpusError, ValueError) as e:
        if not _refused_depth(e, nodes, budget):
            raise
        return client.draft(req_ids, budget), True


def _refused_depth(e: Exception, nodes: int, budget: int) -> bool:
    """Whether a draft of ``nodes`` > ``budget`` nodes failed because the corpus refuses trees that
    large (then a step's ``budget`` is asked instead): by the error's class, which a remote corpus'
    OUT_OF_RANGE status code maps to, never by its text."""
    from corpus_service import BudgetTooLargeError
    from corpus_service.client import CorpusOutOfRange

    return nodes > budget and isinstance(e, (CorpusOutOfRange, BudgetTooLargeError))


# ---------------------------------------------------------------------- child side

def _child() -> int:
    try:
        return _serve()
    except BrokenPipeError:  # the parent went away
        return 0


def _serve() -> int:
    # Frames go to a private copy of the stdout pipe; file descriptor 1 itself now points at stderr,
    # so nothing else (a print, a native library's logging) can write into the frame stream.
    rfd, wfd = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    return asyncio.run(_relay(rfd, wfd))


async def draft_capped_async(client, req_ids: list[str], nodes: int, budget: int) -> tuple[DraftBatch, bool]:
    """``draft_capped`` for an ``AsyncCorpusClient``."""
    from corpus_service.client import CorpusError

    try:
        return await client.draft(req_ids, nodes), False
    except (CorpusError, ValueError) as e:
        if not _refused_depth(e, nodes, budget):
            raise
        return await client.draft(req_ids, budget), True


async def _relay(rfd: int, wfd: int) -> int:
    """The child's loop: frames from the parent, in order, through an ``AsyncCorpusClient``. One
    thread and an event loop: a draft's exchange with the server wakes this loop directly, where
    the thread-based client handed each step between three Python threads (B=1 drafts on the
    2-core machine: 512-572 us per round trip against 578-715 us)."""
    from corpus_service.client import AsyncCorpusClient, CircuitBreaker, CorpusError

    from corpus_service.client import unreachable

    loop = asyncio.get_running_loop()
    frames = Frames(TO_CHILD)
    inbox: list[bytes] = []  # what the pipe gave since the last turn (b"": the parent closed it)
    arrived = asyncio.Event()

    def readable() -> None:
        try:
            data = os.read(rfd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        inbox.append(data)
        if not data:
            loop.remove_reader(rfd)
        arrived.set()

    os.set_blocking(rfd, False)
    loop.add_reader(rfd, readable)

    def send(msg) -> None:
        write(encode(msg))

    down = False  # the parent was told the corpus is unreachable, and not yet that it is back
    probed = 0.0

    def report(ticket: int | None, e: Exception, what: str) -> None:
        nonlocal down
        if not isinstance(e, (CorpusError, ValueError)):  # a bug here must not stop the child
            log.exception("corpus client process: %s", what)
        note = note_of(e)
        if unreachable(note):
            if down and ticket is None:
                return  # said once per outage
            down = True
        send(Failure(ticket, note))

    def answered() -> None:
        nonlocal down
        if down:
            down = False
            send(Reachable())

    def write(frame: bytes) -> None:
        # Blocking writes: the parent never blocks on a full pipe (it reads without blocking), so
        # a write waits only while the parent is between polls.
        data = memoryview(frame)
        while data:
            n = os.write(wfd, data)
            data = data[n:]

    client = None
    sent = time.monotonic()  # when buffered operations last went out (a draft or a flush)
    flush_error = ""

    async def flush() -> None:
        nonlocal sent, flush_error, probed
        try:
            await client.flush()
            flush_error = ""
            if down and time.monotonic() - probed >= PROBE_S:
                probed = time.monotonic()
                await client.stats()
                answered()
        except BrokenPipeError:
            raise
        except Exception as e:  # the corpus is down or slow: said once, retried at the next turn
            text = f"{type(e).__name__}: {e}"
            if text != flush_error:
                report(None, e, "flush")
            flush_error = text
        sent = time.monotonic()

    while True:
        if not inbox:
            left = None if client is None else FLUSH_AFTER_S - (time.monotonic() - sent)
            try:
                if left is not None and left <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(arrived.wait(), left)
            except asyncio.TimeoutError:
                await flush()
                continue
        arrived.clear()
        chunks, inbox[:] = inbox[:], []
        batch = []
        for data in chunks:
            if not data:
                batch.append(Close())
                break
            try:
                batch.extend(frames.feed(data))
            except ValueError as e:  # not the parent's messages: nothing more from it can be trusted
                log.error("%s", e)
                return 2
        for msg in batch:
            kind = type(msg)  # one of TO_CHILD: Frames checked it
            if kind is Close:
                loop.remove_reader(rfd)
                if client is not None:
                    # What the client still buffers goes out first (within its timeout: the parent
                    # waits a bounded time for this process to exit), so a drafter's last commits
                    # reach the shared corpus.
                    try:
                        await asyncio.wait_for(client.flush(), client.timeout)
                    except BrokenPipeError:
                        raise
                    except Exception as e:
                        log.warning("corpus client process: the last calls were not sent: %s: %s", type(e).__name__, e)
                    await client.close()
                return 0
            if kind is Configure:
                s = msg.settings
                try:
                    client = AsyncCorpusClient(s.target, namespace=s.namespace, timeout=s.timeout_s, token=s.token,
                                               tls=s.tls, breaker=CircuitBreaker(failure_threshold=2,
                                                                                 cooldown_s=s.breaker_cooldown_s))
                except Exception as e:  # reported to the constructor, which raises it
                    send(Failure(None, note_of(e)))
                    return 2
                send(Ready())
            elif client is None:
                log.error("corpus client process: a %s message before Configure", kind.__name__)
                return 2
            elif kind is Calls:
                for call in msg.calls:
                    try:
                        # Awaited: a buffered call sends the pending step itself when it must (a
                        # restarted id finished in it, too many buffered tokens).
                        await apply(client, call)
                    except BrokenPipeError:
                        raise
                    except Exception as e:
                        report(None, e, type(call).__name__)
            elif kind is DraftAsk:
                tid = msg.ticket
                try:
                    b, capped = await draft_capped_async(client, msg.req_ids, msg.nodes, msg.budget)
                    answered()
                    send(Trees(tid, b, capped))
                except BrokenPipeError:
                    raise
                except Exception as e:
                    report(tid, e, "draft")
                sent = time.monotonic()
        if client is not None and time.monotonic() - sent >= FLUSH_AFTER_S:
            await flush()


def main() -> int:
    import signal

    # Ctrl-C in a terminal reaches the whole process group: the parent closes this process itself
    # (or its exit closes the pipe), so the child does not die mid-call with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s corpus-client %(levelname)s %(message)s")
    return _child()


if __name__ == "__main__":
    sys.exit(main())
