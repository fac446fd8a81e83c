"""The KV cache: preallocated per slot, one contiguous tensor so that verify-step compaction
(``verifier.kernels.compact_kv_cache``) moves every layer's K and V rows in one call.

Layout: ``data`` [2 * layers, num_slots * max_len, kv_heads, head_dim]; cache row r of slot s is
flat row ``s * max_len + r``; entry 2l is layer l's keys, 2l + 1 its values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verifier import kernels


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if num_slots < 1 or max_len < 2:
            raise ValueError(f"KV cache: expected num_slots >= 1 and max_len >= 2, got {num_slots}, {max_len}")
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        self.data = torch.zeros(2 * num_layers, num_slots * max_len, num_kv_heads, head_dim, device=device, dtype=dtype)
        self._view = self.data.view(2 * num_layers, num_slots, max_len, num_kv_heads, head_dim)
        # Arrival counters of kernels.decode_attention, which merges its partial results in one
        # kernel with them: one per (request, kv head, tile of 16-64 query rows); 16 tiles cover
        # 64 tree nodes of up to 4 (float32) to 16 (16-bit caches) query heads per kv head (more
        # falls back to two kernels, as do steps of more than 8 query rows per kv head). The
        # cache owns them because only the steps that use this cache run its attention, one at a time.
        self.arrivals = torch.zeros(num_slots * num_kv_heads * 16, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write_kv(self, layer: int, flat_rows: Tensor, kv: Tensor) -> None:
        """kv [2, bs, T, Hkv, D] (keys, values) into flat rows [bs * T] (``flat_rows``): one kernel."""
        pair = self.data.view(self.num_layers, 2, *self.data.shape[1:])[layer]
        pair[:, flat_rows] = kv.reshape(2, -1, *kv.shape[-2:])

    def read(self, layer: int, slots: Tensor, kv_len: int, slot_range: tuple[int, int] | None) -> tuple[Tensor, Tensor]:
        """Keys and values [bs, Hkv, kv_len, D] (views when the slots are consecutive)."""
        if slot_range is not None:
            first, n = slot_range
            k = self._view[2 * layer, first:first + n, :kv_len]
            v = self._view[2 * layer + 1, first:first + n, :kv_len]
        else:
            k = self._view[2 * layer, slots, :kv_len]
            v = self._view[2 * layer + 1, slots, :kv_len]
        return k.transpose(1, 2), v.transpose(1, 2)

    def flat_rows(self, slots: Tensor, rows: Tensor) -> Tensor:
        """Flat row indices [bs, T] of rows [bs, T] in slots [bs]."""
        return slots[:, None].to(torch.int64) * self.max_len + rows.to(torch.int64)

    def keep_accepted(self, slots: Tensor, prefix_lens: Tensor, num_nodes: int, accept_index: Tensor,
                      accept_token_num: Tensor) -> None:
        """After a verify step whose node i was written at row prefix_len + i: move the accepted
        path's K/V to rows prefix_len + 1 .. prefix_len + n (the root stays at prefix_len)."""
        node_rows = prefix_lens.to(torch.int64)[:, None] + torch.arange(num_nodes, device=slots.device)
        kernels.compact_kv_cache(self.data, self.flat_rows(slots, node_rows), accept_index, accept_token_num)

    def clear(self, slot: int, start: int = 0) -> None:
        """Zeroes rows start.. of a slot: rows past a request's prefix are masked in attention but
        still multiplied by zero weights, so a NaN left there would reach later requests."""
        self._view[:, slot, start:] = 0
