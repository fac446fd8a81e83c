"""Identical drafts on every tensor-parallel rank of one SGLang replica.

Each TP rank runs its own scheduler and NGRAM worker, and each builds its own corpus; their calls
carry the same windows but reach the shared corpus at different moments, between which other
replicas write to it. Two ranks asking it would get different trees and break the TP step. So rank 0
of SGLang's TP group is the replica's only voice: it asks the corpus (or drafts locally), feeds it,
and broadcasts each step's (drafts, mask) over the group's gloo (CPU) process group; the other
ranks only receive. ``batch_get`` is called on every rank at every decode step in the same order,
which is what makes it a safe collective; the external-corpus calls run on background threads of
each rank at unrelated times, so they never communicate (rank 0 alone writes to the service)."""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def sglang_tp_group():
    """SGLang's TP GroupCoordinator of this process, or None (no SGLang, or not initialised yet:
    a process without tensor parallelism, or a corpus built outside a worker)."""
    try:
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_tp_group

        if not dist.is_available() or not dist.is_initialized():
            return None
        return get_tp_group()
    except Exception:  # older or partial SGLang, or no group yet: one rank
        return None


class TpSync:
    """The TP group's view this corpus needs: who leads, and the step's broadcast."""

    def __init__(self, group=None) -> None:
        """``group``: an SGLang GroupCoordinator (``rank_in_group``, ``world_size``, ``ranks``,
        ``cpu_group``); None: one rank, nothing to send."""
        self.group = group
        self.world_size = int(getattr(group, "world_size", 1) or 1) if group is not None else 1
        self.rank = int(getattr(group, "rank_in_group", 0)) if group is not None else 0
        if self.world_size > 1 and getattr(group, "cpu_group", None) is None:
            raise ValueError("TP group: no CPU (gloo) process group to broadcast drafts over")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, drafts: np.ndarray | None, mask: np.ndarray | None, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank 0 passes its step's (drafts [n*k], mask [n*k*k]); every rank gets them back. One
        int32 tensor: both arrays' sizes follow from (n, k), which every rank knows."""
        if self.world_size == 1:
            return drafts, mask
        import torch
        import torch.distributed as dist

        size = n * k + n * k * k
        if self.leader:
            buf = torch.from_numpy(np.concatenate([drafts, mask]).astype(np.int32, copy=False))
        else:
            buf = torch.empty(size, dtype=torch.int32)
        dist.broadcast(buf, src=self.group.ranks[0], group=self.group.cpu_group)
        out = buf.numpy().astype(np.int64)
        return out[: n * k], out[n * k:]
