"""The messages between a verifier and its corpus client process (``verifier.draft.corpus_process``).

Each message is a small frozen dataclass. A frame is a header (body length, ``PROTOCOL_VERSION``,
kind) and a body: a draft's trees as raw arrays (``Trees``: pickling them cost ~50 us per step), any
other message pickled. Both ends are this package, but a frame is still checked on receipt: its
version must be this one (a child started from another install says so instead of misreading the
stream), unpickling builds only the classes listed here (``_Unpickler``), the message must be one
the receiving side expects, and its fields must have their types (``check``). Anything else is a
``ValueError`` naming what arrived.

Parent to child: ``Configure`` (first; the bearer token travels here, never on a command line),
``Calls`` (start_request / extend_many / finish, in order; their errors come back as ``Failure``
with no ticket), ``DraftAsk`` (``nodes`` > ``budget``: a pipelined deep tree, asked again at
``budget`` if the corpus refuses trees that large) and ``Close``. Child to parent: ``Ready``,
``Trees`` (a draft's answer), ``Failure`` (a draft's error, with its ticket, or a call's) and
``Reachable`` (the corpus answers again after an outage).
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass

import numpy as np

from corpus_service import DraftBatch
from corpus_service.client import REACHABLE_NOTE, Note, note_of  # noqa: F401 (the client process' messages carry them)

from .calls import CALL_TYPES, Extend, Finish, StartRequest

PROTOCOL_VERSION = 2  # 2: StartRequest carries prompt_key/policy_version, Finish rollout
_HEADER = struct.Struct("<IBB")  # body length, protocol version, kind
_PICKLED, _TREES = 0, 1  # kinds: a pickled message; a draft's trees as raw arrays
_TREES_HEAD = struct.Struct("<qiiB")  # ticket, rows, width, capped
MAX_FRAME_BYTES = 1 << 30


def _expect(ok: bool, msg: object, what: str) -> None:
    if not ok:
        raise ValueError(f"corpus client process: a {type(msg).__name__} message with {what}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """The child's ``AsyncCorpusClient``."""

    target: str
    namespace: str = "default"
    timeout_s: float = 1.0
    breaker_cooldown_s: float = 0.5
    token: str | None = None
    tls: str | None = None

    def check(self) -> None:
        _expect(isinstance(self.target, str) and isinstance(self.namespace, str), self, "a non-string target")
        _expect(all(isinstance(v, (int, float)) and v > 0 for v in (self.timeout_s, self.breaker_cooldown_s)), self,
                "a timeout that is not a number > 0")
        _expect(all(v is None or isinstance(v, str) for v in (self.token, self.tls)), self, "a bad token or tls")


# ---------------------------------------------------------------------- parent to child

@dataclass(frozen=True, slots=True)
class Configure:
    settings: ClientSettings

    def check(self) -> None:
        _expect(isinstance(self.settings, ClientSettings), self, "no ClientSettings")
        self.settings.check()


@dataclass(frozen=True, slots=True)
class Calls:
    calls: list

    def check(self) -> None:
        _expect(isinstance(self.calls, list), self, "calls that are not a list")
        for c in self.calls:
            _expect(type(c) in CALL_TYPES, self, f"a call of type {type(c).__name__}")
            if type(c) is Extend:
                _expect(isinstance(c.items, list) and all(isinstance(r, str) and isinstance(t, list)
                                                          for r, t in c.items), self, "bad extend items")
            else:
                _expect(isinstance(c.req_id, str), self, "a request id that is not a string")
                if type(c) is StartRequest:
                    _expect(isinstance(c.prompt, list) and (c.group is None or isinstance(c.group, str)),
                            self, "a bad prompt or group")
                    _expect((c.prompt_key is None or isinstance(c.prompt_key, str))
                            and (c.policy_version is None or _is_int(c.policy_version)),
                            self, "a bad prompt_key or policy_version")
                else:
                    _expect(isinstance(c.rollout, bool), self, "a rollout flag that is not a bool")


@dataclass(frozen=True, slots=True)
class DraftAsk:
    ticket: int
    req_ids: list
    nodes: int
    budget: int

    def check(self) -> None:
        _expect(_is_int(self.ticket) and _is_int(self.nodes) and _is_int(self.budget), self, "a non-int field")
        _expect(1 <= self.budget <= self.nodes, self, f"budget {self.budget} and nodes {self.nodes}")
        _expect(isinstance(self.req_ids, list) and all(isinstance(r, str) for r in self.req_ids), self,
                "request ids that are not strings")


@dataclass(frozen=True, slots=True)
class Close:
    def check(self) -> None:
        pass


# ---------------------------------------------------------------------- child to parent

