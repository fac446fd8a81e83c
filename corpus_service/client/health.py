"""What a client of the corpus service (a verifier, an engine plugin) knows of it: whether it is reachable (outages, each said once when
it starts and once when it ends), whether its namespace serves this verifier's model, and whether
remote drafting is on. The verifier's ``/healthz`` and ``/metrics`` show it; the engine plugins
(``corpus_service.integrations``) log and count it the same way.

The namespace check (``check_namespace``): the namespace must exist on the corpus, and where the
namespace declares them, its vocabulary size must be the model's and its tokenizer must encode
``ngram_common.tokenizer.PROBE_TEXT`` to the ids the model's tokenizer gives. Token ids of two
tokenizers must never mix: drafts from the wrong namespace verify nothing, and this verifier's
commits would spoil that namespace for every other replica.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ngram_common.tokenizer import PROBE_TEXT

log = logging.getLogger("verifier.corpus")

# The gRPC status codes (their names, as a Note carries them) that mean the corpus cannot be reached
# now, as opposed to a call it refused: the circuit breaker, a refused connection, a deadline, a dead
# client process (the client raises CorpusUnavailable / CorpusDeadlineExceeded for these).
UNREACHABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
# An outage that begins within QUIET_S of the last one's end is logged only once it has lasted
# CONFIRM_S (seen at a later failed call): a corpus that flaps would otherwise log two lines per flap.
# Brief ones are counted, and the next line logged says how many there were.
QUIET_S = 5.0
CONFIRM_S = 1.0
# A refused call (not an outage) is logged the first time its kind is seen, then at most this often
# with the number seen meanwhile.
REPEAT_LOG_S = 300.0
_DIGITS = re.compile(r"\d+(\.\d+)?")


class Note(NamedTuple):
    """A failed corpus call (or the end of an outage), as the health takes it: ``code`` is the gRPC
    status code's name (``UNAVAILABLE``; "" for an error of no call: a bug, a bad setting),
    ``text`` says it as ``Type: message``."""

    code: str
    text: str


REACHABLE_NOTE = Note("OK", "(the corpus answers again)")  # the note that ends an outage


def note_of(e: BaseException) -> Note:
    """A caught exception as a note: a ``CorpusError`` carries its gRPC status code."""
    code = getattr(e, "code", None)
    return Note(code.name if hasattr(code, "name") else "", f"{type(e).__name__}: {e}")


class NamespaceMismatch(ValueError):
    """The namespace is missing on the corpus or serves another model's token ids."""


@dataclass(frozen=True)
class ModelIds:
    """What a namespace must match: the model's vocabulary size and its tokenizer's ids of
    ``PROBE_TEXT`` (without special tokens)."""

    vocab_size: int
    probe: tuple[int, ...]


def model_ids(codec, vocab_size: int) -> ModelIds:
    return ModelIds(int(vocab_size), tuple(codec.encode(PROBE_TEXT)))


def _fits(info: dict, model: ModelIds) -> str:
    """Why the namespace described by ``info`` does not serve ``model`` ('' if it does)."""
    vocab = int(info.get("vocab_size") or 0)
    if vocab and vocab != model.vocab_size:
        return f"its vocabulary has {vocab} ids, the model's {model.vocab_size}"
    probe = tuple(info.get("tokenizer_probe") or ())
    if probe and probe != model.probe:
        return (f"its tokenizer ({info.get('tokenizer') or '?'}) encodes the probe text to other ids than the "
                f"model's ({list(probe[:6])}... vs {list(model.probe[:6])}...)")
    return ""


