"""Overlapped plain decoding (EngineConfig.overlap_plain): each step is launched before the
previous one's tokens are committed, its input tokens taken from the previous step's predictions
on the device. Run here on the graph path executed eagerly (``emulate_graphs``): the outputs,
finish reasons and stops must be exactly those of the same engine stepping one step at a time,
with continuous batching, requests finishing at different steps, and aborts."""

import pytest

from verifier.engine.core import Engine, EngineConfig
from verifier.step.sampling import SamplingParams

from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)


def _engine(lm, overlap: bool, max_batch: int = 3) -> Engine:
    return Engine(lm.model, lm.codec, None, EngineConfig(max_batch=max_batch, max_len=128, budget=0,
                                                         emulate_graphs=True, overlap_plain=overlap))


def _record_fed_launches(eng: Engine) -> list[bool]:
    """Per greedy-step launch: whether its input tokens came from the previous step on the device."""
    fed: list[bool] = []
    launch = eng.graphs.launch_greedy_step
    eng.graphs.launch_greedy_step = lambda *a, **k: fed.append(k.get("tokens_from") is not None) or launch(*a, **k)
    return fed


def _prompts():
    return [[1, 2, 3], [4, 5], [6, 1, 2, 3, 4], [2], [3, 3, 3, 1], [5, 6, 7, 1], [1, 1]]


def _params():
    # Different lengths, an eos the model can emit (id 15), a stop string and a stop token.
    return [SamplingParams(max_tokens=n, stop=["t9 t9"] if i == 2 else (),
                           stop_token_ids=[11] if i == 4 else ()) for i, n in enumerate([5, 9, 12, 3, 20, 7, 16])]


@pytest.mark.usefixtures("one_thread")
def test_overlapped_plain_decoding_equals_step_by_step():
    lm = tiny_lm(vocab_size=16, seed=3)
    want = _engine(lm, overlap=False).generate(_prompts(), _params())
    eng = _engine(lm, overlap=True)
    fed = _record_fed_launches(eng)
    got = eng.generate(_prompts(), _params())
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert sum(fed) > len(fed) // 2  # most steps really ran ahead of the host
    assert eng.stats.generated_tokens == sum(len(r.output_ids) for r in want)


@pytest.mark.usefixtures("one_thread")
def test_abort_while_a_step_is_in_flight():
    lm = tiny_lm(vocab_size=16, seed=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _engine(lm, overlap=False).generate(_prompts()[:2], params)
    eng = _engine(lm, overlap=True)
    a = eng.add_request(_prompts()[0], params)
    b = eng.add_request(_prompts()[1], params)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    eng.abort(b.req_id)
    cut = len(b.output_ids)
    while eng.has_work():
        eng.step()
    assert b.finish_reason == "abort" and len(b.output_ids) == cut  # nothing committed after the abort
    assert b.output_ids == want[1].output_ids[:cut]
    assert a.finish_reason == "length" and a.output_ids == want[0].output_ids


@pytest.mark.usefixtures("one_thread")
def test_overlap_off_for_logprobs_and_on_config():
    lm = tiny_lm(vocab_size=16, seed=3)
    eng = _engine(lm, overlap=True)
    r = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True))[0]
    assert len(r.logprobs) == 4 and eng._inflight is None  # logits are read each step: no overlap
    from verifier.config import VerifierConfig

    assert VerifierConfig().engine_config().overlap_plain is True  # the default (measured on the H200)
    assert VerifierConfig(overlap_plain=False).engine_config().overlap_plain is False
    assert VerifierConfig().engine_config().overlap_spec_plain is True  # measured on the H200 too
    assert VerifierConfig(overlap_spec_plain=False).engine_config().overlap_spec_plain is False


