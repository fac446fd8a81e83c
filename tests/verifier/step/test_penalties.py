"""Presence, frequency and repetition penalties under speculation: every tree node is penalized
with the tokens on its path, so speculative output equals plain output (greedy: token for token;
sampling: in distribution, checked against the exact distribution on a tiny model), and plain
output equals an independent one-token-at-a-time reference."""

import pytest
import torch
from engine_fixtures import engine
from tiny_lm import next_logits, penalized, tiny_lm, one_thread  # noqa: F401 (a fixture)

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.3)


def tiny_engine(lm, spec: bool, budget: int = 6, max_batch: int = 8) -> Engine:
    drafter = Drafter(vocab_size=lm.model.config.vocab_size) if spec else None
    return Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=max_batch, max_len=64,
                                                           budget=budget if spec else 0, max_budget=15))


def reference_greedy(lm, prompt: list[int], max_tokens: int, **pen) -> list[int]:
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(int(penalized(next_logits(lm.model, prompt + out), prompt, out, **pen).argmax()))
    return out


@pytest.mark.usefixtures("one_thread")
def test_greedy_penalties_equal_the_reference_with_and_without_speculation():
    lm = tiny_lm(vocab_size=64, seed=1)
    prompts = [[1, 2, 3, 4] * 3, [5, 6, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10]]
    params = SamplingParams(max_tokens=16, ignore_eos=True, **PENALTIES)
    expected = [reference_greedy(lm, p, 16, **PENALTIES) for p in prompts]
    assert [r.output_ids for r in tiny_engine(lm, spec=False).generate(prompts, params)] == expected
    eng = tiny_engine(lm, spec=True)
    eng.generate(prompts, params)  # the outputs enter the learned corpus: the second pass drafts them
    again = eng.generate(prompts, params)
    assert [r.output_ids for r in again] == expected
    # Whole drafted runs were accepted, so nodes were penalized with the tokens on their paths.
    assert sum(r.accepted_tokens for r in again) >= 20, [r.accepted_tokens for r in again]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_a_batch_mixing_penalties_equals_each_request_alone(spec):
    """Penalized requests of different parameters beside unpenalized ones (one batched pass over
    the penalized rows only), more requests than slots (a slot's row starts afresh for the next
    request), each output equal to its own one-token-at-a-time reference."""
    lm = tiny_lm(vocab_size=64, seed=1)
    prompts = [[1, 2, 3, 4] * 3, [5, 6, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10], [3, 3, 4, 4, 5], [7, 8, 9, 7, 8]]
    pens = [PENALTIES, {}, dict(frequency_penalty=1.5), dict(repetition_penalty=0.7, presence_penalty=-0.5), {}]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **p) for p in pens]
    expected = [reference_greedy(lm, pr, 12, **pe) for pr, pe in zip(prompts, pens)]
    eng = tiny_engine(lm, spec=spec, max_batch=3)
    assert [r.output_ids for r in eng.generate(prompts, params)] == expected
    if spec:  # the learned corpus drafts the second pass: trees of several nodes, penalized per path
        again = eng.generate(prompts[::-1], params[::-1])
        assert [r.output_ids for r in again] == expected[::-1]
        assert sum(r.accepted_tokens for r in again) >= 10


