"""Draft trees from the corpus, with a fallback that keeps the verifier serving.

``local``: an in-process ``NgramCorpus``. Remote: a remote ``DraftSource`` (``verifier.draft.sources``:
a ``CorpusClient`` in a child process or on a worker thread), plus an in-process corpus that mirrors
this verifier's requests (prompt lookup plus what this verifier generated). How it drafts is one
validated ``DraftConfig`` (``verifier.draft.config``; the ``serve`` flags of the same names).

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
ends, and shown in /healthz and /metrics (``corpus_service.client.health.CorpusHealth``).

The namespace (``check``, ``corpus_service.client.health.check_namespace``): checked when the drafter is
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

Where the client runs (``remote_client``): ``process`` (the default, ``ChildProcessSource``) or
``thread`` (``ThreadSource``); ``verifier.draft.sources`` says why the child process is the default.
A child that dies is replaced in the background; the drafter replays every live request into the
new one (its prompt, kept here, and its committed tokens, read from the mirror).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from corpus_service import MAX_BUDGET, CorpusConfig, DraftBatch, NgramCorpus

from .ask_gate import AskGate
from .calls import Call, Extend, Finish, StartRequest
from .config import REMOTE_ASKS, REMOTE_CLIENTS, REMOTE_DRAFT_MODES, CorpusEndpoint, DraftConfig, auto_draft_threads
from corpus_service.client import BackgroundCheck, CorpusHealth, NamespaceMismatch, unreachable
from .messages import REACHABLE_NOTE, Note, note_of
from .sources import AWAIT_AHEAD_S, GIL_SWITCH_INTERVAL_S, InProcessSource, Pending, remote_source

__all__ = ["Drafter", "DraftStats", "DraftConfig", "CorpusEndpoint", "auto_draft_threads", "AWAIT_AHEAD_S",
           "GIL_SWITCH_INTERVAL_S", "REMOTE_ASKS", "REMOTE_CLIENTS", "REMOTE_DRAFT_MODES"]

log = logging.getLogger(__name__)

# Pipelined remote trees are asked this many times deeper than a step's budget: a step that
# accepts a path still finds tree below it.
AHEAD_DEPTH_FACTOR = 2
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
    def __init__(self, corpus: str | CorpusEndpoint | NgramCorpus = "local", config: DraftConfig | None = None, *,
                 vocab_size: int = 0, check: Callable[[], str] | None = None) -> None:
        """``corpus``: 'local' (a new in-process corpus), an ``NgramCorpus`` to draft from, or a corpus
        service (a ``CorpusEndpoint``, or its HOST:PORT with the default namespace and no token).
        ``check``: the remote namespace's check (``corpus_service.client.health.check_namespace``
        bound to this verifier's model): run now (a mismatch raises NamespaceMismatch, a ValueError),
        again in the background while the corpus cannot be reached, and after every outage."""
        config = DraftConfig() if config is None else config
        if not isinstance(config, DraftConfig):
            raise TypeError(f"config: expected a DraftConfig, got {type(config).__name__}")
        if isinstance(corpus, str) and corpus != "local":
            corpus = CorpusEndpoint(corpus)
        if not isinstance(corpus, (str, CorpusEndpoint, NgramCorpus)):
            raise TypeError(f"corpus: expected 'local', an NgramCorpus or a CorpusEndpoint, "
                            f"got {type(corpus).__name__}")
        self.config = config
        self.pipelined = config.pipelined
        self.draft_timeout_s = config.draft_timeout_s
        # Pipelined: the remote draft for the next step's trees, its request ids and their context
        # lengths in the mirror when it was queued: each tree is re-rooted along the tokens committed
        # after that length, which the mirror holds (no per-request path kept here).
        self._ahead: tuple[Pending, list[str], np.ndarray] | None = None
        self._ahead_cap = MAX_BUDGET  # lowered if the corpus refuses deep trees
        self._handed_at = 0.0  # pipelined: when dispatch() last handed calls to the client
        self._ask: tuple[list[str], int] | None = None  # pipelined: the draft request dispatch() sends
        # Pipelined, adaptive: whether to ask (AskGate), from the last merged step (its request ids
        # and trees), then with the tokens it committed, scored in the next dispatch() (GPU time).
        self._gate = AskGate(config.ask_gate) if config.remote_asks == "adaptive" else None
        self._merged: tuple[list[str], DraftBatch, np.ndarray] | None = None
        self._unasked: set[str] = set()  # adaptive: live requests never asked about yet
        # Adaptive: requests whose remote trees added accepted tokens lately, asked about every step
        # whatever the gate says, with the asks left before they cool down (HOT_ASKS).
        self._hot: dict[str, int] = {}
        self._scoring: tuple[list[str], DraftBatch, np.ndarray, list[tuple[str, list[int]]]] | None = None
        self.stats = DraftStats()
        self.source = None  # the remote DraftSource (ChildProcessSource or ThreadSource), if any
        self._inflight: Pending | None = None
        self.health: CorpusHealth | None = None  # remote only
        # Remote: every live request's start (prompt, group, prompt history key and policy version):
        # with its committed tokens (the mirror's context after the prompt), what a corpus that has
        # not seen them is given (a replacement client process, whose predecessor's session and
        # server state are gone, or a corpus whose namespace check passed only after requests started).
        self._live: dict[str, StartRequest] | None = None
        self._check, self._checking = check, None
        self._held = False  # remote drafting waits for the namespace check (the corpus was down)
        self._off = ""  # why remote drafting was turned off for good ("" while it is not)
        self._recoveries = 0  # outages ended, as of the last re-check started
        if isinstance(corpus, NgramCorpus):
            self.local, self.target = corpus, "local"
        else:
            # The in-process corpus (the draft source when local, the mirror when remote): batches of
            # at least 8 requests per thread are drafted by draft_threads threads (CorpusConfig).
            self.local = NgramCorpus(CorpusConfig(vocab_size=vocab_size, draft_threads=config.threads))
            self.target = "local" if corpus == "local" else corpus.target
        self.mirror = InProcessSource(self.local)
        if isinstance(corpus, CorpusEndpoint):
            self._live = {}
            self.health = CorpusHealth(corpus.target, corpus.namespace)
            self.health.remote_drafting = True
            if check is not None:  # before any client exists: a mismatch costs no child process
                self._check_at_start()
            self.source = remote_source(corpus, config)

    @property
    def remote(self) -> bool:
        """Remote drafting is on: a client exists, the namespace check is not pending, and it found
        no mismatch."""
        return self.source is not None and not self._held and not self._off

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
        self.mirror.start(req_id, prompt_ids, group, prompt_key=prompt_key, policy_version=policy_version)
        start = StartRequest(req_id, list(prompt_ids), group, prompt_key, policy_version)
        if self._live is not None:
            self._live[req_id] = start
        if self._gate is not None:
            self._unasked.add(req_id)  # whether the fleet knows its continuation: asked next step
        self._remote_call(start)

    def extend(self, req_id: str, tokens: list[int]) -> None:
        if tokens:
            self._merged = None  # scored only through extend_many (the engine's commits)
            self.local.extend(req_id, tokens)
            self._remote_call(Extend([(req_id, list(tokens))]))

    def extend_many(self, items: list[tuple[str, list[int]]]) -> None:
        """A step's extends in one native call and one queued remote call (not one per request)."""
        items = [(r, t) for r, t in items if t]
        if not items:
            return
        self.mirror.extend(items)
        if self._merged is not None:  # the merged step's commits: scored in the next dispatch()
            self._scoring, self._merged = (*self._merged, items), None
        self._remote_call(Extend(items))

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
        self.mirror.finish(req_id, rollout)
        self._remote_call(Finish(req_id, rollout))

    def draft(self, req_ids: list[str], budget: int) -> DraftBatch:
        if self._checking is not None:
            self._take_check()
        if not self.remote:
            if self.health is not None:  # a remote corpus held back or turned off: the mirror drafts
                self.stats.fallback_steps += 1
            else:
                self.stats.local_steps += 1
            return self.mirror.draft(req_ids, budget, budget).batch
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
        if self.source is not None:
            # Held calls (dispatch(hold=True)) still reach the corpus, unless it serves another
            # model's namespace (a mismatch turned remote drafting off and closed the source).
            if not self._off:
                self.source.close(flush=True)
            self.source = None

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
        src = self.source
        if src.dead:
            self._take_notes()  # the death itself, reported once
            if not src.revive():
                src.held, self._ask = [], None  # the dead child gets nothing; drafts stay in process
                return
            self._ahead, self._inflight = None, None
            src.held = self._replay_calls()  # in place of the calls held since the death (all in it)
            self.stats.client_restarts += 1
            log.warning("corpus %s: the client process was replaced; %d live requests replayed", self.target,
                        len(self._live))
        self._take_notes()
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
        held = len(src.held)
        if held and (ask is not None or not hold or held >= HOLD_CALLS_MAX
                     or time.monotonic() - self._handed_at >= HOLD_CALLS_S):
            self._handed_at = time.monotonic()
            src.send()
        if ask is not None and self._ask_ahead(*ask):
            if ask[0] is ids:  # the whole batch was asked about
                self._unasked.clear()
            else:
                self._unasked.difference_update(ask[0])
        src.tick()

    def _replay_calls(self) -> list[Call]:
        """The live requests' whole state as calls: the prompt as a start, what was committed since
        (the mirror's context after the prompt) as one extend."""
        calls: list[Call] = list(self._live.values())
        outputs = []
        ids = list(self._live)
        for rid, total in zip(ids, self.local.context_lengths(ids).tolist()):
            out = total - len(self._live[rid].prompt)
            if out > 0:  # total is -1 for a request the mirror no longer holds
                outputs.append((rid, self.local.context_tail(rid, out).tolist()))
        if outputs:
            calls.append(Extend(outputs))
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
            note = note_of(e)
            if not unreachable(note):
                self.close()  # a token or TLS setting the corpus refuses: a configuration error
                raise ValueError(f"corpus {self.target}: the namespace check failed: {note.text}") from None
            self.health.failure(note)
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
        src = self.source
        src.held = self._replay_calls() + src.held
        if not self.pipelined:
            src.send()
        log.info("corpus %s: remote drafting on (%d live requests replayed)", self.target, len(self._live))

    def _turn_off(self, why: str) -> None:
        """A mismatch found at run time: the corpus is left alone for the rest of the run."""
        self._off = why
        h = self.health
        h.namespace_state, h.namespace_note, h.remote_drafting = "mismatch", why, False
        log.error("corpus %s: %s. Remote drafting is OFF for the rest of this run (the in-process corpus "
                  "drafts; /healthz corpus.namespace_check says mismatch)", self.target, why)
        self._ask, self._ahead, self._inflight = None, None, None
        if self.source is not None:
            self.source.close(flush=False)

    def _remote_call(self, call: Call) -> None:
        """Queues a request operation for the remote corpus: pipelined, held for dispatch() (one
        hand-off per step, ordered before the draft request); sync, handed over now."""
        if not self.remote:
            return
        self.source.held.append(call)
        if not self.pipelined:
            self.source.send()

    def _take_notes(self) -> None:
        for note in self.source.take_notes():
            if note == REACHABLE_NOTE:
                self.health.success()
            else:
                self._note_error(note)

    def _note_error(self, note: Note, asked_at: float | None = None) -> None:
        """A failed call, counted; logged once per outage (or per kind of refusal) by the health."""
        self.stats.remote_errors += 1
        self.stats.last_error = note.text
        self.health.failure(note, asked_at)

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
        self._ahead = (self.source.draft(ids, deep, budget), ids, lengths)
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
        wait_s = self.source.await_s if timeout_s is None else timeout_s
        if not wait_s:
            return True  # done() above was the read
        return not handle.wait(wait_s)

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
            return self.mirror.draft(req_ids, budget, budget).batch
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
            if self.source.dead:  # until a new child runs
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

    def _answer(self, handle: Pending, budget: int) -> DraftBatch | None:
        """A finished remote draft's trees, or None after an error (counted)."""
        self._take_notes()
        if handle.error is not None:
            self._note_error(handle.error, handle.asked_at)
            return None
        if handle.capped:
            self._cap_ahead(budget)
        batch = handle.batch
        if batch is not None:
            self.health.success(handle.asked_at)
        return batch

    def _remote_draft(self, req_ids: list[str], budget: int) -> DraftBatch | None:
        """Sync: the remote trees, waited for up to ``draft_timeout_s``; None when they are not
        back (the call goes on in the background: until it returns, no step waits on the corpus),
        or failed."""
        if self._inflight is not None:
            if not self._inflight.done():
                return None  # an earlier call is still stuck on a slow/unreachable corpus
            late, self._inflight = self._inflight, None
            self._answer(late, budget)  # its failure or success tells the health; its trees are stale
        ticket = self.source.draft(list(req_ids), budget, budget)
        if not ticket.wait(self.draft_timeout_s):
            self._inflight = ticket
            return None
        batch = self._answer(ticket, budget)
        return batch if batch is not None and len(batch) == len(req_ids) else None
