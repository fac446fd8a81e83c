"""Stops under speculation: a stop inside an accepted run cuts the output there; nothing after it
is emitted or reaches the corpus; min_tokens masks eos and stop tokens per tree node. Speculative
output equals plain output for eos, stop strings spanning token boundaries, stop_token_ids,
min_tokens and max_tokens."""

import pytest
from engine_fixtures import engine
from tiny_lm import next_logits, tiny_lm, one_thread  # noqa: F401 (a fixture)

from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

SEP = -(2**31)  # the learned corpus' document separator


def last_document(drafter: Drafter) -> list[int]:
    """The learned corpus' last document: the tail of the request that finished last (a long
    request is stored in chunks of flush_tokens with some left context)."""
    drafter.local.synchronize()
    toks = drafter.local.learned_tokens().tolist()
    cut = len(toks) - 1 - toks[::-1].index(SEP) if SEP in toks else -1
    return toks[cut + 1:]


@pytest.mark.usefixtures("one_thread")
def test_min_tokens_masks_stop_tokens_per_node_and_speculation_keeps_it():
    lm = tiny_lm(vocab_size=16, seed=5)
    V, eos = 16, 15
    prompt = [3, 4, 5, 3, 4]
    free = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=2, max_len=64, budget=0)).generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
    stop = free[1]  # a token greedy decoding emits early: min_tokens must hold it back
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop,), min_tokens=5)
    expected = []  # reference: greedy with eos and the stop token masked below min_tokens
    while len(expected) < 12:
        logits = next_logits(lm.model, prompt + expected)
        if len(expected) < 5:
            logits[[eos, stop]] = float("-inf")
        expected.append(int(logits.argmax()))
        if expected[-1] in (eos, stop):
            break
    assert stop not in expected[:5] and expected[:2] != free[:2]
    plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=2, max_len=64, budget=0)).generate([prompt], params)[0]
    assert plain.output_ids == expected
    drafter = Drafter(vocab_size=V)
    eng = Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=2, max_len=64, budget=6))
    eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))  # the corpus learns `free`
    eng.generate([prompt], params)  # ... and `expected`
    spec = eng.generate([prompt], params)[0]
    assert spec.output_ids == expected and spec.finish_reason == plain.finish_reason
    assert spec.accepted_tokens > 0
    assert last_document(drafter) == prompt + expected


def _first_hit(codec, ids: list[int], needle: str) -> int:
    """Index of the token whose decoding completes the first occurrence of needle."""
    return next(j for j in range(1, len(ids) + 1) if needle in codec.decode(ids[:j])) - 1


def test_stop_string_and_stop_token_inside_an_accepted_run(smollm2, trace_rows):
    codec = smollm2.codec
    prompt = trace_rows[0]["prompt_ids"]
    free = engine(smollm2, None).generate([prompt], SamplingParams(max_tokens=24))[0]  # plain decoding
    ids, text = free.output_ids, free.text
    # A stop string across the boundary of tokens k-1 and k, k near the middle of the output.
    k = next(k for k in range(8, len(ids)) if len(codec.decode(ids[:k])) >= 2
             and len(codec.decode(ids[k:k + 1]).strip()) >= 2)
    cut = len(codec.decode(ids[:k]))
    stop_str = text[cut - 2:cut + 2]
    at = text.find(stop_str)
    j = _first_hit(codec, ids, stop_str)
    tok = ids[6]
    t = ids.index(tok)
    drafter = Drafter(vocab_size=smollm2.model.config.vocab_size)
    eng = engine(smollm2, drafter)
    eng.generate([prompt], SamplingParams(max_tokens=24))  # warm: the whole output is drafted next time
    # Plain decoding emits `ids` one token at a time and stops at the first hit: the expected output.
    for params, n_out, out_text in (
            (SamplingParams(max_tokens=24, stop=("@@never@@", stop_str)), j + 1, text[:at]),
            (SamplingParams(max_tokens=24, stop_token_ids=(tok,)), t + 1, codec.decode(ids[:t + 1])),
            (SamplingParams(max_tokens=t + 3), t + 3, codec.decode(ids[:t + 3]))):
        spec = eng.generate([prompt], params)[0]
        assert spec.output_ids == ids[:n_out] and spec.text == out_text
        assert spec.finish_reason == ("length" if params.max_tokens < 24 else "stop")
        assert spec.accepted_tokens >= n_out // 2  # the stop fell inside accepted runs
        doc = last_document(drafter)  # nothing after the stop was committed to the corpus
        assert len(doc) > n_out and (prompt + ids[:n_out])[-len(doc):] == doc
