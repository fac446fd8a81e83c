"""Sampled verification: exact tree rejection sampling against each request's target
distribution (straight from the logits, or from processed logits), each request's coins from its
own stream, and a single sampled token (a prefill's first)."""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from ..step.cuda_graphs import StepForward
from ..step.penalties import needs_processing
from ..step.sampling import sample, target_probs
from .request import Request


class Sampled:
    """Sampled verification (mixed into ``Engine``, whose state it uses)."""

    def _raw_targets(self, running: list[Request]) -> bool:
        """Whether every request's target comes from its logits as the model gave them: their
        softmax, truncated by top-k / top-p, or their argmax (no penalties or min_tokens, grammar or
        logprobs). Such a step verifies from the logits (``kernels.tree_sampling_logits``, top-k /
        top-p as a floor per row), without a float copy of the logits, a sort of every row and a
        [bs, K, V] distribution (at 134 requests x 16 nodes, ~0.65 ms of the H200's time per step
        for the distribution alone)."""
        return all(not needs_processing(r) and r.grammar is None and r.params.logprobs is None for r in running)

    def _coins(self, running: list[Request], K: int, extra: np.ndarray | None = None):
        """Each request's K node coins [bs, K] and bonus coin [bs] on the device, from its own stream
        (zeros for greedy requests), and ``extra`` (float32) with them: one host array, one copy."""
        bs = len(running)
        n = bs * (K + 1)
        host = np.zeros(n + (len(extra) if extra is not None else 0), dtype=np.float32)
        for b, r in enumerate(running):
            if r.coins is not None:
                host[b * (K + 1):(b + 1) * (K + 1)] = r.coins.take(K + 1)
        if extra is not None:
            host[n:] = extra
        dev = torch.from_numpy(host).to(self.device)
        draws = dev[:n].view(bs, K + 1)
        return draws[:, :K].contiguous(), draws[:, K].contiguous(), dev[n:]

    @staticmethod
    def _finite_after_processing(running: list[Request]) -> bool:
        """Whether processing leaves every logit finite: penalties and logprobs do; a grammar mask
        and min_tokens put -inf in on purpose (which the logits kernel would read as a broken row).
        Such a step's processed float32 logits verify like raw ones (``_verify_raw``)."""
        return all(r.grammar is None and len(r.output_ids) >= r.params.min_tokens for r in running)

    def _verify_raw(self, running: list[Request], f: StepForward, logits: torch.Tensor | None = None):
        """Tree rejection sampling of a ``_raw_targets`` step straight from its logits (or from
        ``logits`` [bs, K, V], processed, finite); greedy rows (temperature 0) have one-hot targets,
        as in ``_verify_sampled``. Returns (result, bad)."""
        bs, K = f.tokens.shape
        V = self.model.config.vocab_size
        # top-k / top-p go up with the temperatures in one copy, only where a request truncates.
        rows = [(r.params.temperature, r.params.top_k if 0 < r.params.top_k < V else 0, r.params.top_p)
                for r in running]
        truncated = any(k or p < 1.0 for _, k, p in rows)
        per_row = np.repeat(np.array(rows if truncated else [t for t, _, _ in rows], dtype=np.float32), K, axis=0)
        coins, final, extra = self._coins(running, K, per_row.T.reshape(-1))
        n = bs * K
        temps = extra[:n]
        top_k, top_p = (extra[n:2 * n], extra[2 * n:]) if truncated else (None, None)
        idx = f.idx
        return kernels.tree_sampling_logits(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                            idx.retrive_next_sibling, coins, final,
                                            f.logits if logits is None else logits, temps, K, top_k=top_k, top_p=top_p)

    def _verify_sampled(self, running: list[Request], f: StepForward, logits: torch.Tensor):
        """Exact tree rejection sampling of processed ``logits`` [bs, K, V] float32; greedy rows use
        one-hot targets (the same as greedy)."""
        bs, K, V = logits.shape
        flat = logits.reshape(bs * K, V)
        probs = target_probs(flat, *self._param_tensors(running, K))
        if any(r.params.greedy for r in running):  # (else no [bs * K, V] one-hot to build and merge)
            greedy = torch.tensor([r.params.greedy for r in running], device=self.device).repeat_interleave(K)
            one_hot = torch.zeros_like(probs).scatter_(1, flat.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy[:, None], one_hot, probs)
        probs = probs.view(bs, K, V)
        coins, final, _ = self._coins(running, K)
        idx = f.idx
        return kernels.tree_speculative_sampling(f.tokens, idx.retrive_index, idx.retrive_next_token,
                                                 idx.retrive_next_sibling, coins, final, probs, K)

    def _sample_one(self, logits: torch.Tensor, reqs: list[Request]) -> int:
        req = reqs[0]
        p = req.params
        if p.greedy:
            return int(logits[0].argmax())
        probs = target_probs(logits, *self._param_tensors([req], 1))
        return int(sample(probs, torch.from_numpy(req.coins.take(1).copy()).to(probs.device))[0])

    def _param_tensors(self, reqs: list[Request], K: int):
        """target_probs' per-row arguments, and whether any request truncates (known here, on the host)."""
        dev, V = self.device, self.model.config.vocab_size
        temp = torch.tensor([max(r.params.temperature, 1e-6) for r in reqs], device=dev).repeat_interleave(K)
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev).repeat_interleave(K)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev).repeat_interleave(K)
        truncated = any(0 < r.params.top_k < V or r.params.top_p < 1.0 for r in reqs)
        return temp, top_k, top_p, truncated