def namespace_verdict(target: str, namespace: str, served: dict[str, dict], model: ModelIds) -> str:
    """What was checked (one line) when ``namespace`` of ``served`` (``CorpusClient.describe_namespaces``)
    serves ``model``; raises NamespaceMismatch, naming the namespaces served, when it does not."""

    def listing() -> str:
        names = [f"{n} (matches this model)" if not _fits(i, model) and (i.get("vocab_size") or i.get("tokenizer_probe"))
                 else n for n, i in served.items()]
        return ", ".join(names) or "none this client may read"

    info = served.get(namespace)
    if info is None:
        raise NamespaceMismatch(f"corpus_namespace: the corpus at {target} has no namespace {namespace!r} "
                                f"(it serves: {listing()}); set --corpus-namespace")
    why = _fits(info, model)
    if why:
        raise NamespaceMismatch(f"corpus_namespace: namespace {namespace!r} of the corpus at {target} does not serve "
                                f"this model: {why} (it serves: {listing()}); set --corpus-namespace")
    checked = []
    if info.get("vocab_size"):
        checked.append(f"vocabulary {info['vocab_size']}")
    if info.get("tokenizer_probe"):
        checked.append(f"tokenizer {info.get('tokenizer') or '?'}")
    if info.get("tokenizer_error"):
        checked.append(f"tokenizer not checked: the corpus cannot load it ({info['tokenizer_error']})")
    if not checked:
        checked.append("it declares no vocabulary or tokenizer: token ids not checked")
    return f"namespace {namespace!r} serves this model ({'; '.join(checked)})"


def check_namespace(target: str, namespace: str, model: ModelIds, *, token: str | None = None,
                    tls: str | None = None, timeout_s: float = 30.0) -> str:
    """Asks the corpus for its namespaces (one Stats call; a short-lived client) and judges
    ``namespace`` (``namespace_verdict``). Raises CorpusUnavailable / CorpusDeadlineExceeded when the
    corpus cannot be reached, another ``CorpusError`` when it refuses (a token it does not know...).
    The timeout leaves room for a corpus loading its tokenizer on the first call (seconds for a GGUF);
    a corpus that is down answers at once (a refused connection, two quick retries)."""
    from corpus_service.client.sync import CorpusClient

    with CorpusClient(target, namespace, timeout=timeout_s, token=token, tls=tls) as client:
        served = client.describe_namespaces(timeout=timeout_s)
    return namespace_verdict(target, namespace, served, model)


def unreachable(note: Note) -> bool:
    """Whether a failed call means the corpus cannot be reached (by its status code, not its text)."""
    return note.code in UNREACHABLE_CODES


