"""Draft trees from the corpus, with a fallback that keeps the verifier serving.

``local``: an in-process ``NgramCorpus``. Remote: a ``CorpusClient`` driven by one worker thread
(every call, in order, so buffered start/extend/finish stay consistent), plus an in-process
corpus that mirrors this verifier's requests (prompt lookup plus what this verifier generated).

Remote drafting, ``pipelined`` (the default): a step never waits for the network. It drafts from
the in-process mirror, fresh, and merges the remote corpus' tree that was asked for one step
earlier (deeper than a step's budget), re-rooted along the tokens committed since (read from the
mirror's context after its length at the ask: ``NgramCorpus.draft_merged``, one native call); then it asks the remote corpus for the next step's
tree, which is drafted while the GPU verifies this step. What the shared corpus knows beyond this
verifier (other replicas' outputs, external corpora) arrives one step late; this verifier's own
requests are always fresh. ``sync``: every step waits up to ``draft_timeout_s`` for the remote
tree (fresh, but a network round trip per step; docs/benchmarks.md compares the two).

When the corpus is down (``CorpusUnavailable``: the client's circuit breaker answers in
microseconds), errs, or is slow, steps draft from the mirror alone. A call still in flight keeps
running in the background (the client retries and, once the server is back, replays every live
request on a new session); until it returns, the engine does not wait on the remote corpus at all.
No corpus failure ever fails a request. An outage is said once when it starts and once when it
ends, and shown in /healthz and /metrics (``verifier.draft.corpus_health.CorpusHealth``).

The namespace (``check``, ``verifier.draft.corpus_health.check_namespace``): checked when the drafter is
made. A mismatch raises (a start-up error); a corpus that cannot be reached then leaves remote
drafting held (the mirror drafts, nothing is sent) and the check is retried in the background every
``CHECK_RETRY_S``; once it passes, every live request is replayed to the corpus and remote drafting
starts. After every outage the check runs again: a mismatch found at run time turns remote drafting
off for good, loudly (log, metric, health field), since this verifier's commits would spoil a
namespace of another model's token ids.

Asking is measured (``remote_asks="adaptive"``, the default; ``verifier.draft.ask_gate``): each merged
step counts the accepted tokens only the remote tree drafted, and where the remote trees add less
than they cost, the drafter asks one step in up to 32 for the batch; it still asks about every new
request on its first step, and about a request whose remote trees added accepted tokens on every
step until ``HOT_ASKS`` of its asked steps in a row add none; the mirror drafts the rest.
``"always"`` asks every step.

Where the client runs (``remote_client``): ``process`` (the default) runs the ``CorpusClient`` in
a child process (``verifier.draft.corpus_process``): the engine's side of a step is at most one pipe write and
one non-blocking read, and the client's Python work (protobuf, gRPC's threads) never holds the
engine's GIL. A child that dies is replaced in the background; the drafter replays every live
request into the new one (its prompt, kept here, and its committed tokens, read from the mirror).
``thread`` runs the client on a
thread of this process. That thread shares the GIL with the engine's step loop, so a thread client
lowers the interpreter's switch interval (``GIL_SWITCH_INTERVAL_S``, never raising it): with
Python's 5 ms default, an engine thread whose GPU step had finished waited up to 5 ms for the client
thread's Python work to yield, against ~1 ms steps (H200, SmolLM2, batch 1: remote drafting went
from 1,280 to 1,424 tok/s with it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from corpus_service import MAX_BUDGET, CorpusConfig, DraftBatch, NgramCorpus

from .ask_gate import AskGate, AskGateConfig
from .corpus_health import BackgroundCheck, CorpusHealth, NamespaceMismatch, unreachable
from .corpus_process import FLUSH_AFTER_S, REACHABLE_NOTE, ClientProcess, ClientSettings, Ticket, draft_capped

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 2e-4  # see the module docstring


def auto_draft_threads() -> int:
    """Threads for the in-process corpus' batch drafts: a quarter of the CPUs, 1 to 4 (the engine
    thread waits on the GPU meanwhile; the corpus client and server have the rest)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


# A dead client process is replaced at once if it had run for STABLE_CHILD_S; otherwise (a crash
# loop, or a replacement that does not start) after a delay that doubles each time, up to the maximum.
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0
STABLE_CHILD_S = 60.0


