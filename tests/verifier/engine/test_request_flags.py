"""The per-request flags ``Engine.add_request`` fixes for the hot path (``Request.as_run``,
``stops``, ``plain_greedy``) against what they stand for, computed from the params and the grammar
as the engine computed them every step before: the commit and step-shape decisions stay the same."""

import pytest

from verifier.engine.core import Engine
from verifier.engine.request import Request, stop_tokens
from verifier.step.penalties import needs_processing
from verifier.step.sampling import SamplingParams
from verifier.step.structured_spec import GrammarSpec
from tests.verifier.engine_fixtures import engine

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

PARAMS = [
    SamplingParams(max_tokens=8),
    SamplingParams(max_tokens=8, stop=("\n",)),
    SamplingParams(max_tokens=8, stop_token_ids=(5, 9), ignore_eos=True),
    SamplingParams(max_tokens=8, logprobs=2),
    SamplingParams(max_tokens=8, presence_penalty=0.5),
    SamplingParams(max_tokens=8, repetition_penalty=1.1),
    SamplingParams(max_tokens=8, min_tokens=3),
    SamplingParams(max_tokens=8, temperature=0.8, seed=1),
    SamplingParams(max_tokens=8, grammar=GrammarSpec.json_schema(SCHEMA)),
]


@pytest.mark.parametrize("params", PARAMS, ids=range(len(PARAMS)))
def test_flags_match_the_params_and_grammar(smollm2, params):
    eng = engine(smollm2, None)
    req = eng.add_request([1, 2, 3], params)
    assert req.as_run == (params.logprobs is None and req.grammar is None and not params.stop)
    assert req.stops == stop_tokens(params, eng.eos_ids)
    for out in ([], [4], [4, 5, 6]):  # min_tokens: processed until that many tokens exist
        req.output_ids[:] = out
        expected = params.greedy and req.grammar is None and not needs_processing(req)
        assert Engine._greedy_only([req]) == expected


def test_a_request_made_elsewhere_takes_the_general_path():
    req = Request("r", [1], SamplingParams(max_tokens=4))
    assert not req.as_run and not Engine._greedy_only([req])
