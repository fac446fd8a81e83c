"""Prefill: admitted requests grouped into batched forwards (``prefill_chunks``,
``graph_prefill_chunks``) and the forward that gives each its first token (``Prefill._prefill``)."""

from __future__ import annotations

import numpy as np
import torch

from ..model import ForwardBatch
from ..step.cuda_graphs import GraphRunner
from ..step.grammar import mask_logits
from ..step.numerics import nonfinite_rows
from ..step.penalties import needs_processing, process_logits
from .request import Request


def prefill_chunks(reqs: list[Request], max_tokens: int) -> list[list[Request]]:
    """Admitted requests grouped for batched prefill: by prompt length, so that each group's
    padded size (count x longest) stays within ``max_tokens`` (a longer prompt goes alone) and
    padding adds at most a quarter to the real tokens."""
    out: list[list[Request]] = []
    group: list[Request] = []
    real = 0
    for r in sorted(reqs, key=lambda r: len(r.prompt_ids)):
        n = len(r.prompt_ids)  # the longest so far (sorted)
        if group and ((len(group) + 1) * n > max_tokens or (len(group) + 1) * n > 1.25 * (real + n)):
            out.append(group)
            group, real = [], 0
        group.append(r)
        real += n
    if group:
        out.append(group)
    return out


def graph_prefill_chunks(reqs: list[Request], graphs: GraphRunner, max_tokens: int) -> list[list[Request]]:
    """Admitted requests grouped for prefill graphs: by length bucket, as many per group as one
    graph of that bucket takes (``GraphRunner.max_prefill_prompts``); prompts longer than the
    largest bucket are grouped for eager prefill (``prefill_chunks``)."""
    by_bucket: dict[int, list[Request]] = {}
    eager: list[Request] = []
    for r in reqs:
        Tb = graphs.prefill_bucket(len(r.prompt_ids))
        if Tb is None:
            eager.append(r)
        else:
            by_bucket.setdefault(Tb, []).append(r)
    out: list[list[Request]] = []
    for Tb, group in sorted(by_bucket.items()):
        n = graphs.max_prefill_prompts(Tb)
        out.extend(group[i:i + n] for i in range(0, len(group), n))
    return out + prefill_chunks(eager, max_tokens)


class Prefill:
    """The engine's prefill forward (mixed into ``Engine``, whose state it uses)."""

    def _prefill(self, reqs: list[Request]) -> None:
        """One causal forward over the prompts of ``reqs``, right-padded to the longest (replayed
        as a prefill graph where one fits), then each request's first token from its last prompt
        position. The padding rows' K/V land past each prompt, where masks never look and decoding
        overwrites them; they repeat the prompt's last token, so they are finite where the prompt
        is (a masked NaN still poisons attention: 0 * NaN)."""
        dev = self.device
        lens = [len(r.prompt_ids) for r in reqs]
        T = max(lens)
        Tb = None if self.graphs is None else self.graphs.prefill_bucket(T)
        if Tb is not None and len(reqs) <= self.graphs.max_prefill_prompts(Tb):
            logits = self.graphs.prefill([r.prompt_ids for r in reqs], [r.slot for r in reqs])
        else:
            ids = np.empty((len(reqs), T), dtype=np.int64)
            for i, r in enumerate(reqs):
                ids[i, :lens[i]] = r.prompt_ids
                ids[i, lens[i]:] = r.prompt_ids[-1]
            rows = torch.arange(T, device=dev).expand(len(reqs), T)
            fb = ForwardBatch(rows, rows, torch.tensor([r.slot for r in reqs], device=dev), T, None)
            last = torch.tensor(lens, device=dev) - 1
            logits = self.model(torch.from_numpy(ids).to(dev), self.cache, fb, last_index=last)[:, 0]
        if self.drafter is not None:
            # The corpus indexes the prompts while the GPU runs the prefill (its kernels are queued;
            # the first read of the logits waits): about 0.1 ms of host work per prompt, 6 ms for
            # the 64 prompts that start a batch-64 run, which would otherwise follow the forward.
            for req in reqs:
                self._corpus_call(self.drafter.start_request, req.req_id, req.prompt_ids, group=req.group,
                                  prompt_key=req.prompt_key, policy_version=req.policy_version)
        bad = nonfinite_rows(logits)  # before penalties: min_tokens puts -inf in on purpose
        if any(needs_processing(r) for r in reqs):
            n = len(reqs)
            process_logits(logits[:, None], reqs, logits.new_zeros(n, 1, dtype=torch.int64),
                           torch.ones(n, 1, 1, dtype=torch.bool, device=dev), self.eos_ids, self.penalty_counts)
        mask_logits(reqs, None, logits)
        # The greedy requests' first tokens and every row's non-finite flag: one copy to the host.
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        chosen = logits if len(greedy) == len(reqs) else logits[greedy]
        host = torch.cat([chosen.argmax(-1), bad.long()]).tolist()
        first, bad = dict(zip(greedy, host[:len(greedy)])), host[len(greedy):]
        for i, req in enumerate(reqs):
            tok = first[i] if i in first else self._sample_one(logits[i:i + 1], [req])
            req.cache_len = lens[i]
            self.stats.prefill_tokens += lens[i]
            self._commit_path(req, [tok], logits[i:i + 1], [0], [bool(bad[i])])
            if bad[i]:
                self.cache.clear(req.slot)
        self._flush_extends()