REMOTE_DRAFT_MODES = ("pipelined", "sync")
REMOTE_CLIENTS = ("process", "thread")
REMOTE_ASKS = ("adaptive", "always")
# Pipelined remote trees are asked this many times deeper than a step's budget: a step that
# accepts a path still finds tree below it.
AHEAD_DEPTH_FACTOR = 2
# Drafter.await_ahead's wait per call with the thread client (its wait lets the client thread take
# the GIL): the engine notices a finished GPU step up to this late when the remote answer is not back
# yet. The process client's answer is a non-blocking read instead, so the engine polls the GPU
# between reads as tightly as a local step's event wait spins: a 10 us select() slept ~60 us
# (the kernel's default 50 us timer slack), and the H200's batch-1 remote drafting step spent
# 23 us more in its forward phase than a local one (0.995 vs 0.972 ms; commit f19f6fc).
AWAIT_AHEAD_S = 1e-5
# Adaptive remote asks (verifier.draft.ask_gate): a request whose remote tree added accepted tokens is
# asked about every step until this many of its asked steps in a row add none, whatever the gate
# says for the batch (at large batch a few requests the fleet knows would not move its share).
HOT_ASKS = 8
# Drafter.dispatch(hold=True): calls no draft request needs wait in the engine's process for at most
# this long after the last hand-off, or until this many are held (a step adds one commit call).
HOLD_CALLS_S = 0.02
HOLD_CALLS_MAX = 64
# A namespace check the corpus could not answer (down at start-up) is tried again this often.
CHECK_RETRY_S = 1.0


@dataclass
class DraftStats:
    remote_steps: int = 0  # steps drafted with the remote corpus' tree (pipelined: merged, one step late)
    fallback_steps: int = 0  # steps drafted in process alone: the remote tree failed, or was not back yet
    local_steps: int = 0  # steps drafted by the in-process corpus (--corpus local; pipelined: the first step)
    remote_errors: int = 0
    last_error: str = ""
    client_restarts: int = 0  # dead client processes replaced (their live requests replayed)
    asks: int = 0  # pipelined: remote tree requests sent
    asks_skipped: int = 0  # pipelined: steps that did not ask (remote_asks="adaptive": no measured gain)
    remote_gain_tokens: int = 0  # accepted tokens that only the remote corpus' trees drafted


