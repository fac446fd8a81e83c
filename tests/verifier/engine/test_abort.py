"""Aborts on the real SmolLM2 (CPU): a request aborted while it waits, or while an earlier prefill
forward of its step runs, is finished without a prefill of its own; the queue's load follows."""

from engine_fixtures import engine

from verifier.engine.core import CPU_PREFILL_TOKENS
from verifier.step.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def prompts(smollm2, n: int, tokens: int) -> list[list[int]]:
    ids = smollm2.codec.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    return [[(t + i) % 1000 + 10 for t in (ids * (tokens // len(ids) + 1))[:tokens]] for i in range(n)]


def test_an_abort_during_an_earlier_prefill_forward_skips_its_own(smollm2):
    e = engine(smollm2, None, max_batch=2)
    tokens = CPU_PREFILL_TOKENS // 2 + 8  # two prompts do not fit one CPU forward
    a, b = (e.add_request(p, PARAMS) for p in prompts(smollm2, 2, tokens))
    assert e.waiting_load() == (2, 2 * (tokens + PARAMS.max_tokens))
    forwards = []
    prefill = e._prefill

    def prefill_then_abort(chunk):  # the client of b leaves while a's forward runs
        forwards.append([r.req_id for r in chunk])
        prefill(chunk)
        e.abort(b.req_id)

    e._prefill = prefill_then_abort
    e.step()
    assert forwards == [[a.req_id]] and e.stats.prefill_tokens == tokens
    assert b.finished and b.finish_reason == "abort" and b.output_ids == []
    assert not a.finished and e.waiting_load() == (0, 0)
    e._prefill = prefill
    while not a.finished:
        e.step()
    assert a.finish_reason == "length" and e.scheduler.num_unfinished == 0 and e.num_live() == 0


def test_requests_aborted_while_waiting_leave_without_a_prefill(smollm2):
    e = engine(smollm2, None, max_batch=1)
    first, *queued = (e.add_request(p, PARAMS) for p in prompts(smollm2, 4, 20))
    e.step()  # first runs, three wait
    assert e.waiting_load() == (3, 3 * 24)
    for r in queued[:2]:
        e.abort(r.req_id)
    e.step()
    assert [r.finish_reason for r in queued[:2]] == ["abort", "abort"] and e.waiting_load() == (1, 24)
    assert e.stats.prefill_tokens == 20  # only the first was prefilled
    assert e.abort_all() == 2  # the running one and the last queued one
    e.step()
    assert first.finish_reason == queued[2].finish_reason == "abort"
    assert e.waiting_load() == (0, 0) and e.num_live() == 0 and e.stats.prefill_tokens == 20