@pytest.mark.usefixtures("one_thread")
def test_a_queue_keeps_the_overlap_and_refills_match():
    """More requests than slots: while the queue waits for a slot, steps still run ahead; the
    outputs equal step-by-step decoding's."""
    lm = tiny_lm(vocab_size=16, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 14, 9, 11, 4, 8, 13)]
    want = _engine(lm, overlap=False, max_batch=2).generate(_prompts(), params)
    eng = _engine(lm, overlap=True, max_batch=2)
    fed = _record_fed_launches(eng)
    got = eng.generate(_prompts(), params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert sum(fed) > len(fed) // 2


@pytest.mark.usefixtures("one_thread")
def test_a_speculative_engine_overlaps_its_plain_steps_and_drains_before_drafting():
    """With a drafter, the steps the budget policy does not draft run overlapped; a drafting step
    first commits the step in flight. Greedy outputs equal plain decoding's whatever the mix, the
    corpus learns every committed token, and each step's decision is taken once."""
    import itertools

    from verifier.draft.drafter import Drafter

    lm = tiny_lm(vocab_size=16, seed=3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 22, 9, 17, 30, 11, 25)]
    want = _engine(lm, overlap=False).generate(_prompts(), params)
    drafter = Drafter(vocab_size=16)
    eng = Engine(lm.model, lm.codec, drafter, EngineConfig(max_batch=3, max_len=128, max_budget=4,
                                                           emulate_graphs=True, overlap_spec_plain=True))
    decisions = itertools.cycle([0, 0, 0, 4, 0, 4, 4])  # plain runs, and drafting steps between them
    asked: list[int] = []
    eng.policy.draft_budget = lambda bs, critical=None: asked.append(bs) or next(decisions)
    fed = _record_fed_launches(eng)
    got = eng.generate(_prompts(), params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert sum(fed) > 0 and eng.stats.spec_steps > 0  # both kinds of step ran
    # One decision per step; a second only where committing the step in flight finished a request
    # (the batch size changed).
    assert len(asked) <= eng.stats.steps + len(params)
    rates = eng.policy.delivered_rates()
    assert any(k.endswith("_plain") for k in rates)  # overlapped plain steps are seen by the policy
    drafter.start_request("probe", got[4].output_ids[:6])  # the learned corpus holds the outputs
    assert drafter.draft(["probe"], 4).tree(0)[0][:1] == [got[4].output_ids[6]]


@pytest.mark.usefixtures("one_thread")
def test_plain_steps_are_credited_their_steady_state_not_the_switching():
    """An overlapped plain step commits its tokens one step later. The policy's plain figure counts
    plain steps that follow a plain step (the steady state a run of them reaches), never the step
    that restarts the pipeline (no tokens yet) nor the drain before a drafting step (a lone plain
    step waits for its own results: on the H200 that made plain decoding look 30% slower at batch
    64, and drafting stayed on where it lost). Without overlap every plain step counts."""
    import itertools

    from verifier.draft.drafter import Drafter

    lm = tiny_lm(vocab_size=16, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for on, pattern in ((True, [0, 4]), (True, [0, 0, 0, 4]), (False, [0, 4])):
        eng = Engine(lm.model, lm.codec, Drafter(vocab_size=16),
                     EngineConfig(max_batch=2, max_len=128, max_budget=4, emulate_graphs=True, overlap_spec_plain=on))
        decisions = itertools.cycle(pattern)
        eng.policy.draft_budget = lambda bs, critical=None: next(decisions)
        overlapped, seen = [], []
        step = eng._overlapped_step
        eng._overlapped_step = lambda running: overlapped.append(len(running)) or step(running)
        observe = eng.policy.observe_delivered
        eng.policy.observe_delivered = lambda bs, drafted, s, n: seen.append((drafted, n)) or observe(bs, drafted, s, n)
        eng.generate(_prompts()[:2], params)
        plain, drafted = eng.policy.delivered(2, False), eng.policy.delivered(2, True)
        assert drafted is not None and (len(overlapped) > 0) == on  # overlapped steps only when asked for
        assert eng.policy.explore_run == (3 if on else 1)  # runs of plain steps only where they overlap
        if on and pattern == [0, 4]:
            assert plain is None  # lone plain steps: all switching, no steady state to credit
            continue
        # Both modes commit about a token per request per step here (the tiny model's drafts are
        # rarely accepted): comparable rates, and every plain step credited committed tokens.
        assert plain is not None and plain > 0.2 * drafted
        assert all(n > 0 for d, n in seen if not d)


@pytest.mark.gpu
def test_overlapped_plain_decoding_on_captured_graphs_cuda():
    """The same on a CUDA device: captured graphs, pinned result buffers read after an event,
    input tokens copied device to device."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tiny_lm import tiny_lm_cuda

    lm = tiny_lm_cuda(vocab_size=64, seed=5)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 30, 9, 17, 4, 25, 13)]
    outs = []
    for overlap in (False, True):
        eng = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=3, max_len=128, budget=0, overlap_plain=overlap))
        outs.append([r.output_ids for r in eng.generate(_prompts(), params)])
    assert outs[1] == outs[0]
    # A speculative engine whose policy alternates plain (overlapped) and drafting steps.
    import itertools

    from verifier.draft.drafter import Drafter

    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=64),
                 EngineConfig(max_batch=3, max_len=128, max_budget=4, overlap_spec_plain=True))
    decisions = itertools.cycle([0, 0, 4, 0, 4])
    eng.policy.draft_budget = lambda bs, critical=None: next(decisions)
    assert [r.output_ids for r in eng.generate(_prompts(), params)] == outs[0]


@pytest.mark.usefixtures("one_thread")
def test_abort_of_a_waiting_request_and_steps_with_nothing_new():
    """A request aborted while it waits for a slot finishes at once and never runs; requests that
    arrive later still join; steps where nothing arrived change nothing in the queue."""
    lm = tiny_lm(vocab_size=16, seed=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eng = _engine(lm, overlap=True, max_batch=1)
    a = eng.add_request(_prompts()[0], params)
    b = eng.add_request(_prompts()[1], params)
    c = eng.add_request(_prompts()[2], params)
    eng.step()
    assert [r.req_id for r in eng.scheduler.waiting] == [b.req_id, c.req_id]
    eng.step()  # nothing arrived: the queue stays as it was
    assert [r.req_id for r in eng.scheduler.waiting] == [b.req_id, c.req_id]
    eng.abort(b.req_id)
    done = eng.step()
    assert b in done and b.finish_reason == "abort" and b.output_ids == []
    assert [r.req_id for r in eng.scheduler.waiting] == [c.req_id]
    d = eng.add_request(_prompts()[3], params)
    while eng.has_work():
        eng.step()
    assert [r.finish_reason for r in (a, c, d)] == ["length"] * 3 and b.output_ids == []
    assert [len(r.output_ids) for r in (a, c, d)] == [6, 6, 6]
