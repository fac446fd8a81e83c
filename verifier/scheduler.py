"""Continuous batching: requests wait in FIFO order and join the running batch between steps
while a KV-cache slot is free; finished requests leave and free their slot at once."""

from __future__ import annotations

from collections import deque

from .request import Request, Status


class Scheduler:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Moves waiting requests into free slots; returns the newly admitted ones (to prefill)."""
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