def test_penalty_counts_rows_follow_their_requests():
    from verifier.engine.request import Request
    from verifier.step.penalties import PenaltyCounts

    counts, V = PenaltyCounts(2), 8
    a = Request("a", [1, 2, 2], SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2))
    a.slot, a.output_ids = 1, [3, 3, 9, -1]  # out-of-vocabulary ids count at the nearest end, as before
    rows = counts.rows([a], V, torch.device("cpu"))
    assert rows.tolist() == [1]
    assert counts.counts[1].tolist() == [1, 0, 0, 2, 0, 0, 0, 1] and counts.counts[0].sum() == 0
    assert counts.prompt[1].nonzero().flatten().tolist() == [1, 2]
    a.output_ids.append(4)  # only the new token is added
    counts.rows([a], V, torch.device("cpu"))
    assert counts.counts[1].tolist() == [1, 0, 0, 2, 1, 0, 0, 1]
    b = Request("b", [5], SamplingParams(presence_penalty=1.0, repetition_penalty=0.9))
    b.slot, b.output_ids = 1, [6]  # the slot's next request: its row starts afresh
    counts.rows([b], V, torch.device("cpu"))
    assert counts.counts[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert counts.prompt[1].nonzero().flatten().tolist() == [5]
    b.slot = 2
    with pytest.raises(ValueError, match="slot 2"):
        counts.rows([b], V, torch.device("cpu"))


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; cells expected below 5 are pooled into one."""
    small = [k for k in probs if probs[k] * n < 5]
    obs = [counts.get(k, 0) for k in probs if k not in small] + [sum(counts.get(k, 0) for k in small)]
    exp = [probs[k] * n for k in probs if k not in small] + [sum(probs[k] for k in small) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = sum(e > 0 for e in exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def exact_sequence_probs(lm, prompt: list[int], length: int, temperature: float, **pen) -> dict:
    V = lm.model.config.vocab_size
    probs = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, p in probs.items():
            q = (penalized(next_logits(lm.model, prompt + list(seq)), prompt, list(seq), **pen) / temperature).softmax(-1)
            for t in range(V):
                nxt[seq + (t,)] = p * float(q[t])
        probs = nxt
    return probs


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_sampled_penalties_follow_the_exact_distribution(spec):
    """3-token samples of a 6-token vocabulary against the exact distribution (216 sequences)."""
    lm = tiny_lm(vocab_size=6, seed=3, weight_std=0.4)
    prompt, L, T, N = [1, 2, 3, 1, 2], 3, 1.0, 1500
    exact = exact_sequence_probs(lm, prompt, L, T, **PENALTIES)
    eng = tiny_engine(lm, spec=spec, budget=4, max_batch=48)
    params = [SamplingParams(max_tokens=L, temperature=T, seed=1000 + i, ignore_eos=True, **PENALTIES) for i in range(N)]
    reqs = eng.generate([prompt] * N, params)
    counts = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    p = chi2_pvalue(counts, exact, N)
    # Correct sampling fails this 1e-5 of the time at most (drafts may vary with the corpus' insert
    # thread); penalizing nodes without their paths gives p ~ 1e-10 here.
    assert p > 1e-5, f"p = {p:.2e}"
    if spec:
        assert sum(r.accepted_tokens for r in reqs) > N // 2, "too few accepted drafts to test anything"


def test_greedy_penalties_on_smollm2_speculative_equals_plain(smollm2, trace_rows):
    prompts = [r["prompt_ids"] for r in trace_rows[:1]]
    params = SamplingParams(max_tokens=16, **PENALTIES)
    plain = engine(smollm2, None).generate(prompts, params)
    eng = engine(smollm2, Drafter(vocab_size=smollm2.model.config.vocab_size))
    eng.generate(prompts, params)
    again = eng.generate(prompts, params)
    assert [r.output_ids for r in again] == [r.output_ids for r in plain]
    assert sum(r.accepted_tokens for r in again) > 0


@pytest.mark.usefixtures("one_thread")
def test_a_sampled_step_with_penalties_verifies_from_its_processed_logits(monkeypatch):
    """Penalties leave every logit finite, so a sampled step verifies from the processed logits as
    from raw ones (the logits kernel: no sort, no [bs, K, V] distribution); min_tokens masks stop
    tokens with -inf, which that kernel would read as a broken row, so those steps keep the
    distribution path."""
    from verifier import kernels

    calls = {"logits": 0, "probs": 0}
    for name, key in (("tree_sampling_logits", "logits"), ("tree_speculative_sampling", "probs")):
        inner = getattr(kernels, name)

        def counted(*a, _inner=inner, _key=key, **k):
            calls[_key] += 1
            return _inner(*a, **k)

        monkeypatch.setattr(kernels, name, counted)
    lm = tiny_lm(vocab_size=6, seed=3, weight_std=0.4)
    eng = tiny_engine(lm, spec=True, budget=4)
    sampled = dict(temperature=0.9, top_p=0.9, ignore_eos=True, **PENALTIES)
    eng.generate([[1, 2, 3, 1, 2]] * 2, [SamplingParams(max_tokens=6, seed=s, **sampled) for s in range(2)])
    assert calls["logits"] > 0 and calls["probs"] == 0
    calls.update(logits=0, probs=0)
    eng.generate([[1, 2, 3, 1, 2]], [SamplingParams(max_tokens=6, seed=9, min_tokens=6, **sampled)])
    assert calls["probs"] > 0 and calls["logits"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_targets_process_only_the_rows_that_need_it(dtype):
    """greedy_targets (a greedy step whose batch mixes processed and plain requests) equals the argmax
    of the whole batch's logits copied to float32 and processed, ties included (16-bit logits tie
    often: the copy is exact and both argmaxes take the first maximum)."""
    from verifier.engine.request import Request
    from verifier.step.penalties import PenaltyCounts, greedy_targets, process_logits

    g = torch.Generator().manual_seed(5)
    bs, K, V = 6, 4, 64
    kinds = [PENALTIES, {}, dict(frequency_penalty=1.5), {}, dict(min_tokens=9), {}]
    reqs = []
    for b, kind in enumerate(kinds):
        r = Request(f"r{b}", [1, 2, 3, b], SamplingParams(max_tokens=20, **kind))
        r.slot, r.output_ids = b, [4, 5, b % 3, 0]
        reqs.append(r)
    tokens = torch.randint(0, V, (bs, K), generator=g)
    tree_mask = torch.tril(torch.ones(K, K, dtype=torch.bool)).expand(bs, K, K).contiguous()
    for case in range(3):
        logits = (torch.randn(bs, K, V, generator=g) * 2).round().to(dtype)  # coarse: many tied maxima
        expected = process_logits(logits.float().clone(), reqs, tokens, tree_mask, (0,), PenaltyCounts(bs)).argmax(-1)
        got = greedy_targets(logits.clone(), reqs, tokens, tree_mask, (0,), PenaltyCounts(bs))
        assert torch.equal(got, expected), case
    plain = [r for r, k in zip(reqs, kinds) if not k]
    logits = torch.randn(len(plain), K, V, generator=g).to(dtype)
    assert torch.equal(greedy_targets(logits, plain, tokens[:3], tree_mask[:3], (0,), PenaltyCounts(bs)),
                       logits.float().argmax(-1))  # none to process: the logits' own argmax
