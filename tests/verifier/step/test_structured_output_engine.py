"""Structured output under speculation on the real SmolLM2 (fp32, CPU): greedy output with
speculation equals output without it, the draft tree is pruned by the grammar, and the output
parses (JSON schema validated with jsonschema, regex and EBNF matched)."""

import json
import re

import jsonschema
import pytest
from engine_fixtures import engine

from corpus_service import NgramCorpus
from verifier.draft.drafter import Drafter
from verifier.step.sampling import SamplingParams
from verifier.step.structured_spec import GrammarSpec

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
# Text the corpus has seen: near-JSON the grammar must refuse (unquoted values, an extra key) next
# to the valid form, so drafts hold both accepted and pruned branches.
SEEN = ['{"name": "Alice", "age": thirty, "city": Paris}',
        '{"name": "Alice", "age": 30, "city": "Paris", "country": "France"}',
        '{"name": "Bob", "age": 42, "city": "Berlin"}']


def chat(lm, text: str) -> list[int]:
    return lm.codec.encode(lm.codec.apply_chat_template([{"role": "user", "content": text}]))


def seeded_drafter(lm) -> Drafter:
    corpus = NgramCorpus(vocab_size=lm.model.config.vocab_size)
    for i, text in enumerate(SEEN):
        corpus.start_request(f"seen-{i}", lm.codec.encode("Here it is: "))
        corpus.extend(f"seen-{i}", lm.codec.encode(text))
        corpus.finish(f"seen-{i}")
    return Drafter(corpus)


def run_both(lm, prompts, params):
    plain = engine(lm, None).generate(prompts, params)
    eng = engine(lm, seeded_drafter(lm), budget=8)
    spec = eng.generate(prompts, params)
    return plain, spec, eng


def test_json_schema_greedy_speculation_is_lossless_and_validates(smollm2):
    prompts = [chat(smollm2, "Describe Alice, 30, who lives in Paris, as JSON with keys name, age and city."),
               chat(smollm2, "Give Bob (42, Berlin) as a JSON object: name, age, city.")]
    params = SamplingParams(max_tokens=40, grammar=GrammarSpec.json_schema(SCHEMA))
    plain, spec, eng = run_both(smollm2, prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    for r in spec:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert eng.stats.draft_tokens > 0 and sum(r.accepted_tokens for r in spec) > 0, "nothing drafted or accepted"
    assert sum(r.grammar.pruned_nodes for r in spec) > 0, "the grammar pruned no draft node"
    assert sum(r.verify_steps for r in spec) < sum(r.verify_steps for r in plain)


def test_regex_ebnf_and_free_requests_in_one_batch(smollm2):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    prompts = [chat(smollm2, "The office phone is (555) 123-4567. What is the office phone number?"),
               chat(smollm2, "Is Paris the capital of France? Answer yes or no."),
               chat(smollm2, "Name a color.")]
    params = [SamplingParams(max_tokens=24, grammar=GrammarSpec("regex", phone)),
              SamplingParams(max_tokens=24, grammar=GrammarSpec("ebnf", 'root ::= answer "."\nanswer ::= "yes" | "no"')),
              SamplingParams(max_tokens=8)]
    plain, spec, _ = run_both(smollm2, prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert re.fullmatch(phone, spec[0].text) and spec[0].finish_reason == "stop", spec[0].text
    assert spec[1].text in ("yes.", "no.") and spec[1].finish_reason == "stop", spec[1].text
    assert spec[2].grammar is None and spec[2].finish_reason == "length"


def test_sampled_output_obeys_the_grammar_under_speculation(smollm2):
    pattern = r"[A-Z][a-z]+ is [0-9]{1,3} years old\."
    prompts = [chat(smollm2, "How old is Alice? She is 30 years old. Answer in one sentence.")] * 2
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=s, grammar=GrammarSpec("regex", pattern))
              for s in (1, 2)]
    eng = engine(smollm2, seeded_drafter(smollm2), budget=8)
    for r in eng.generate(prompts, params):
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


def test_a_bad_grammar_is_refused_before_it_runs(smollm2):
    eng = engine(smollm2, None)
    with pytest.raises(ValueError, match="regex"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(")))
    assert not eng.has_work()
