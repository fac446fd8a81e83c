"""``append_run`` (a verify step's committed run appended as one slice) against ``append_tokens``
(one token at a time, the reference) on random runs, stop tokens, eos and max_tokens: the same
output, status, finish reason and text."""

from hypothesis import given, settings
from hypothesis import strategies as st

from verifier.engine.request import Request, Status, append_run, append_tokens, stop_tokens
from verifier.step.sampling import SamplingParams

EOS = (2, 7)


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


@settings(max_examples=400, deadline=None)
@given(before=st.lists(st.integers(0, 9), max_size=6), run=st.lists(st.integers(0, 9), min_size=1, max_size=8),
       extra=st.integers(1, 8), stops=st.lists(st.integers(0, 9), max_size=2), ignore_eos=st.booleans())
def test_append_run_equals_appending_token_by_token(before, run, extra, stops, ignore_eos):
    params = SamplingParams(max_tokens=len(before) + extra, stop_token_ids=tuple(stops), ignore_eos=ignore_eos)
    a, b = (Request("r", [1], params, output_ids=list(before), status=Status.RUNNING) for _ in range(2))
    append_tokens(a, list(run), EOS, decode)
    n = append_run(b, list(run), stop_tokens(params, EOS), decode)
    assert b.output_ids == a.output_ids and n == len(a.output_ids) - len(before)
    assert (b.status, b.finish_reason, b.text) == (a.status, a.finish_reason, a.text)
    assert (b.first_token_at is None) == (a.first_token_at is None)


def test_stop_tokens_include_eos_unless_ignored():
    assert stop_tokens(SamplingParams(stop_token_ids=(4,)), EOS) == {2, 4, 7}
    assert stop_tokens(SamplingParams(stop_token_ids=(4,), ignore_eos=True), EOS) == {4}