class CorpusHealth:
    """Outages and the namespace's state, fed by the drafter (engine thread) and its client thread."""

    def __init__(self, target: str, namespace: str) -> None:
        self.target, self.namespace = target, namespace
        self._lock = threading.Lock()
        self.outages = 0  # outages begun (each: first failure to first success)
        self.recoveries = 0  # outages ended (the drafter checks the namespace again after each)
        self.outage_seconds = 0.0  # ended outages' time
        self._since: float | None = None  # the current outage's start
        self._failed = 0  # failed calls in the current outage
        self._logged = False  # the current outage's start was logged (so its end is)
        self._ended = -QUIET_S  # when the last outage ended
        self._unlogged = 0  # outages not logged since the last one that was
        self._kinds: dict[str, tuple[float, int]] = {}  # refused-call kind -> (last logged, seen since)
        self.last_error = ""
        self.namespace_state = "unchecked"  # "unchecked" | "ok" | "mismatch"
        self.namespace_note = ""  # the check's verdict or mismatch
        self.remote_drafting = False  # the drafter's own: held until checked, off after a mismatch

    @property
    def unreachable(self) -> bool:
        return self._since is not None

    def failure(self, note: Note, asked_at: float | None = None) -> None:
        """A failed call: an outage begins if its code is one of UNREACHABLE_CODES (unless the call
        was asked, ``asked_at``, before the last outage ended: its failure is that outage's), else a
        refused call is logged once per kind (its code and text, numbers aside; REPEAT_LOG_S)."""
        if not isinstance(note, Note):
            raise TypeError(f"failure: expected a Note (code, text), got {type(note).__name__}")
        now = time.monotonic()
        error = note.text
        with self._lock:
            self.last_error = error
            if unreachable(note):
                if self._since is None:
                    if asked_at is not None and asked_at < self._ended:
                        return
                    self._begin(now, error)
                elif not self._logged and now - self._since >= CONFIRM_S:
                    self._say_begun(now, error)
                self._failed += 1
                return
            kind = note.code + " " + _DIGITS.sub("N", error)[:160]
            last, seen = self._kinds.get(kind, (-REPEAT_LOG_S, 0))
            if now - last < REPEAT_LOG_S:
                self._kinds[kind] = (last, seen + 1)
                return
            self._kinds[kind] = (now, 0)
        more = f" ({seen} more like it in the last {REPEAT_LOG_S:.0f} s)" if seen else ""
        log.warning("corpus %s: a call failed: %s%s; drafting in process for it", self.target, error, more)

    def success(self, asked_at: float | None = None) -> None:
        """A call answered: ends the current outage, unless it was asked (``asked_at``, monotonic)
        before the outage began (an answer that was on its way proves nothing)."""
        if self._since is None:  # the common case, no lock
            return
        with self._lock:
            if self._since is None or (asked_at is not None and asked_at < self._since):
                return
            took = time.monotonic() - self._since
            self.outage_seconds += took
            logged, failed = self._logged, self._failed
            self._since, self._failed = None, 0
            self._ended = time.monotonic()
            self.recoveries += 1
        if logged:
            log.warning("corpus %s is reachable again after %.1f s unreachable (failed calls meanwhile: %d)",
                        self.target, took, failed)

    def _begin(self, now: float, error: str) -> None:
        self.outages += 1
        self._since, self._failed, self._logged = now, 0, False
        if now - self._ended >= QUIET_S:
            self._say_begun(now, error)
        else:
            self._unlogged += 1

    def _say_begun(self, now: float, error: str) -> None:
        notes = []
        if now - self._since >= CONFIRM_S:  # a quick relapse, confirmed
            self._unlogged -= 1  # (counted as brief when it began)
            notes.append(f"for {now - self._since:.1f} s, {self._since - self._ended:.1f} s after the last outage")
        if self._unlogged:
            notes.append(f"{self._unlogged} brief outages since the last report")
        self._logged, self._unlogged = True, 0
        log.warning("corpus %s is unreachable: %s; drafting in process until it is back (said once per outage)%s",
                    self.target, error, f" ({'; '.join(notes)})" if notes else "")

    def snapshot(self) -> dict:
        """The ``corpus`` field of /healthz."""
        with self._lock:
            since = self._since
            now = time.monotonic()
            return {"target": self.target, "namespace": self.namespace,
                    "state": "unreachable" if since is not None else "reachable",
                    "unreachable_for_s": round(now - since, 3) if since is not None else 0.0,
                    "outages": self.outages,
                    "outage_seconds": round(self.outage_seconds + (now - since if since is not None else 0.0), 3),
                    "namespace_check": self.namespace_state, "namespace_note": self.namespace_note,
                    "remote_drafting": self.remote_drafting, "last_error": self.last_error}

    def total_outage_seconds(self) -> float:
        with self._lock:
            return self.outage_seconds + (time.monotonic() - self._since if self._since is not None else 0.0)


class BackgroundCheck:
    """The namespace check on a thread (a Stats call; seconds where the corpus loads a tokenizer):
    ``note`` once it passed, ``mismatch`` once it found one, ``done`` either way. ``retry_s`` > 0:
    a corpus that cannot be reached (or refuses) is asked again after that long; 0: one try."""

    def __init__(self, check: Callable[[], str], retry_s: float) -> None:
        self.note = self.mismatch = ""
        self.done = False
        self.asked_at = 0.0  # when the last try was asked (time.monotonic())
        self._abandoned = threading.Event()
        threading.Thread(target=self._run, args=(check, retry_s), name="corpus-namespace-check", daemon=True).start()

    def _run(self, check: Callable[[], str], retry_s: float) -> None:
        while not self._abandoned.is_set():
            try:
                self.asked_at = time.monotonic()
                self.note = check()
                break
            except NamespaceMismatch as e:
                self.mismatch = str(e)
                break
            except Exception as e:  # the corpus is down or refuses: the outage is the health's to report
                log.debug("namespace check: %s: %s", type(e).__name__, e)
                if not retry_s or self._abandoned.wait(retry_s):
                    break
        self.done = True

    def abandon(self) -> None:
        self._abandoned.set()
