"""The offline rollout front end on the tiny model (CPU): n samples per prompt with per-sample seeds,
reproducible, with logprobs, prompt keys and policy versions in the corpus' history, a makespan
summary; prompt files and their errors; the makespan rules (tail budget, longest first)."""

import json
from types import SimpleNamespace

import pytest
from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)

from corpus_service import NgramCorpus, default_prompt_key
from verifier import LLM, SamplingParams
from verifier.budget.makespan import MakespanClock, MakespanConfig, expected_length
from verifier.engine.request import Request
from verifier.engine.scheduler import Scheduler
from verifier.generate.prompts import read_prompts
from verifier.model.loader import LoadedModel
from verifier.step import sampling

V = 16


def tiny_llm(**config) -> LLM:
    lm = tiny_lm(vocab_size=V, seed=2)
    config = {"max_batch": 4, "max_len": 64, "budget": "4", "max_budget": 7, **config}
    return LLM("smollm2", "local", loaded=LoadedModel(lm.model, lm.codec, "tiny"), **config)


@pytest.mark.usefixtures("one_thread")
def test_n_samples_per_prompt_seeded_reproducible_and_in_the_history():
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7]]
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    with tiny_llm() as llm:
        outs = llm.generate(prompts, params, prompt_keys=["p0", None], policy_version=2, use_tqdm=False)
        summary = llm.last_run
        history = llm.engine.drafter.local
        assert history.prompt_history("p0") == [(2, 8)] * 3
        assert history.prompt_history(default_prompt_key(prompts[1])) == [(2, 8)] * 3
    assert [o.prompt_index for o in outs] == [0, 1] and [o.prompt_key for o in outs] == ["p0", default_prompt_key(prompts[1])]
    for i, o in enumerate(outs):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert [c.seed for c in o.outputs] == [5 + 3 * i + s for s in range(3)]
        for c in o.outputs:
            assert len(c.token_ids) == len(c.logprobs) == 8 and c.finish_reason == "length"
            assert abs(sum(c.logprobs) - c.cumulative_logprob) < 1e-5 and max(c.logprobs) <= 0
    assert len({tuple(c.token_ids) for o in outs for c in o.outputs}) > 3  # different draws
    assert summary.completions == 6 and summary.output_tokens == 48 and summary.makespan_s > 0
    assert summary.mean_accepted_tokens >= 1.0 and summary.as_dict()["tokens_per_s"] > 0
    with tiny_llm() as again:  # the same seeds, a fresh engine: the same samples
        outs2 = again.generate(prompts, params, prompt_keys=["p0", None], policy_version=2, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs2] == [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.usefixtures("one_thread")
def test_bad_input_raises_before_anything_runs():
    with tiny_llm() as llm:
        with pytest.raises(ValueError, match="prompt 1"):
            llm.generate([[1, 2], [V + 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="prompt_keys"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2), prompt_keys=["a", "b"], use_tqdm=False)
        with pytest.raises(ValueError, match="prompt_key"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2), prompt_keys=["a\x00"], use_tqdm=False)
        with pytest.raises(ValueError, match="max_tokens"):  # longer than the engine's max_len
            llm.generate([[1, 2]], SamplingParams(n=2, max_tokens=80), use_tqdm=False)
        assert not llm.engine.has_work()
        # The engine's own SamplingParams works too (one sample each).
        outs = llm.generate([[1, 2]], sampling.SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(outs[0].outputs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="n: expected"):
        SamplingParams(n=0)


def test_prompt_files(tmp_path):
    codec = tiny_lm(vocab_size=V).codec
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "t1 t2 t3"}, {"id": 7, "prompt_ids": [4, 5]},
            {"id": "c", "messages": [{"role": "user", "content": "t3"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ps = read_prompts(path, codec, V, key_field="id")
    assert [p.prompt_key for p in ps] == ["a", "7", "c"] and ps[0].prompt_ids == [1, 2, 3] and ps[1].prompt_ids == [4, 5]
    assert len(ps[2].prompt_ids) > 1  # through the chat template
    assert [p.prompt_key for p in read_prompts(path, codec, V)] == [None] * 3
    for bad, words in (('{"prompt": "t1", "prompt_ids": [1]}', "exactly one of"), ('{"text": "t1"}', "exactly one of"),
                       ("[1, 2]", "JSON object"), ("{oops", "not valid JSON"), ('{"prompt_ids": [99]}', "token ids"),
                       ('{"prompt": ""}', "non-empty"), ('{"messages": []}', "messages")):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=words):
            read_prompts(path, codec, V)
    path.write_text('{"prompt": "t1"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: no prompt key field 'id'"):
        read_prompts(path, codec, V, key_field="id")
    path.write_text('{"prompt": "t1", "id": "a\\tb"}\n')
    with pytest.raises(ValueError, match="id"):
        read_prompts(path, codec, V, key_field="id")


def _req(rid: str, expected: float | None) -> Request:
    r = Request(rid, [1], sampling.SamplingParams())
    r.expected_len = expected
    return r


def test_longest_expected_first_admission():
    s = Scheduler(2, 2, longest_first=True)
    for rid, e in (("a", None), ("b", 10.0), ("c", 50.0), ("d", None), ("e", 30.0)):
        s.add(_req(rid, e))
    assert [r.req_id for r in s.admit()] == ["c", "e"]
    fifo = Scheduler(2, 2)
    for rid, e in (("a", None), ("b", 10.0), ("c", 50.0)):
        fifo.add(_req(rid, e))
    assert [r.req_id for r in fifo.admit()] == ["a", "b"]


def test_expected_length_reads_the_newest_versions_history():
    c = NgramCorpus()
    assert expected_length(c, [1, 2, 3], "k") is None
    for i, (v, n) in enumerate(((0, 40), (1, 10), (1, 20))):
        c.start_request(f"r{i}", [1, 2, 3], prompt_key="k", policy_version=v)
        c.extend(f"r{i}", list(range(5, 5 + n)))
        c.finish(f"r{i}")
    assert expected_length(c, [9], "k") == 15.0
    c.start_request("d", [7, 8], policy_version=0)
    c.extend("d", [1, 2, 3, 4])
    c.finish("d")
    assert expected_length(c, [7, 8], None) == 4.0  # the default key: a hash of the prompt ids


@pytest.mark.usefixtures("one_thread")
def test_the_tail_drafts_the_tail_budget():
    with tiny_llm(max_batch=4, budget="2", max_budget=7, tail_requests=2, tail_budget=6) as llm:
        e = llm.engine
        batch = [SimpleNamespace()] * 4  # the budget reads only the batch's size here
        assert e._decide_budget(batch) == 2 and e._decide_budget(batch[:2]) == 6 and e._decide_budget(batch[:1]) == 6
        e.add_request([1, 2], sampling.SamplingParams(max_tokens=2))
        e._take_inbox()  # one request waits: not the tail
        assert e._decide_budget(batch[:1]) == 2
        while e.has_work():
            e.step()
        assert e.makespan.periods == 1 and e.makespan.last_s > 0
    with pytest.raises(ValueError, match="tail_budget"):
        tiny_llm(max_budget=7, tail_budget=9)
    with pytest.raises(ValueError, match="tail_requests"):
        MakespanConfig(tail_requests=-1)


def test_makespan_clock():
    c = MakespanClock()
    c.busy(False)
    assert c.periods == 0
    c.start()
    c.start()  # a running period keeps its start
    assert c.current_s >= 0
    c.busy(True)
    c.busy(False)
    assert c.periods == 1 and c.last_s > 0 and c.current_s == 0.0
