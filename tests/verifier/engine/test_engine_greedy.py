"""Lossless speculation: greedy speculative output is token-identical to plain greedy decoding
(fp32, CPU, the real SmolLM2) with the in-process corpus and with a real corpus server."""

import pytest
from engine_fixtures import GREEDY, MAX_TOKENS, engine

from verifier.draft.drafter import DraftConfig, Drafter
from verifier.step.sampling import SamplingParams


@pytest.fixture(scope="module")
def prompts(trace_rows):
    return [r["prompt_ids"] for r in trace_rows[:4]]


@pytest.fixture(scope="module")
def plain_outputs(smollm2, prompts):
    reqs = engine(smollm2, None).generate(prompts, GREEDY)
    assert all(r.verify_steps == len(r.output_ids) - 1 for r in reqs if r.finish_reason == "length")
    return [r.output_ids for r in reqs]


def check_lossless(eng, prompts, plain_outputs):
    reqs = eng.generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == plain_outputs
    accepted = sum(r.accepted_tokens for r in reqs)
    steps = sum(r.verify_steps for r in reqs)
    assert eng.stats.draft_tokens > 0 and accepted > 0, "the corpus drafted nothing useful"
    assert steps < sum(len(o) for o in plain_outputs) - len(prompts)  # fewer forwards than tokens
    return reqs


def test_local_corpus_is_lossless_with_continuous_batching(smollm2, prompts, plain_outputs):
    """Two slots for four requests: they join and leave between steps; outputs do not change."""
    drafter = Drafter(vocab_size=smollm2.model.config.vocab_size)
    check_lossless(engine(smollm2, drafter, max_batch=2), prompts, plain_outputs)
    assert drafter.stats.local_steps > 0


def test_graph_path_is_lossless(smollm2, prompts, plain_outputs):
    """The CUDA-graph path run eagerly (``emulate_graphs``): batch rows padded to a bucket (3
    requests in a bucket of 4), trees padded to node buckets, cache rows to KV buckets, and the
    whole greedy step (indices, mask, forward, verification, KV compaction) as one static-shape
    computation. Plain decoding on it and speculation on it both give the plain outputs."""
    for drafter in (None, Drafter(vocab_size=smollm2.model.config.vocab_size)):
        eng = engine(smollm2, drafter, emulate_graphs=True)
        reqs = eng.generate(prompts[:3], GREEDY)
        assert [r.output_ids for r in reqs] == plain_outputs[:3]
        assert eng.graphs is not None and eng.graphs.num_graphs > 0
    assert eng.stats.accepted_tokens > 0 and eng.stats.spec_steps > 0


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_remote_corpus_is_lossless(smollm2, prompts, plain_outputs, corpus_server, mode):
    draft = DraftConfig(draft_timeout_s=2.0, corpus_timeout_s=5.0, remote_drafts=mode)
    drafter = Drafter(corpus_server.target, draft, vocab_size=smollm2.model.config.vocab_size)
    try:
        check_lossless(engine(smollm2, drafter), prompts, plain_outputs)
        assert drafter.stats.remote_steps > 0 and drafter.stats.fallback_steps == 0
    finally:
        drafter.close()


def test_sampling_is_seeded_and_stops(smollm2, prompts):
    """Exact tree rejection sampling (temperature/top-p/top-k) next to a greedy request; the same
    seeds with the same drafts give the same tokens."""
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=7, stop=("\n\n\n",)),
              SamplingParams(max_tokens=10)]
    runs = []
    for _ in range(2):
        drafter = Drafter(vocab_size=smollm2.model.config.vocab_size)
        runs.append(engine(smollm2, drafter).generate(prompts[:2], params))
    (a, g), (a2, g2) = runs
    assert 1 <= len(a.output_ids) <= 10 and a.output_ids == a2.output_ids
    assert g.output_ids == g2.output_ids and a.finish_reason in ("length", "stop")


def test_processed_steps_share_the_plan_and_forward_part(smollm2, prompts):
    """Steps whose logits are processed (a presence penalty) are planned by pack_plan like every
    step: with graphs (``emulate_graphs``) into a forward graph's padded input (batch, node and
    cache-row buckets), without graphs at the step's exact shape (K = the widest tree, no node
    bucket: padding would add compute on the CPU). The logits are processed and verified eagerly,
    and both give plain decoding's outputs."""
    params = SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.5)
    plain = [r.output_ids for r in engine(smollm2, None).generate(prompts[:3], params)]
    for graphs in (False, True):
        eng = engine(smollm2, Drafter(vocab_size=smollm2.model.config.vocab_size), emulate_graphs=graphs)
        shapes, plan = [], eng._plan

        def recording(*args, plan=plan, shapes=shapes):
            packed, inp = plan(*args)
            shapes.append((packed.K, max(packed.num_nodes), inp))
            return packed, inp

        eng._plan = recording
        reqs = eng.generate(prompts[:3], params)
        assert [r.output_ids for r in reqs] == plain
        assert eng.stats.accepted_tokens > 0 and any(K > 1 for K, _, _ in shapes)
        if graphs:
            assert all(inp is not None and inp.forward_only and inp.K == K for K, _, inp in shapes)
        else:
            assert all(inp is None and K == widest for K, widest, inp in shapes)
