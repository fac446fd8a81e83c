"""Logprobs under speculation: one entry per emitted token (accepted drafts and the bonus token
included), equal within float tolerance to plain decoding's (greedy, the real SmolLM2) and to an
independent reference computed from the model's logits (sampling with penalties, a tiny model)."""

import pytest
import torch
from engine_fixtures import engine
from tiny_lm import next_logits, one_thread, penalized, tiny_lm  # noqa: F401 (a fixture)

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

# fp32 CPU: a tree forward and a one-token forward sum in different orders (~1e-6 relative).
TOL = 1e-3


def test_greedy_logprobs_equal_plain_decoding(smollm2, trace_rows):
    prompts = [r["prompt_ids"] for r in trace_rows[:1]]
    params = SamplingParams(max_tokens=16, logprobs=5)
    plain = engine(smollm2, None).generate(prompts, params)
    eng = engine(smollm2, Drafter(vocab_size=smollm2.model.config.vocab_size))
    eng.generate(prompts, params)  # warm: the second pass drafts whole outputs
    spec = eng.generate(prompts, params)
    assert sum(r.accepted_tokens for r in spec) >= 8
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert [t.token for t in s.logprobs] == s.output_ids and len(p.logprobs) == len(p.output_ids)
        for a, b in zip(p.logprobs, s.logprobs):
            assert abs(a.logprob - b.logprob) < TOL and len(a.top) == len(b.top) == 5
            assert a.top[0][0] == b.token  # greedy: the chosen token is the most likely one
            assert {t for t, _ in a.top} == {t for t, _ in b.top} or abs(a.top[-1][1] - b.top[-1][1]) < TOL
            for (ta, va), (tb, vb) in zip(a.top, b.top):
                assert abs(va - vb) < TOL


@pytest.mark.usefixtures("one_thread")
def test_sampled_logprobs_are_the_penalized_model_distribution():
    lm = tiny_lm(vocab_size=16, seed=11)
    pen = dict(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.2)
    prompt = [1, 2, 3, 1, 2, 3]
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=16), EngineConfig(max_batch=8, max_len=64, budget=6))
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=s, logprobs=3, ignore_eos=True, **pen) for s in range(24)]
    reqs = eng.generate([prompt] * 24, params)
    assert sum(r.accepted_tokens for r in reqs) > 0
    for r in reqs:
        assert len(r.logprobs) == len(r.output_ids)
        for i, t in enumerate(r.logprobs):
            ref = penalized(next_logits(lm.model, prompt + r.output_ids[:i]), prompt, r.output_ids[:i], **pen)
            ref = torch.log_softmax(ref, -1)
            assert t.token == r.output_ids[i] and abs(t.logprob - float(ref[t.token])) < TOL
            top_v, top_i = ref.topk(3)
            assert [x for x, _ in t.top] == top_i.tolist()
            assert all(abs(v - float(rv)) < TOL for (_, v), rv in zip(t.top, top_v))
