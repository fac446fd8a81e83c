"""What the server keeps for BatchGet callers, bounded and reclaimed.

SGLang's stateful match keeps one engine request per (client id, request id): BatchGet creates it
from the window and EraseMatchState ends it, but a caller that never erases (or a hostile one that
sends fresh client ids) would otherwise leave every request live. Here each client id holds at most
``max_batch_get_requests_per_client`` request ids, at most ``max_batch_get_clients`` client ids hold
state at once, every request is charged to the server-wide live-request budget (live_budget.py),
and a request id not seen for ``batch_get_idle_s`` is erased (a client whose requests all expired
is forgotten). An expired request costs its caller nothing but context: the next BatchGet for it
starts again from the window it sends.

All methods run on the event loop. A call reserves its estimated growth before the engine runs and
settles when the engine call is done (even when the RPC was cancelled meanwhile), recording what
each id holds by the engine's own rule (``Corpus::sync_window``) against the records as they are
then; ``users`` counts the calls in flight, so a record in use is never forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import numpy as np

from corpus_service.protocol.status import CorpusError
from corpus_service.server.live_budget import REQUEST_CHARGE_BYTES, LiveBudget


@dataclass(slots=True)
class Held:
    """One request id of a client: tokens its engine state holds, the caller's total length, when last used."""

    tokens: int
    total: int
    last_used: float


@dataclass(slots=True)
class BatchClient:
    namespace: str
    prefix: str  # the engine's request-id prefix of this client
    requests: OrderedDict = field(default_factory=OrderedDict)  # req id -> Held, least recently used first
    charged: int = 0  # bytes this client holds in the live-request budget (the records' sum)
    users: int = 0  # calls in flight


@dataclass(slots=True)
class Admission:
    """A BatchGet admitted: its ids, windows and total lengths, the bytes reserved for it."""

    client: BatchClient
    ids: list[str]
    lens: list[int]
    total_lens: list[int]
    new: list[str]  # ids the client did not hold when admitted
    reserved: int


def held_after(held: Held | None, window: int, total: int, max_request_tokens: int) -> int:
    """Tokens a request holds after a BatchGet with this window (the engine's rule; when the tokens
    disagree the engine starts over from the window, so this is an upper bound)."""
    if held is None:
        return window
    fresh = total - held.total
    if 0 <= fresh <= window:
        return window if held.tokens + fresh > max_request_tokens else held.tokens + fresh
    return window  # rewound: start over from the window


