"""Numerical guard: NaN logits fail the request (finish_reason "error" with a message) at exactly
the token where plain decoding meets them; nothing after it reaches the output or the corpus, and
no NaN left in the KV cache reaches the requests decoded next. The NaN comes from a real model
whose embedding row for one token is NaN (what an overflowing layer produces)."""

import copy

import pytest
import torch
from tiny_lm import tiny_lm, one_thread  # noqa: F401 (a fixture)

from tests.verifier.engine.test_stops import last_document
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def make_engine(model, codec, drafter=None) -> Engine:
    return Engine(model, codec, drafter, EngineConfig(max_batch=2, max_len=64, budget=6 if drafter else 0))


@pytest.mark.usefixtures("one_thread")
def test_nan_logits_fail_the_request_where_plain_decoding_would():
    lm = tiny_lm(vocab_size=32, seed=7)
    prompt, other = [1, 2, 3, 1, 2], [20, 21, 22]
    clean = make_engine(lm.model, lm.codec).generate([prompt, other], GREEDY)
    out = clean[0].output_ids
    # The first output token (from index 2) that is new: its own embedding feeds only later rows.
    j = next(i for i in range(2, len(out) - 1) if out[i] not in prompt + out[:i] and out[i] not in other + clean[1].output_ids)
    poisoned = copy.deepcopy(lm.model)
    with torch.no_grad():
        poisoned.embed_tokens.weight[out[j]] = float("nan")
    drafter = Drafter(vocab_size=32)
    make_engine(lm.model, lm.codec, drafter).generate([prompt], GREEDY)  # the corpus learns `out`
    for eng in (make_engine(poisoned, lm.codec), make_engine(poisoned, lm.codec, drafter)):
        bad, fine = eng.generate([prompt, other], GREEDY)
        assert bad.output_ids == out[:j + 1] and bad.finish_reason == "error"
        assert "NaN or infinite" in bad.error and f"output token {j + 1}" in bad.error
        assert fine.output_ids == clean[1].output_ids  # decoded next to it, same cache
        again = eng.generate([other], GREEDY)[0]  # in the slot the failed request left
        assert again.output_ids == clean[1].output_ids
    assert eng.stats.accepted_tokens > 0
    drafter.local.synchronize()
    docs = drafter.local.learned_tokens().tolist()
    assert prompt + out[:j + 1] + [-(2**31)] in [docs[i:i + len(prompt) + j + 2] for i in range(len(docs))]
    assert last_document(drafter) == other + clean[1].output_ids


@pytest.mark.usefixtures("one_thread")
def test_nan_in_the_prompt_fails_at_prefill():
    lm = tiny_lm(vocab_size=32, seed=7)
    poisoned = copy.deepcopy(lm.model)
    with torch.no_grad():
        poisoned.embed_tokens.weight[9] = float("inf")
    eng = make_engine(poisoned, lm.codec, Drafter(vocab_size=32))
    bad, fine = eng.generate([[4, 9, 5], [4, 5, 6]], GREEDY)
    assert bad.output_ids == [] and bad.finish_reason == "error" and "output token 0" in bad.error
    assert fine.output_ids == make_engine(lm.model, lm.codec).generate([[4, 5, 6]], GREEDY)[0].output_ids
