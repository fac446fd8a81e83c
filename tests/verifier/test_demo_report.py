"""The demo's figures (issue 26, point 3): both engines' steps alternate (a slow spell of the
machine falls on both), the outputs are compared, and the speed-up is printed only where drafts
were accepted, with what it is made of; with nothing accepted the demo says so (it printed
"speed-up 2.12x" with 0 draft tokens accepted, and 0.83x on a rerun)."""

import re

import pytest

from verifier.budget.policy import CostModel
from verifier.demo import DemoConfig, Tally, explain, run_interleaved
from verifier.draft.drafter import Drafter
from verifier.engine.core import Engine, EngineConfig

from tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5, 6], [2, 3, 2, 3, 2, 3, 2]]


def _engines(budget):
    lm = tiny_lm(vocab_size=16, seed=3)
    plain = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=1, max_len=128, budget=0))
    spec = Engine(lm.model, lm.codec, Drafter(vocab_size=16),
                  EngineConfig(max_batch=1, max_len=128, budget=budget, max_budget=4),
                  cost=CostModel([1, 2, 4, 8], [1e-3, 1e-3, 1.1e-3, 1.3e-3]))
    return plain, spec


@pytest.mark.usefixtures("one_thread")
def test_steps_alternate_and_the_report_explains_the_ratio():
    plain, spec = _engines(None)
    order: list[str] = []
    for name, eng in (("plain", plain), ("spec", spec)):
        step = eng.step
        eng.step = lambda step=step, name=name: order.append(name) or step()
    p, s, outs_p, outs_s = run_interleaved(plain, spec, PROMPTS, 24)
    assert outs_p == outs_s and p.tokens == s.tokens > 3  # greedy: token-identical (eos may end one early)
    assert p.seconds > 0 and s.seconds > 0 and s.steps <= p.steps
    # Alternating (no run of one engine while the other still has work), the speculative one first on odd prompts.
    assert order[:2] == ["plain", "spec"]
    pairs = [order[i:i + 2] for i in range(0, min(10, len(order)), 2)]
    assert all(sorted(pr) == ["plain", "spec"] for pr in pairs)
    lines = explain(p, s, spec)
    text = "\n".join(lines)
    assert "plain decoding:" in text and "speculative decoding:" in text and "accepted drafts:" in text
    assert "budget policy:" in text and "cost model" in text
    # The step counts read as parts of one whole: steps, those that asked for a draft tree, those that
    # verified draft tokens (once printed as "22 of 122 steps verified drafts" beside "114 remote").
    m = re.search(r"steps: +(\d+) verify steps; (\d+) asked the corpus for a draft tree \((\d+) remote, (\d+) in "
                  r"process, (\d+) in-process fallback\), (\d+) did not \(the budget policy decoded plainly\); (\d+) "
                  r"of the (\d+) verified draft tokens \(the other (\d+): an empty tree", text)
    assert m, text
    steps, asked, remote, local, fallback, plain_steps, verified, asked_again, other = map(int, m.groups())
    d = spec.drafter.stats
    assert (steps, asked, verified) == (s.steps, d.remote_steps + d.local_steps + d.fallback_steps, s.verified)
    assert (remote, local, fallback) == (d.remote_steps, d.local_steps, d.fallback_steps)
    assert asked_again == asked == remote + local + fallback and asked + plain_steps == steps
    assert verified == spec.stats.spec_steps and verified + other == asked and verified > 0
    if s.accepted:  # the tiny random model accepts few drafts, but these prompts repeat
        m = re.search(r"speed-up: +([0-9.]+)x = speculative tok/s / plain tok/s", text)
        assert m and float(m.group(1)) == pytest.approx(s.tok_s / p.tok_s, abs=0.006)
        assert "fewer steps, each" in text
    else:
        assert "none to report" in text


@pytest.mark.usefixtures("one_thread")
def test_with_nothing_accepted_no_ratio_is_printed():
    plain, spec = _engines(0)
    p, s = Tally(2.0, 64, 62, 0), Tally(1.0, 64, 62, 0)  # twice as fast, by noise alone
    text = "\n".join(explain(p, s, spec))
    assert "none to report: no draft token was accepted" in text
    assert not re.search(r"[0-9]x", text.split("speed-up:")[1].splitlines()[0])
    assert "fixed, 0 draft nodes" in text


def test_demo_config_checks_its_fields():
    with pytest.raises(ValueError):
        DemoConfig(budget="9", max_budget=7)
    with pytest.raises(ValueError):
        DemoConfig(prompts=0)
    assert DemoConfig().prompts == 6 and DemoConfig().budget == "auto"