class BatchClients:
    def __init__(self, budget: LiveBudget, max_clients: int, max_requests_per_client: int, idle_s: float) -> None:
        self.budget = budget
        self.max_clients = max_clients
        self.max_requests_per_client = max_requests_per_client
        self.idle_s = idle_s
        self._clients: OrderedDict[tuple[str, str], BatchClient] = OrderedDict()
        self.num_requests = 0
        self.expired_requests = 0  # erased after batch_get_idle_s without a call
        self.refused = {"clients": 0, "requests_per_client": 0}

    def __len__(self) -> int:
        return len(self._clients)

    def client(self, namespace: str, prefix: str) -> BatchClient:
        """The client's record, created if there is room (RESOURCE_EXHAUSTED otherwise); the caller
        counts itself in ``users`` and calls ``done`` when it is finished with it."""
        key = (namespace, prefix)
        c = self._clients.get(key)
        if c is not None:
            self._clients.move_to_end(key)
            c.users += 1
            return c
        if len(self._clients) >= self.max_clients:
            self.refused["clients"] += 1
            raise CorpusError(f"BatchGet: {len(self._clients)} client ids already hold request state on this server "
                              f"(max_batch_get_clients = {self.max_clients}); reuse a client id, erase finished "
                              f"requests (EraseMatchState), or wait for idle ones to expire after "
                              f"{self.idle_s:g} s", grpc.StatusCode.RESOURCE_EXHAUSTED)
        c = self._clients[key] = BatchClient(namespace, prefix, users=1)
        return c

    def done(self, client: BatchClient) -> None:
        """A call is finished with the client's record; a record left without requests is dropped."""
        client.users -= 1
        if not client.requests and client.users == 0:
            self._clients.pop((client.namespace, client.prefix), None)
            self._release(client, client.charged)

    def find(self, namespace: str, prefix: str) -> BatchClient | None:
        return self._clients.get((namespace, prefix))

    def admit(self, client: BatchClient, ids: list[str], lens: np.ndarray, total_lens: np.ndarray,
              token_bytes: int, max_request_tokens: int) -> Admission:
        """Checks the per-client limit and reserves the call's growth in the budget; on refusal
        nothing is reserved (and the caller calls ``done``)."""
        reqs = client.requests
        held = [reqs.get(r) for r in ids]
        new = [r for r, h in zip(ids, held) if h is None]
        if new and len(reqs) + len(new) > self.max_requests_per_client:
            self.refused["requests_per_client"] += 1
            raise CorpusError(f"BatchGet: client id would hold {len(reqs) + len(new)} request ids, more than "
                              f"max_batch_get_requests_per_client = {self.max_requests_per_client}; erase finished "
                              f"requests (EraseMatchState) or wait for idle ones to expire after {self.idle_s:g} s",
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
        lens_l, totals = lens.tolist(), total_lens.tolist()
        grow = sum(held_after(h, n, t, max_request_tokens) - (h.tokens if h else 0)
                   for h, n, t in zip(held, lens_l, totals))
        reserved = max(0, grow * token_bytes + len(new) * REQUEST_CHARGE_BYTES)  # a shrink is released at settle
        self.budget.reserve(reserved, "BatchGet")
        return Admission(client, ids, lens_l, totals, new, reserved)

    def settle(self, adm: Admission, applied: bool, token_bytes: int, max_request_tokens: int) -> list[str]:
        """The engine call is done: records what each id holds now (``applied``), or gives the
        reservation back. Returns the engine ids of a failed call to erase (its new ids, which the
        engine may have created before it failed)."""
        c = adm.client
        erase: list[str] = []
        if applied:
            now, reqs, delta = time.monotonic(), c.requests, 0
            for rid, n, total in zip(adm.ids, adm.lens, adm.total_lens):
                h = reqs.get(rid)
                tokens = held_after(h, n, total, max_request_tokens)
                if h is None:
                    reqs[rid] = Held(tokens, total, now)
                    self.num_requests += 1
                    delta += tokens * token_bytes + REQUEST_CHARGE_BYTES
                else:
                    delta += (tokens - h.tokens) * token_bytes
                    h.tokens, h.total, h.last_used = tokens, total, now
                    reqs.move_to_end(rid)
            c.charged += delta
            # The estimate and the outcome differ only when calls of one client overlapped.
            if delta > adm.reserved:
                self.budget.charge_applied(delta - adm.reserved)
            else:
                self.budget.release(adm.reserved - delta)
        else:
            self.budget.release(adm.reserved)
            erase = [c.prefix + r for r in adm.new if r not in c.requests]
        self.done(c)
        return erase

    def erase(self, client: BatchClient, ids: list[str], token_bytes: int) -> None:
        """EraseMatchState: the ids end (unknown ones are ignored, as the engine ignores them)."""
        freed = 0
        for rid in ids:
            h = client.requests.pop(rid, None)
            if h is not None:
                freed += h.tokens * token_bytes + REQUEST_CHARGE_BYTES
                self.num_requests -= 1
        self._release(client, freed)

    def _release(self, client: BatchClient, nbytes: int) -> None:
        nbytes = min(nbytes, client.charged)
        client.charged -= nbytes
        self.budget.release(nbytes)

    def expire(self, token_bytes: dict[str, int], now: float | None = None) -> list[tuple[str, list[str]]]:
        """Forgets request ids idle for ``idle_s`` and clients left with none; returns the engine ids
        to erase, per namespace. Clients with a call in flight are left for the next sweep."""
        now = time.monotonic() if now is None else now
        cutoff = now - self.idle_s
        out: dict[str, list[str]] = {}
        for key, c in list(self._clients.items()):
            if c.users:
                continue
            reqs, gone, freed = c.requests, [], 0
            tb = token_bytes[c.namespace]
            while reqs:
                rid, h = next(iter(reqs.items()))
                if h.last_used > cutoff:
                    break
                reqs.popitem(last=False)
                gone.append(c.prefix + rid)
                freed += h.tokens * tb + REQUEST_CHARGE_BYTES
            if gone:
                self.num_requests -= len(gone)
                self.expired_requests += len(gone)
                out.setdefault(c.namespace, []).extend(gone)
                self._release(c, freed)
            if not reqs:
                self._clients.pop(key, None)
                self._release(c, c.charged)
        return list(out.items())

    def drop_namespace(self, namespace: str) -> None:
        """The namespace was reset: the engine holds none of its requests any more."""
        for key, c in list(self._clients.items()):
            if c.namespace == namespace:
                self.num_requests -= len(c.requests)
                c.requests.clear()
                self._release(c, c.charged)
                if not c.users:
                    del self._clients[key]

    def largest_client(self) -> int:
        """Request ids held by the client id holding the most."""
        return max((len(c.requests) for c in self._clients.values()), default=0)

    def stats(self) -> dict[str, int]:
        return {"clients": len(self._clients), "requests": self.num_requests, "expired_requests": self.expired_requests,
                "max_clients": self.max_clients, "max_requests_per_client": self.max_requests_per_client}
