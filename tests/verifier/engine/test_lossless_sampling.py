"""Speculative sampling is lossless: with drafts from a corpus that drafts well, the sampled
sequences follow the model's exact distribution, as plain sampling's do, and the two samples agree
with each other (Pearson chi-square over every 3-token sequence of a 6-token vocabulary, tiny model,
CPU, float32, fixed seeds). The same test rejects a deliberately biased sampler: tree rejection
sampling that accepts draft tokens a little too eagerly (threshold_acc 0.9 instead of 1), so it can fail.

Measured (this file's seeds): MAT 2.67; p = 0.35 (speculative vs exact), 0.87 (plain vs exact), 0.55
(speculative vs plain); the biased sampler: MAT 2.86, p = 3.5e-20 vs exact, 8.4e-15 vs plain."""

import functools

import pytest
import torch
from tiny_lm import next_logits, one_thread, tiny_lm  # noqa: F401 (a fixture)

from verifier import kernels
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

V, L, T, N = 6, 3, 0.8, 1500
PROMPT = [1, 2, 3, 1, 2]
# Correct sampling fails a test at this level one time in 10^5; the biased sampler's p is ~1e-15 here.
ALPHA = 1e-5


def pooled(cells: list, probs: dict, n: int) -> list:
    """Cells expected below 5 of ``n`` draws pooled into one (Pearson's rule of thumb)."""
    small = {k for k in cells if probs[k] * n < 5}
    return [[k] for k in cells if k not in small] + ([sorted(small)] if small else [])


def gammaincc(dof: int, stat: float) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def fit_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Goodness of fit of ``counts`` (n draws) to the exact ``probs``."""
    groups = pooled(list(probs), probs, n)
    obs = [sum(counts.get(k, 0) for k in g) for g in groups]
    exp = [sum(probs[k] for k in g) * n for g in groups]
    return gammaincc(len(groups) - 1, sum((o - e) ** 2 / e for o, e in zip(obs, exp)))


def homogeneity_pvalue(a: dict, b: dict, probs: dict, n: int) -> float:
    """Whether two samples of n draws each come from one distribution (2 x k contingency table)."""
    groups = pooled(list(probs), probs, n)
    stat = 0.0
    for g in groups:
        x, y = sum(a.get(k, 0) for k in g), sum(b.get(k, 0) for k in g)
        if x + y:
            stat += (x - y) ** 2 / (x + y)  # Pearson's statistic for two equal-sized samples
    return gammaincc(len(groups) - 1, stat)


@functools.cache
def model_and_exact():
    lm = tiny_lm(vocab_size=V, seed=3, weight_std=0.4)
    probs = {(): 1.0}
    for _ in range(L):
        nxt = {}
        for seq, p in probs.items():
            q = (next_logits(lm.model, PROMPT + list(seq)) / T).softmax(-1)
            for t in range(V):
                nxt[seq + (t,)] = p * float(q[t])
        probs = nxt
    return lm, probs


def draws(spec: bool, first_seed: int, threshold_acc: float = 1.0) -> tuple[dict, float]:
    """N sequences (seeds first_seed..) and the engine's mean accepted tokens per step (MAT)."""
    lm, _ = model_and_exact()
    drafter = Drafter("local", vocab_size=V) if spec else None
    eng = Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=48, max_len=64, budget=6 if spec else 0,
                                                           max_budget=15))
    if spec:  # a corpus that drafts well: it has seen this prompt's continuations
        eng.generate([PROMPT] * 300, [SamplingParams(max_tokens=L, temperature=T, seed=10**9 + i, ignore_eos=True)
                                      for i in range(300)])
    params = [SamplingParams(max_tokens=L, temperature=T, seed=first_seed + i, ignore_eos=True) for i in range(N)]
    # Temperature sampling without logit processing verifies from the logits (kernels.tree_sampling_logits).
    sampler = kernels.tree_sampling_logits
    if threshold_acc != 1.0:
        kernels.tree_sampling_logits = functools.partial(sampler, threshold_acc=threshold_acc)
    try:
        reqs = eng.generate([PROMPT] * N, params)
    finally:
        kernels.tree_sampling_logits = sampler
    counts: dict = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    steps = sum(r.verify_steps for r in reqs)
    return counts, (steps + sum(r.accepted_tokens for r in reqs)) / max(1, steps)


@pytest.mark.usefixtures("one_thread")
def test_speculative_sampling_has_the_plain_distribution_and_a_biased_sampler_fails():
    _, exact = model_and_exact()
    spec, mat = draws(True, 0)
    # Drafts were good enough to matter (the first token comes from the prefill; a verify step can
    # then commit both others: MAT at most 3).
    assert mat > 2.0, f"MAT {mat:.2f}: the corpus drafts too little to test anything"
    plain, plain_mat = draws(False, N)
    assert plain_mat == 1.0
    p_spec, p_plain = fit_pvalue(spec, exact, N), fit_pvalue(plain, exact, N)
    p_same = homogeneity_pvalue(spec, plain, exact, N)
    assert min(p_spec, p_plain, p_same) > ALPHA, (p_spec, p_plain, p_same)
    biased, biased_mat = draws(True, 0, threshold_acc=0.9)
    assert biased_mat > mat  # it accepts more drafts ...
    p_biased, p_biased_same = fit_pvalue(biased, exact, N), homogeneity_pvalue(biased, plain, exact, N)
    assert max(p_biased, p_biased_same) < ALPHA, (p_biased, p_biased_same)  # ... and the test sees the bias
