"""Where a replica starts following the stream: which snapshot to load (if any) and from which
position to apply. Pure logic (``plan``), so every case is a unit test; ``Replica`` carries it out.

The rules, in order:
1. The replica's own state belongs to this incarnation and the log reaches back to it: keep it.
2. A snapshot of this incarnation the log reaches back to: load the newest (older ones if it fails).
3. The incarnation starts from a base snapshot (a recreated stream) and the log still holds its
   first message: load the base (or keep the state, if it is the base) and apply from message 1.
4. Otherwise messages are lost (a retention gap): load the newest snapshot of this incarnation
   anyway, or start empty when the state is another incarnation's, and apply from the oldest
   message the log holds; the gap is reported.
Every replica that follows these rules with the same stream and blob store reaches the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from corpus_service.replication.snapshots import SnapshotRecord
from corpus_service.replication.stream import StreamView


@dataclass(slots=True)
class Plan:
    candidates: list[tuple[SnapshotRecord, int]] = field(default_factory=list)  # (snapshot, position after it), in order
    keep: bool = False  # the current state stays (no load)
    position: int = 0  # where to apply from without a load (keep, or none of the candidates loads)
    reset: bool = False  # without a load: start empty (the state is another incarnation's)
    gap: str = ""  # messages lost, for the log and the status


def _same(incarnation: str, other: str) -> bool:
    return incarnation == other or "" in (incarnation, other)  # "": written before incarnations


def plan(view: StreamView, records: list[SnapshotRecord], current: tuple[str, int] | None,
         base: SnapshotRecord | None) -> Plan:
    """``current``: the (incarnation, position) of the state this replica holds, None if it holds
    none; ``base``: the record of ``view.base`` (None if there is none or it cannot be read)."""
    first, last = view.first, view.last
    reaches = lambda seq: seq + 1 >= first and seq <= last  # noqa: E731 - the log holds everything after seq
    if current is not None and _same(current[0], view.incarnation) and reaches(current[1]):
        return Plan(keep=True, position=current[1])
    mine = sorted((r for r in records if _same(r.incarnation, view.incarnation) and r.seq <= last),
                  key=lambda r: r.seq, reverse=True)
    usable = [r for r in mine if reaches(r.seq)]
    lost_from = 1 if not mine else mine[0].seq + 1
    if usable:
        gap = "" if usable[0] is mine[0] else (
            f"retention gap: the newest snapshot covers seq {mine[0].seq} but the log starts at seq {first}; "
            f"loading the newer snapshot at seq {usable[0].seq}")
        return Plan(candidates=[(r, r.seq) for r in usable], position=max(0, first - 1),
                    reset=current is not None, gap=gap)
    if base is not None and first <= 1:
        if current is not None and (current[0], current[1]) == (base.incarnation, base.seq):
            return Plan(keep=True, position=0)
        return Plan(candidates=[(base, 0)], position=0, reset=current is not None)
    gap = ""
    if first > 1:
        gap = (f"retention gap: the newest snapshot covers seq {mine[0].seq} but the log starts at seq {first}; "
               f"no newer snapshot: messages {lost_from}..{first - 1} are lost") if mine else (
               f"retention gap: no snapshot and the log starts at seq {first}: messages 1..{first - 1} are lost")
    return Plan(candidates=[(r, first - 1) for r in mine[:1]], position=max(0, first - 1),
                reset=current is not None, gap=gap)
