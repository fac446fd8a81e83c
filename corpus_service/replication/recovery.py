"""A replica losing its stream: found when the log is idle or failing (``watch_stream``), and
recovered (``recover``): not ready until it follows the stream's new incarnation.

Gone (the broker says the stream does not exist: deleted, or lost with the broker's storage): the
replica writes a snapshot of what it applied (``recovery_base``), recreates the stream naming that
snapshot as the new incarnation's base, and follows it (``Replica._adopt``: the base, then message
1 on). Recreated by another replica: it follows the new incarnation the same way, loading the base
the stream names unless its own state is that base. Commits made meanwhile wait in the publisher's
buffer and are published into the new incarnation, so every replica applies them.
"""

from __future__ import annotations

import asyncio
import logging

from corpus_service.replication.stream import StreamView

log = logging.getLogger("corpus_service.replication")


async def watch_stream(r) -> bool:
    """Looks at the stream (the log is idle or failing): refreshes the lag, and recovers when the
    stream is gone or another incarnation. True if this replica's position changed."""
    try:
        view = await r.stream.view(r._js)
    except Exception:  # noqa: BLE001 - the broker is away: that says nothing about the stream
        return False
    if view is not None and view.incarnation == r.incarnation:
        r.stream_last = view.last
        r.pending = max(0, view.last - r.applied_seq)
        return False
    await recover(r, view)
    return True

async def recover(r, view: StreamView | None) -> None:
    """The stream is gone (``view`` None) or was recreated: not ready until this replica follows
    the new incarnation. Gone: snapshot what was applied, recreate the stream with it as the base."""
    r.stream_ok = False
    r.stream_losses += 1
    what = "is gone (deleted, or lost with the broker's storage)" if view is None else \
        f"was recreated (incarnation {view.incarnation}, base {view.base or 'none'})"
    log.error("commit log stream %s %s: this replica is not ready until it follows the new stream; commits "
              "are buffered meanwhile", r.stream_name, what)
    r._update_ready()
    while not r._stopping.is_set():
        try:
            if view is None:
                await r._attach_stores()  # recreated too when the broker lost its storage
                view = await r.stream.create(r._js, await recovery_base(r))
            await r._attach_stores()
            await r._adopt(view)
            break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the broker went away again, a race: look again
            log.warning("commit log recovery failed (%s: %s); retrying", type(e).__name__, e)
            await asyncio.sleep(0.5)
            try:
                view = await r.stream.view(r._js)
            except Exception:  # noqa: BLE001
                pass
    r.stream_ok = True
    log.warning("commit log stream %s followed again: incarnation %s from base %s; this replica is at seq %d "
                "of %d", r.stream_name, r.incarnation, r.base or "none", r.applied_seq, r.stream_last)
    r._update_ready()

async def recovery_base(r) -> str | None:
    """The snapshot a recreated stream starts from: one of this replica's state, written now, or
    else the newest one in the blob store (None: there is none; the new incarnation starts empty)."""
    if r._has_state:
        try:
            rec = await r.writer.write(r._position, r._written)
            return rec.dir if rec is not None else (r.writer.dir or None)
        except Exception:  # noqa: BLE001 - logged by the writer; fall back to an older snapshot
            pass
    recs = await asyncio.to_thread(r.snapshots.records)
    return recs[0].dir if recs else None
