"""What a replica tells its callers: read-your-writes (``wait_visible``, behind
``BatchPut(synchronize=True)``) and its status (``GET /v1/replication``, the metrics).

``wait_visible`` covers this replica's own commits (the publisher's serial of the newest queued
event, acknowledged at a stream sequence) and everything the stream held when it was called (what
other replicas had published by then); it returns once the applier is past both.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import nats.errors

from corpus_service.protocol.status import CorpusError
from corpus_service.replication.applier import digest


async def wait_visible(r, timeout: float) -> int:
    """Returns once every commit this replica queued before the call, and every message the
    stream held at the call, is applied here (visible to drafts); the position. Raises
    UNAVAILABLE if that does not happen within ``timeout`` (the broker is down, the replica is
    far behind, the stream was recreated meanwhile): the commits stay buffered."""
    incarnation, mark = r.incarnation, r.publisher.mark()
    try:
        async with asyncio.timeout(timeout):
            if not r.bootstrapped:
                raise TimeoutError
            target = await r.publisher.wait_acked(mark, timeout)
            try:  # and what other replicas published before the call
                view = await r.stream.view(r._js)
                if view is not None and view.incarnation == incarnation:
                    target = max(target, view.last)
            except (nats.errors.Error, OSError):
                pass  # the broker went away after acknowledging: this replica's commits are enough
            while r.applied_seq < target or not r.stream_ok:
                if r.incarnation != incarnation:
                    raise TimeoutError
                await r._applied.wait()
    except TimeoutError:
        b = r.publisher.buffered_tokens()
        why = ("the replica has not bootstrapped" if not r.bootstrapped else
               "the commit log stream was lost or recreated" if r.incarnation != incarnation or not r.stream_ok
               else f"the broker has not acknowledged them ({b} tokens buffered)" if r.publisher.acked_serial < mark
               else f"the replica is {max(0, r.pending)} log messages behind")
        raise CorpusError(f"synchronize: commits not visible within {timeout:.1f}s: {why}; they stay buffered and "
                          f"are applied once possible", grpc.StatusCode.UNAVAILABLE) from None
    return r.applied_seq


def lag_seconds(r) -> float:
    """0 when nothing is pending; else how far the newest applied commit is behind now (an upper
    bound of how stale this replica's corpus is)."""
    if r.pending <= 0 or not r._last_commit_ns:
        return 0.0
    return max(0.0, (time.time_ns() - r._last_commit_ns) / 1e9)


def status(r, with_digest: bool = False) -> dict:
    lags = sorted(r.lags_ms)
    out = {
        "replica": r.id, "stream": r.stream_name, "connected": bool(r._nc and r._nc.is_connected),
        "stream_healthy": r.stream_ok, "stream_incarnation": r.incarnation, "stream_base": r.base,
        "stream_losses": r.stream_losses, "stream_last_seq": r.stream_last,
        "bootstrapped": r.bootstrapped, "read_only": r.read_only, "ready": bool(r.state.ready),
        "applied_seq": r.applied_seq, "pending": r.pending, "lag_seconds": lag_seconds(r),
        "gaps": r.gaps, "gap_error": r.gap_error, "applied_tokens": r.applier.applied_tokens,
        "lag_count": r.lag_count,
        "lag_ms_p50": lags[len(lags) // 2] if lags else None,
        "lag_ms_p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else None,
        **r.publisher.stats(), **r.writer.stats(),
    }
    if with_digest:
        with r._apply_lock:  # a digest between two applied messages, and which one
            out["digest_seq"], out["digest"] = r.applied_seq, digest(r.state)
    return out