class Drafter:
    def __init__(self, corpus: str | NgramCorpus = "local", *, namespace: str = "default",
                 draft_timeout_s: float = 0.05, client_timeout_s: float = 1.0, vocab_size: int = 0,
                 breaker_cooldown_s: float = 0.5, token: str | None = None, tls: str | None = None,
                 remote_drafts: str = "pipelined", remote_client: str = "process", draft_threads: int = 1,
                 remote_asks: str = "adaptive", ask_gate: AskGateConfig | None = None,
                 check: Callable[[], str] | None = None) -> None:
        """``check``: the remote namespace's check (``verifier.draft.corpus_health.check_namespace`` bound to
        this verifier's model): run now (a mismatch raises NamespaceMismatch, a ValueError), again
        in the background while the corpus cannot be reached, and after every outage."""
        # A short cool-down: a trial against a dead corpus runs on the client thread and fails fast
        # (the channel is in backoff), while a long one would delay resuming speculation after a restart
        # (docs/reliability.md promises 2 s; the channel's reconnect backoff is at most 1 s).
        if not draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s: expected > 0, got {draft_timeout_s}")
        if remote_drafts not in REMOTE_DRAFT_MODES:
            raise ValueError(f"remote_drafts: expected one of {', '.join(REMOTE_DRAFT_MODES)}, got {remote_drafts!r}")
        if remote_client not in REMOTE_CLIENTS:
            raise ValueError(f"remote_client: expected one of {', '.join(REMOTE_CLIENTS)}, got {remote_client!r}")
        if remote_asks not in REMOTE_ASKS:
            raise ValueError(f"remote_asks: expected one of {', '.join(REMOTE_ASKS)}, got {remote_asks!r}")
        # The in-process corpus (the draft source when local, the mirror when remote): batches of
        # at least 8 requests per thread are drafted by draft_threads threads (CorpusConfig).
        local_config = CorpusConfig(vocab_size=vocab_size, draft_threads=draft_threads)
        self.pipelined = remote_drafts == "pipelined"
        # Pipelined: the remote call for the next step's trees (future or ticket), its request ids and
        # their context lengths in the mirror when it was queued: each tree is re-rooted along the
        # tokens committed after that length, which the mirror holds (no per-request path kept here).
        self._ahead: tuple[Future | Ticket, list[str], np.ndarray] | None = None
        self._ahead_cap = MAX_BUDGET  # lowered if the corpus refuses deep trees
        self._deferred: list = []  # pipelined: remote calls held until dispatch()
        self._handed_at = 0.0  # pipelined: when dispatch() last handed calls to the client
        self._ask: tuple[list[str], int] | None = None  # pipelined: the draft request dispatch() sends
        # Pipelined, adaptive: whether to ask (AskGate), from the last merged step (its request ids
        # and trees), then with the tokens it committed, scored in the next dispatch() (GPU time).
        self._gate = AskGate(ask_gate) if remote_asks == "adaptive" else None
        self._merged: tuple[list[str], DraftBatch, np.ndarray] | None = None
        self._unasked: set[str] = set()  # adaptive: live requests never asked about yet
        # Adaptive: requests whose remote trees added accepted tokens lately, asked about every step
        # whatever the gate says, with the asks left before they cool down (HOT_ASKS).
        self._hot: dict[str, int] = {}
        self._scoring: tuple[list[str], DraftBatch, np.ndarray, list[tuple[str, list[int]]]] | None = None
        self.stats = DraftStats()
        self.draft_timeout_s = draft_timeout_s
        self._client = None  # thread client
        self._pool: ThreadPoolExecutor | None = None
        self._proc: ClientProcess | None = None  # process client
        self._inflight: Future | Ticket | None = None
        self.health: CorpusHealth | None = None  # remote only
        # Remote: every live request's prompt, group and history keywords: with its committed tokens (the mirror's
        # context after the prompt), what a corpus that has not seen them is given (a replacement
        # client process, whose predecessor's session and server state are gone, or a corpus whose
        # namespace check passed only after requests started).
        self._live: dict[str, tuple[list[int], str | None, dict]] | None = None
        self._check, self._checking = check, None
        self._held = False  # remote drafting waits for the namespace check (the corpus was down)
        self._off = ""  # why remote drafting was turned off for good ("" while it is not)
        self._recoveries = 0  # outages ended, as of the last re-check started
        if not isinstance(corpus, NgramCorpus) and corpus != "local":
            self._live = {}
            self.health = CorpusHealth(corpus, namespace)
            self.health.remote_drafting = True
            if check is not None:  # before any client exists: a mismatch costs no child process
                self.target = corpus
                self._check_at_start()
        if isinstance(corpus, NgramCorpus):
            self.local, self.target = corpus, "local"
        elif corpus == "local":
            self.local, self.target = NgramCorpus(local_config), "local"
        elif remote_client == "process":
            self.target = corpus
            self._settings = ClientSettings(corpus, namespace=namespace, timeout_s=client_timeout_s,
                                            breaker_cooldown_s=breaker_cooldown_s, token=token, tls=tls)
            self._proc = ClientProcess(self._settings)
            self.local = NgramCorpus(local_config)
            self._restart: _Restart | None = None
            self._restart_delay = RESTART_DELAY_S
            self._restart_at: float | None = None  # when to start a replacement (None: no death handled)
            self._child_since = time.monotonic()
        else:
            from corpus_service.client import CircuitBreaker, CorpusClient

            self.target = corpus
            self._client = CorpusClient(corpus, namespace=namespace, timeout=client_timeout_s, token=token, tls=tls,
                                        breaker=CircuitBreaker(failure_threshold=2, cooldown_s=breaker_cooldown_s))
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="corpus-client")
            self._sent_at = time.monotonic()  # the last draft or flush that carried buffered calls
            if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:  # process-wide; never raised
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            self.local = NgramCorpus(local_config)

    @property
    def remote(self) -> bool:
        """Remote drafting is on: a client exists, the namespace check is not pending, and it found
        no mismatch."""
        return (self._client is not None or self._proc is not None) and not self._held and not self._off

    @property
    def pipelined_remote(self) -> bool:
        """Remote drafts asked a step ahead: there is an answer to take in while the GPU works."""
        return self.pipelined and self.remote

    # Mirror every request operation into the local corpus (the draft source when local, the
    # fallback when remote) and queue it for the remote one.

    def start_request(self, req_id: str, prompt_ids: list[int], group: str | None = None, *,
                      prompt_key: str | None = None, policy_version: int | None = None) -> None:
        """``group``: requests of one key (the samples of one API request) draft from each other.
        ``prompt_key``/``policy_version``: the prompt history's key and the policy sampling the request
        (``NgramCorpus.start_request``); passed on to the remote corpus only where set."""
        self.local.start_request(req_id, prompt_ids, group=group, prompt_key=prompt_key, policy_version=policy_version)
        prompt = list(prompt_ids)
        history = {k: v for k, v in (("prompt_key", prompt_key), ("policy_version", policy_version)) if v is not None}
        if self._live is not None:
            self._live[req_id] = (prompt, group, history)
        if self._gate is not None:
            self._unasked.add(req_id)  # whether the fleet knows its continuation: asked next step
        self._remote_call("start_request", req_id, prompt, group, kwargs=history)

    def extend(self, req_id: str, tokens: list[int]) -> None:
        if tokens:
            self._merged = None  # scored only through extend_many (the engine's commits)
            self.local.extend(req_id, tokens)
            self._remote_call("extend_many", [(req_id, list(tokens))])

    def extend_many(self, items: list[tuple[str, list[int]]]) -> None:
        """A step's extends in one native call and one queued remote call (not one per request)."""
        items = [(r, t) for r, t in items if t]
        if not items:
            return
        ids, runs = zip(*items)
        self.local.extend_runs(ids, runs)  # the lists read natively (no per-token Python loop)
        if self._merged is not None:  # the merged step's commits: scored in the next dispatch()
            self._scoring, self._merged = (*self._merged, items), None
        self._remote_call("extend_many", items)

    def finish(self, req_id: str, rollout: bool = True) -> None:
        """``rollout=False``: the request did not finish (aborted, failed); its cut output stays out
        of its prompt key's history, here and on the remote corpus."""
        self._unasked.discard(req_id)
        if req_id in self._hot:
            if self._scoring is not None:  # its last step is scored as a hot request's
                self._score()
            self._hot.pop(req_id, None)  # (the score may have cooled it down)
        if self._live is not None:
            self._live.pop(req_id, None)
        if self.local.has_request(req_id):
            self.local.finish(req_id, rollout=rollout)
        self._remote_call("finish", req_id, kwargs=None if rollout else {"rollout": False})

    def draft(self, req_ids: list[str], budget: int) -> DraftBatch:
        if self._checking is not None:
            self._take_check()
        if not self.remote:
            if self.health is not None:  # a remote corpus held back or turned off: the mirror drafts
                self.stats.fallback_steps += 1
            else:
                self.stats.local_steps += 1
            return self.local.draft(req_ids, budget)
        if self.pipelined:
            if self._ask is not None:  # the caller never dispatched the previous step's calls
                self.dispatch()
            merged = self._draft_merged(req_ids, budget)
            self._ask = (list(req_ids), budget)  # sent by dispatch(), while the GPU verifies
            return merged
        batch = self._remote_draft(req_ids, budget)
        if batch is not None:
            self.stats.remote_steps += 1
            return batch
        self.stats.fallback_steps += 1
        return self.local.draft(req_ids, budget)

    def close(self) -> None:
        if self._checking is not None:
            self._checking.abandon()
            self._checking = None
        if self._deferred and self.remote and not (self._proc is not None and self._proc.dead):
            calls, self._deferred = self._deferred, []  # held calls (dispatch(hold=True)) still reach the corpus
            self._send_calls(calls)
        self._close_clients(flush=not self._off)

    def _close_clients(self, flush: bool) -> None:
        """Closes the remote client (``flush``: what it buffers goes out first)."""
        if self._proc is not None and self._restart is not None:
            self._restart.abandon()
            self._restart = None
        if self._pool is not None:
            # The calls queued on the client thread, then what the client buffers, go out first
            # (for at most the client's timeout: a corpus that is down cannot hold the close up).
            if flush:
                last = self._pool.submit(self._guarded, self._client.flush)
                try:
                    last.result(timeout=self._client.timeout)
                except FutureTimeout:
                    log.warning("corpus %s: the last calls were not sent within %.1f s", self.target,
                                self._client.timeout)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
        if self._proc is not None:
            if flush:
                self._proc.close()
            else:  # nothing more may reach the corpus: the child is stopped, not asked to close
                self._proc.kill()

    # ------------------------------------------------------------------ remote

    def dispatch(self, hold: bool = False) -> None:
        """Pipelined: hands the held remote calls (starts, commits, finishes, in order) and the
        next step's draft request to the client. The engine calls it once the GPU is busy with the
        step, so the client's work overlaps the GPU rather than the engine's own, and at the end of
        a step that no verify step follows at once (a plain step, or none: finishes reach the
        corpus even when nothing runs next).

        ``hold``: the caller steps again soon (requests are running), so calls that no draft
        request needs now may wait for a later dispatch, up to ``HOLD_CALLS_S`` after the last
        hand-off (or ``HOLD_CALLS_MAX`` calls). The client sends calls to the server only with a
        draft request or every ``FLUSH_AFTER_S`` anyway; handing them over every step woke the
        client process every step for nothing (on the H200 host it used 0.27 ms of CPU per batch-1
        step). A draft request always carries every call before it, in order."""
        if self._checking is not None:
            self._take_check()
        if not self.remote:
            return
        if self._check is not None and self.health.recoveries != self._recoveries and self._checking is None:
            self._recoveries = self.health.recoveries  # the corpus is back: is it still the namespace we drafted from?
            self._checking = BackgroundCheck(self._check, retry_s=0.0)
        if self._proc is not None and self._proc.dead:
            self._take_child_errors()  # the death itself, reported once
            if not self._revive():
                self._deferred, self._ask = [], None  # the dead child gets nothing; drafts stay in process
                return
        self._take_child_errors()
        if self._scoring is not None:
            self._score()
        ask = None  # (request ids, budget) to ask about now
        pending, self._ask = self._ask, None
        if pending is not None and self._ahead is None:  # (an answer still out: this step cannot ask)
            ids, budget = pending
            if self._gate is None or self._gate.ask():
                ask = ids, budget
            else:
                # The new requests and the hot ones alone.
                u, h = self._unasked, self._hot
                probe = [r for r in ids if r in u or r in h] if (u or h) else None
                if probe:
                    ask = probe, budget
                else:
                    self.stats.asks_skipped += 1
        calls = self._deferred
        if calls and (ask is not None or not hold or len(calls) >= HOLD_CALLS_MAX
                      or time.monotonic() - self._handed_at >= HOLD_CALLS_S):
            self._deferred = []
            self._handed_at = time.monotonic()
            self._send_calls(calls)
        if ask is not None and self._ask_ahead(*ask):
            if ask[0] is ids:  # the whole batch was asked about
                self._unasked.clear()
            else:
                self._unasked.difference_update(ask[0])
        if self._pool is not None and time.monotonic() - self._sent_at >= FLUSH_AFTER_S:
            # The thread client buffers calls until a draft request carries them; where none has
            # for a while (the engine is not drafting), they go out anyway (the child process
            # paces itself the same way: FLUSH_AFTER_S).
            self._sent_at = time.monotonic()
            self._pool.submit(self._guarded, self._client.flush)

    def _revive(self) -> bool:
        """The client process died: a replacement is started in the background (after a delay that
        doubles while replacements fail to start) and, once ready, takes over with every live
        request replayed. Returns whether a live client process is in place now."""
        now = time.monotonic()
        r = self._restart
        if r is None:
            if self._restart_at is None:  # this death is new
                if now - self._child_since >= STABLE_CHILD_S:
                    self._restart_delay, self._restart_at = RESTART_DELAY_S, now
                else:  # it died young
                    self._back_off(now)
            if now >= self._restart_at:
                self._restart = _Restart(self._settings)
            return False
        if not r.done.is_set():
            return False
        self._restart = None
        if r.proc is None:
            self._back_off(now)
            log.warning("corpus %s: a new client process did not start (%s); next try in %.1f s",
                        self.target, r.error, self._restart_at - now)
            return False
        self._proc.close(timeout=0.1)
        self._proc, self._restart_at, self._child_since = r.proc, None, now
        self._ahead, self._inflight = None, None
        self._deferred = self._replay_calls()  # in place of the calls held since the death (all in it)
        self.stats.client_restarts += 1
        log.warning("corpus %s: the client process was replaced; %d live requests replayed", self.target,
                    len(self._live))
        return True

    def _replay_calls(self) -> list[tuple[str, tuple]]:
        """The live requests' whole state as calls: the prompt as a start, what was committed since
        (the mirror's context after the prompt) as one extend."""
        calls = [("start_request", (rid, prompt, group), history) for rid, (prompt, group, history) in self._live.items()]
        outputs = []
        ids = list(self._live)
        for rid, total in zip(ids, self.local.context_lengths(ids).tolist()):
            out = total - len(self._live[rid][0])
            if out > 0:  # total is -1 for a request the mirror no longer holds
                outputs.append((rid, self.local.context_tail(rid, out).tolist()))
        if outputs:
            calls.append(("extend_many", (outputs,)))  # (method, args): one argument, the list
        return calls

    # ------------------------------------------------------------------ namespace check

    def _check_at_start(self) -> None:
        """The namespace check, now: a mismatch raises; a corpus that cannot be reached holds remote
        drafting back until a background check passes."""
        from corpus_service.client import CorpusError

        try:
            note = self._check()
        except NamespaceMismatch:
            self.close()
            raise
        except (CorpusError, OSError) as e:
            text = f"{type(e).__name__}: {e}"
            if not unreachable(text):
                self.close()  # a token or TLS setting the corpus refuses: a configuration error
                raise ValueError(f"corpus {self.target}: the namespace check failed: {text}") from None
            self.health.failure(text)
            self._held, self.health.remote_drafting = True, False
            log.warning("corpus %s: namespace %r is checked once the corpus answers (every %.0f s); until then "
                        "this verifier drafts in process and sends the corpus nothing", self.target,
                        self.health.namespace, CHECK_RETRY_S)
            self._checking = BackgroundCheck(self._check, retry_s=CHECK_RETRY_S)
            return
        self._checked(note)

    def _checked(self, note: str) -> None:
        h = self.health
        first = h.namespace_state != "ok"
        h.namespace_state, h.namespace_note = "ok", note
        if first:
            log.info("corpus %s: %s", self.target, note)

    def _take_check(self) -> None:
        """A background check's verdict, once it is in (the engine's thread acts on it)."""
        c = self._checking
        if not c.done:
            return
        self._checking = None
        if c.mismatch:
            self._turn_off(c.mismatch)
        elif c.note:
            self.health.success(c.asked_at)  # the corpus answered the check
            self._checked(c.note)
            if self._held:
                self._release()

    def _release(self) -> None:
        """The namespace check passed after requests started: they are replayed, then drafting
        asks the corpus too."""
        self._held = False
        self.health.remote_drafting = True
        calls = self._replay_calls()
        if self.pipelined:
            self._deferred = calls + self._deferred
        else:
            self._send_calls(calls)
        log.info("corpus %s: remote drafting on (%d live requests replayed)", self.target, len(self._live))

    def _turn_off(self, why: str) -> None:
        """A mismatch found at run time: the corpus is left alone for the rest of the run."""
        self._off = why
        h = self.health
        h.namespace_state, h.namespace_note, h.remote_drafting = "mismatch", why, False
        log.error("corpus %s: %s. Remote drafting is OFF for the rest of this run (the in-process corpus "
                  "drafts; /healthz corpus.namespace_check says mismatch)", self.target, why)
        self._deferred, self._ask, self._ahead, self._inflight = [], None, None, None
        self._close_clients(flush=False)

    def _back_off(self, now: float) -> None:
        """The next replacement waits the current delay, and the one after twice as long."""
        self._restart_at = now + self._restart_delay
        self._restart_delay = min(2 * self._restart_delay, MAX_RESTART_DELAY_S)

    def _send_calls(self, calls: list[tuple[str, tuple]]) -> None:
        if self._proc is not None:
            self._proc.calls(calls)  # the child sends them on at least every FLUSH_AFTER_S
        elif self._pool is not None:
            self._pool.submit(self._run_calls, calls)

    def _run_calls(self, calls: list[tuple]) -> None:
        for name, args, *kwargs in calls:
            self._guarded(getattr(self._client, name), *args, **(kwargs[0] if kwargs else {}))

    def _remote_call(self, name: str, *args, kwargs: dict | None = None) -> None:
        """Queues the client method ``name`` (start_request, extend_many, finish) for the remote corpus:
        ``(name, args)``, or ``(name, args, kwargs)`` where keywords are set."""
        if not self.remote:
            return
        call = (name, args, kwargs) if kwargs else (name, args)
        if self.pipelined:  # held for dispatch(): one hand-off per step, ordered before the draft request
            self._deferred.append(call)
        else:
            self._send_calls([call])

    def _take_child_errors(self) -> None:
        if self._proc is not None and self._proc.errors:
            errors, self._proc.errors = self._proc.errors, []
            for text in errors:
                if text == REACHABLE_NOTE:
                    self.health.success()
                else:
                    self._note_error_text(text)

    def _guarded(self, fn, *args, **kwargs):
        from corpus_service.client import CorpusError

        try:
            return fn(*args, **kwargs)
        except (CorpusError, ValueError) as e:  # never let the corpus fail a request
            self._note_error(e)
            return None

    def _note_error(self, e: Exception) -> None:
        self._note_error_text(f"{type(e).__name__}: {e}")

    def _note_error_text(self, msg: str, asked_at: float | None = None) -> None:
        """A failed call, counted; logged once per outage (or per kind of refusal) by the health."""
        self.stats.remote_errors += 1
        self.stats.last_error = msg
        self.health.failure(msg, asked_at)

    def _ask_ahead(self, req_ids: list[str], budget: int) -> bool:
        """Queues the remote draft of the next step's trees (after every queued extend, so it sees
        this verifier's context as of now), unless the previous one is still out. Returns whether
        it did."""
        if self._ahead is not None:
            return False
        ids = list(req_ids)
        deep = max(budget, min(self._ahead_cap, AHEAD_DEPTH_FACTOR * budget))
        lengths = self.local.context_lengths(ids)  # -1 where the mirror lacks a request: nothing re-roots
        self.stats.asks += 1
        if self._proc is not None:
            self._ahead = (self._proc.draft(ids, deep, budget), ids, lengths)
        else:
            fut = self._pool.submit(self._guarded, self._draft_ahead, ids, deep, budget)
            fut.asked_at = time.monotonic()  # (as a Ticket's: CorpusHealth.success)
            self._ahead = (fut, ids, lengths)
            self._sent_at = time.monotonic()
        return True

    def await_ahead(self, timeout_s: float | None = None) -> bool:
        """Pipelined: takes in the remote answer asked by the last dispatch() if it is back, so that
        the next step's draft finds it decoded; waits up to ``timeout_s`` for it (None: the
        thread client AWAIT_AHEAD_S, the process client not at all: one non-blocking read). The
        engine calls it while the GPU runs a step, between polls of the GPU: reading and decoding
        the answer then leave the host's critical path between steps. Returns whether an answer is
        still outstanding."""
        if self._ahead is None:
            return False
        handle = self._ahead[0]
        if handle.done():
            return False
        if isinstance(handle, Future):
            wait_futures([handle], timeout=AWAIT_AHEAD_S if timeout_s is None else timeout_s)
            return not handle.done()
        if not timeout_s:
            return True  # done() above was the read
        return not handle.wait(timeout_s)

    def _draft_ahead(self, ids: list[str], deep: int, budget: int) -> DraftBatch:
        batch, capped = draft_capped(self._client, ids, deep, budget)
        if capped:
            self._cap_ahead(budget)
        return batch

    def _cap_ahead(self, budget: int) -> None:
        """The corpus refuses deep trees (its --max-budget): a step's budget from now on."""
        if self._ahead_cap != budget:
            log.info("corpus %s refuses deep trees; pipelined drafts ask for %d nodes from now on", self.target, budget)
            self._ahead_cap = budget

    def _draft_merged(self, req_ids: list[str], budget: int) -> DraftBatch:
        """The mirror's fresh trees, merged with the remote answer asked one step earlier where it
        is back (``NgramCorpus.draft_merged``: one native call)."""
        taken = self._take_ahead(req_ids, budget)
        if taken is None:
            self._merged = None
            return self.local.draft(req_ids, budget)
        self.stats.remote_steps += 1
        merged = self.local.draft_merged(req_ids, budget, taken[0], since_from=taken[1])
        self._merged = (list(req_ids), merged, taken[1] >= 0)  # rows asked about (the rest: -1)
        return merged

    def _score(self) -> None:
        """The last merged step's gain: of the tokens each request asked about accepted (its
        committed run less the bonus token), those only the remote tree drafted
        (``DraftBatch.earlier_accepted``), against the tokens those requests committed."""
        ids, merged, asked, items = self._scoring
        self._scoring = None
        row = {r: i for i, r in enumerate(ids)}
        asked = asked.tolist()
        rows, paths, items_asked, delivered = [], [], [], 0
        for rid, run in items:
            i = row.get(rid)
            if i is not None and asked[i]:
                rows.append(i)
                paths.append(run[:-1])
                items_asked.append((rid, run))
                delivered += len(run)
        if not rows:
            return
        gains = merged.earlier_accepted(rows, paths)
        gain = int(gains.sum())
        self.stats.remote_gain_tokens += gain
        if self._gate is None:
            return
        hot = self._hot
        if hot:  # the gate learns from the other requests (a hot one is asked about every step)
            for j, (rid, run) in enumerate(items_asked):
                if rid in hot:
                    delivered -= len(run)
                    gain -= int(gains[j])
                    hot[rid] -= 1
                    if hot[rid] <= 0:
                        del hot[rid]
        self._gate.observe(delivered, gain)
        for j in np.flatnonzero(gains).tolist():  # rare: what the fleet knew of these requests
            rid = items_asked[j][0]
            if self.local.has_request(rid):  # not one that finished meanwhile
                hot[rid] = HOT_ASKS

    def _take_ahead(self, req_ids: list[str], budget: int) -> tuple[DraftBatch, np.ndarray] | None:
        """The remote trees asked one step earlier, one row per request of ``req_ids`` (empty where
        a request was not asked about), with each request's context length when they were asked;
        or None, counted, where there are none to merge: nothing asked yet (the first step), not
        back yet, failed, or no child process running."""
        if self._ahead is None:
            dead = self._proc is not None and self._proc.dead  # until a new child runs
            if dead:
                self.stats.fallback_steps += 1
            else:
                self.stats.local_steps += 1
            return None
        if not self._ahead[0].done():
            self.stats.fallback_steps += 1
            return None
        fut, ids, lengths = self._ahead
        self._ahead = None
        earlier = self._answer(fut, budget)
        if earlier is None or len(earlier) != len(ids):
            self.stats.fallback_steps += 1
            return None
        if ids != list(req_ids):  # the batch changed: align rows by request, empty where absent
            row = {r: i for i, r in enumerate(ids)}
            idx = np.array([row.get(r, -1) for r in req_ids], dtype=np.int64)
            have = idx >= 0
            pick = np.where(have, idx, 0)
            earlier = DraftBatch(earlier.tokens[pick], earlier.parents[pick], earlier.probs[pick],
                                 np.where(have, earlier.counts[pick], 0).astype(np.int32))
            lengths = np.where(have, lengths[pick], -1)
        return earlier, lengths

    def _answer(self, handle: Future | Ticket, budget: int) -> DraftBatch | None:
        """A finished remote draft's trees, or None after an error (counted)."""
        if isinstance(handle, Future):
            batch = handle.result()  # _guarded: None after an error (already counted)
        else:
            self._take_child_errors()
            if handle.error:
                self._note_error_text(handle.error, handle.asked_at)
                return None
            if handle.capped:
                self._cap_ahead(budget)
            batch = handle.batch
        if batch is not None:
            self.health.success(handle.asked_at)
        return batch

    def _remote_draft(self, req_ids: list[str], budget: int) -> DraftBatch | None:
        if self._inflight is not None and not self._inflight.done():
            return None  # an earlier call is still stuck on a slow/unreachable corpus
        if self._proc is not None:
            ticket = self._proc.draft(list(req_ids), budget, budget)
            if not ticket.wait(self.draft_timeout_s):
                self._inflight = ticket
                return None
            self._inflight = None
            batch = self._answer(ticket, budget)
        else:
            fut = self._pool.submit(self._guarded, self._client.draft, req_ids, budget)
            self._sent_at = asked_at = time.monotonic()
            try:
                batch = fut.result(timeout=self.draft_timeout_s)
            except FutureTimeout:
                self._inflight = fut
                return None
            self._inflight = None
            if batch is not None:
                self.health.success(asked_at)
        return batch if batch is not None and len(batch) == len(req_ids) else None


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
        except Exception as e:  # reported by the drafter, which tries again later
            self.error = f"{type(e).__name__}: {e}"
            proc = None
        with self._lock:
            if self._abandoned and proc is not None:
                proc.close(timeout=0.5)
                proc = None
            self.proc = proc
        self.done.set()

    def abandon(self) -> None:
        """The drafter closes: a process started after this is closed by the thread."""
        with self._lock:
            self._abandoned = True
            if self.proc is not None:
                self.proc.close(timeout=0.5)
                self.proc = None