@dataclass(frozen=True, slots=True)
class Ready:
    def check(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Failure:
    """A draft's error (``ticket``) or a call's (``ticket`` None)."""

    ticket: int | None
    note: Note

    def check(self) -> None:
        _expect(self.ticket is None or _is_int(self.ticket), self, "a non-int ticket")
        _expect(isinstance(self.note, Note) and isinstance(self.note.code, str) and isinstance(self.note.text, str),
                self, "no Note")


@dataclass(frozen=True, slots=True)
class Reachable:
    def check(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Trees:
    """A draft's answer: ``capped``, the corpus refused the deep tree and these have ``budget`` nodes."""

    ticket: int
    batch: DraftBatch
    capped: bool

    def check(self) -> None:
        pass  # built by decode() from a frame whose size it checked


TO_CHILD = (Configure, Calls, DraftAsk, Close)
TO_PARENT = (Ready, Trees, Failure, Reachable)
# What unpickling may build: the messages, their fields' classes, and nothing else.
_ALLOWED = {(c.__module__, c.__name__) for c in (*TO_CHILD, *TO_PARENT, ClientSettings, Note, StartRequest,
                                                  Extend, Finish)}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise ValueError(f"corpus client process: unknown message class {module}.{name}")
        return super().find_class(module, name)


def encode(msg) -> bytes:
    """A frame of ``msg`` (``Trees``: raw arrays; any other message: pickled)."""
    if type(msg) is Trees:
        b = msg.batch
        n, W = b.tokens.shape
        parts = [_TREES_HEAD.pack(msg.ticket, n, W, msg.capped), np.ascontiguousarray(b.tokens, np.int32).tobytes(),
                 np.ascontiguousarray(b.parents, np.int32).tobytes(),
                 np.ascontiguousarray(b.probs, np.float32).tobytes(), np.ascontiguousarray(b.counts, np.int32).tobytes()]
        return _HEADER.pack(sum(map(len, parts)), PROTOCOL_VERSION, _TREES) + b"".join(parts)
    if type(msg) not in TO_CHILD + TO_PARENT:
        raise ValueError(f"corpus client process: cannot send a {type(msg).__name__}: not a message")
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body), PROTOCOL_VERSION, _PICKLED) + body


def _decode(kind: int, body: bytearray):
    if kind == _PICKLED:
        try:
            return _Unpickler(io.BytesIO(body)).load()
        except ValueError:
            raise
        except Exception as e:  # a truncated or garbled body
            raise ValueError(f"corpus client process: a message that does not unpickle: {type(e).__name__}: {e}") from None
    if kind != _TREES:
        raise ValueError(f"corpus client process: unknown frame kind {kind}")
    if len(body) < _TREES_HEAD.size:
        raise ValueError(f"corpus client process: a trees frame of {len(body)} bytes, shorter than its header")
    ticket, n, W, capped = _TREES_HEAD.unpack_from(body)
    o, cells = _TREES_HEAD.size, n * W
    if n < 0 or W < 0 or len(body) != o + 4 * (3 * cells + n):
        raise ValueError(f"corpus client process: a trees frame of {len(body)} bytes for {n} x {W}")
    # One array over the body, then views (a numpy call per array cost several us per step).
    # Writable: the body is a bytearray of its own.
    ints = np.frombuffer(body, np.int32, 3 * cells + n, o)
    tokens, parents = ints[:cells].reshape(n, W), ints[cells:2 * cells].reshape(n, W)
    probs = ints[2 * cells:3 * cells].view(np.float32).reshape(n, W)
    return Trees(ticket, DraftBatch(tokens, parents, probs, ints[3 * cells:]), bool(capped))


class Frames:
    """Splits a byte stream into messages, each checked: ``expect``, the message types this side
    takes (``TO_CHILD`` or ``TO_PARENT``)."""

    def __init__(self, expect: tuple[type, ...]) -> None:
        self._buf = bytearray()
        self._expect = expect

    def feed(self, data: bytes) -> list:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            n, version, kind = _HEADER.unpack_from(self._buf)
            if version != PROTOCOL_VERSION:
                raise ValueError(f"corpus client process: a frame of protocol version {version}, expected "
                                 f"{PROTOCOL_VERSION} (the two ends run different installs)")
            if n > MAX_FRAME_BYTES:
                raise ValueError(f"corpus client process: a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
            if len(self._buf) < _HEADER.size + n:
                break
            msg = _decode(kind, self._buf[_HEADER.size:_HEADER.size + n])
            del self._buf[:_HEADER.size + n]
            if type(msg) not in self._expect:
                raise ValueError(f"corpus client process: unknown message {type(msg).__name__}: expected one of "
                                 f"{', '.join(t.__name__ for t in self._expect)}")
            msg.check()
            out.append(msg)
        return out
