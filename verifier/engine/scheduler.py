"""Continuous batching: requests wait in FIFO order and join the running batch between steps
while a KV-cache slot is free; finished requests leave and free their slot at once.

Refills come in groups: while a batch runs, waiting requests join once ``refill_group`` slots are
free (or all of them fit), or after ``MAX_REFILL_WAIT_STEPS`` steps of holding back. A prefill is a
forward of its own, and on a small model its cost barely depends on how many prompts it takes
(SmolLM2 on the H200: 1.2 ms for one short prompt, 2-3 ms for 18), while a slot left empty for a
step or two costs that request a step's tokens. Speculative decoding makes requests finish one by
one (their acceptance differs), so refilling each alone made batch 64 pay a prefill forward in
nearly every other step."""

from __future__ import annotations

from collections import deque

from .request import Request, Status


MAX_REFILL_WAIT_STEPS = 4  # the longest a waiting request is held back while a slot is free


class Scheduler:
    def __init__(self, num_slots: int, refill_group: int = 1, longest_first: bool = False) -> None:
        """``longest_first``: waiting requests are admitted by ``expected_len``, longest first (those
        without one after, in arrival order): verifier/budget/makespan.py."""
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        if not 1 <= refill_group <= num_slots:
            raise ValueError(f"refill_group: expected 1..{num_slots} (the slots), got {refill_group}")
        self.refill_group = refill_group
        self.longest_first = longest_first
        self._unsorted = False  # longest_first: requests arrived since the queue was last ordered
        self._held = 0  # consecutive admits that held waiting requests back
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._unsorted = self.longest_first

    def admit(self) -> list[Request]:
        """Moves waiting requests into free slots; returns the newly admitted ones (to prefill)."""
        if (self.waiting and self._free and self.running and self._held < MAX_REFILL_WAIT_STEPS
                and len(self._free) < min(len(self.waiting), self.refill_group)):
            self._held += 1
            return []
        self._held = 0
        if self._unsorted:  # stable: equal expectations (and none) keep their arrival order
            self.waiting = deque(sorted(self.waiting, key=lambda r: -r.expected_len if r.expected_len is not None
                                        else float("inf")))
            self._unsorted = False
        admitted = []
        while self.waiting and self._free:
            req = self.waiting.popleft()
            if req.finished:  # aborted while waiting
                continue
            req.slot, req.status = self._free.pop(), Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        if admitted:
            self.running.sort(key=lambda r: r.slot)  # consecutive slots let attention read views
        return admitted

    def release_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            for r in done:
                self._free.append(r.slot)
                r.slot = -1
            self._free.sort(reverse=True)
        return done

    def abort_waiting(self, req_id: str) -> Request | None:
        for r in self.waiting:
            if r.req_id == req_id:
                self.waiting.remove(r)
                return r
        return None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
