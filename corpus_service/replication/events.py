"""The commit log's message format: one message carries a batch of events from one replica.

    JSON header line  {"v": 1, "origin": REPLICA, "t": UNIX_NS, "ev": [EVENT, ...]}  b"\n"
    int32 tokens      the tokens of the chunk events, concatenated in event order (little-endian)

Events: ``["c", NS, N]`` a learned-corpus chunk of the next N tokens; ``["h", NS, KEY, VERSION, OUTPUT,
N]`` a finished request's rollout for prompt KEY's history, sampled by policy VERSION: the next N tokens,
its prompt's tail and then OUTPUT generated tokens; ``["x", NS, NAME, KEY, FORMAT, BYTES]`` an uploaded
external corpus whose data is blob KEY; ``["r", NS, NAME]`` a removed external corpus; ``["z", NS]`` a
reset of the namespace's learned corpus; ``["v", NS, V]`` the namespace's policy version announced as
V; ``["a", NS, N, W]`` what a replica's rank model observed (csrc/rank_model.h ``export_delta``): the next N
int32 words, W (``RANK_DELTA_WORDS``) per labelled draft node; ``["a", NS, N]``, written before 2026-12-03,
carries ``RANK_DELTA_WORDS_V1`` words per node (the older layout; it still applies). The header is JSON so a message stays readable with ``nats stream view``; the tokens are raw so a
batch costs one copy. Readers older than "h", "v" and "a" refuse such messages (a version skew is loud).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

VERSION = 1
CHUNK, EXTERNAL, REMOVE, RESET, ROLLOUT, POLICY, RANK = "c", "x", "r", "z", "h", "v", "a"
_KINDS = (CHUNK, EXTERNAL, REMOVE, RESET, ROLLOUT, POLICY, RANK)


def carried(ev: list) -> int | None:
    """How many of the message's tokens an event carries (None: it carries none)."""
    return int(ev[2]) if ev[0] in (CHUNK, RANK) else int(ev[5]) if ev[0] == ROLLOUT else None


@dataclass(slots=True)
class Batch:
    origin: str
    t_ns: int = 0  # when the batch was published (commit-to-visible lag)
    events: list[list] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)  # one per chunk, rollout or rank event, in order

    def num_tokens(self) -> int:
        return sum(t.size for t in self.tokens)

    def encode(self) -> bytes:
        header = {"v": VERSION, "origin": self.origin, "t": self.t_ns or time.time_ns(), "ev": self.events}
        body = np.concatenate(self.tokens).astype("<i4", copy=False) if self.tokens else np.zeros(0, "<i4")
        return json.dumps(header, separators=(",", ":")).encode() + b"\n" + body.tobytes()


def decode(payload: bytes) -> Batch:
    """Parses a message; ValueError says what is wrong (a foreign or corrupt message)."""
    head, sep, body = payload.partition(b"\n")
    if not sep:
        raise ValueError("log message: no header line")
    try:
        header = json.loads(head)
    except json.JSONDecodeError as e:
        raise ValueError(f"log message: header is not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise ValueError(f"log message: expected format version {VERSION}, got {header.get('v') if isinstance(header, dict) else header!r}")
    if len(body) % 4:
        raise ValueError(f"log message: {len(body)} token bytes is not a multiple of 4")
    flat = np.frombuffer(body, dtype="<i4")
    batch = Batch(str(header.get("origin", "")), int(header.get("t", 0)), list(header.get("ev", [])))
    pos = 0
    for ev in batch.events:
        if not isinstance(ev, list) or not ev or ev[0] not in _KINDS:
            raise ValueError(f"log message: unknown event {ev!r:.80}")
        if ev[0] == ROLLOUT and (len(ev) != 6 or not isinstance(ev[2], str) or not all(isinstance(x, int) for x in ev[3:])):
            raise ValueError(f"log message: malformed rollout event {ev!r:.80}")
        if ev[0] == RANK and (len(ev) not in (3, 4) or not all(isinstance(x, int) for x in ev[2:])):
            raise ValueError(f"log message: malformed rank model event {ev!r:.80}")
        if ev[0] == POLICY and (len(ev) != 3 or not isinstance(ev[2], int) or ev[2] < 0):
            raise ValueError(f"log message: malformed policy version event {ev!r:.80}")
        n = carried(ev)
        if n is not None:
            if n < 0 or pos + n > flat.size:
                raise ValueError(f"log message: an event of {n} tokens overruns the {flat.size} tokens carried")
            batch.tokens.append(flat[pos:pos + n])
            pos += n
    if pos != flat.size:
        raise ValueError(f"log message: {flat.size - pos} tokens carried but not claimed by an event")
    return batch
