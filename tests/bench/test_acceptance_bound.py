"""bench/acceptance.py's perfect-ranking bound: no B-node tree of the engine's candidates beats it."""

from bench.acceptance import BOUND_WIDTH, bound_config, captured, replay_engine
from bench.traces import REPO, load_traces
from corpus_service import CorpusConfig

TRACE = REPO / "bench" / "data" / "traces" / "humaneval164_t07x4.jsonl"


def test_the_bound_holds_every_b_node_tree():
    traces = load_traces(TRACE, limit=12)
    config = CorpusConfig()
    bounds = {}
    for budget in (1, 3, 7):
        ours = replay_engine(traces, budget, config, 1)
        bound = bounds[budget] = replay_engine(traces, BOUND_WIDTH, bound_config(config, budget), 1)
        # At each step the bound's tree holds every path of the candidates to depth B (a B-node
        # tree holds some of them), so on these requests it accepts at least as much; no step
        # accepts more than B drafts and the bonus token.
        assert ours["mat"] <= bound["mat"] <= budget + 1
        assert 0.0 <= captured(ours, bound) <= 1.0
    # A deeper cut can only find more.
    assert bounds[1]["mat"] <= bounds[3]["mat"] <= bounds[7]["mat"]


def test_bound_config_opens_the_search_and_keeps_the_rest():
    config = CorpusConfig(learned_weight=0.3)
    bc = bound_config(config, 15)
    assert bc.max_depth == 15 and bc.max_candidates == 1024 and bc.enough_candidates == 0
    assert bc.weak_weight == 0.0 and bc.min_prob == 0.0 and bc.learned_weight == 0.3
