"""The CUDA-graph runner's padded forward part (a forward graph from packed step input): batch
rows padded to a bucket write only into the scratch slot, KV buckets attend nothing extra, and the
logits of the real rows equal the eager forward's. On the CPU the runner computes exactly what a
graph would replay (without capturing); on a CUDA machine the same checks run against captured
graphs (``-m gpu``)."""

import numpy as np
import pytest
import torch

from verifier.model import ForwardBatch, KVCache, ModelConfig, build_model
from verifier.step.cuda_graphs import GraphRunner, next_bucket, pow2_buckets

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
MAX_BATCH, MAX_LEN = 5, 64


def test_buckets():
    assert pow2_buckets(1, 5) == (1, 2, 4, 5) and pow2_buckets(16, 64) == (16, 32, 64)
    assert next_bucket(3, (1, 2, 4, 5)) == 4 and next_bucket(5, (1, 2, 4, 5)) == 5
    with pytest.raises(ValueError, match="largest bucket"):
        next_bucket(6, (1, 2, 4, 5))


def _setup(device):
    torch.manual_seed(0)
    model = build_model(CFG, None, device, torch.float32)
    caches = [KVCache(2, MAX_BATCH + 1, MAX_LEN, 2, 8, device, torch.float32) for _ in range(2)]
    for c in caches:  # distinct, recognizable contents in every slot
        c.data.copy_(torch.randn(c.data.shape, generator=torch.Generator().manual_seed(1)).to(device))
    return model, caches


def _step(device, slots, prefixes, K, kv_len):
    bs = len(slots)
    prefix = torch.tensor(prefixes, device=device)
    rows = prefix[:, None] + torch.arange(K, device=device)
    tree = torch.ones(K, K, dtype=torch.bool, device=device).tril()  # a chain
    mask = torch.zeros(bs, K, kv_len, dtype=torch.bool, device=device)
    for b, p in enumerate(prefixes):
        mask[b, :, :p] = True
        mask[b, :, p:p + K] = tree
    ids = torch.randint(0, CFG.vocab_size, (bs, K), device=device)
    return ids, ForwardBatch(rows, rows, torch.tensor(slots, device=device), kv_len, mask, None)


def _packed_chains(ids, prefixes, slots) -> np.ndarray:
    """The packed step input (``tree_batch.PackedTrees.host``) of ``_step``'s chains: row b's K
    tokens ids[b], node i a child of node i - 1, after prefixes[b] cache rows of slots[b]."""
    bs, K = ids.shape
    return np.concatenate([ids.cpu().numpy().reshape(-1), np.tile(np.arange(-1, K - 1), bs), prefixes,
                           slots]).astype(np.int64)


def _check(device, capture):
    model, (eager_cache, graph_cache) = _setup(device)
    runner = GraphRunner(model, graph_cache, MAX_BATCH, scratch_slot=MAX_BATCH, min_kv=16, capture=capture)
    # Batches that shrink within one bucket (stale rows must become padding), non-consecutive
    # slots, and several K / KV buckets.
    for slots, prefixes, K in [([3, 0, 4], [20, 5, 9], 4), ([2], [30], 4), ([4, 1, 2, 0], [7, 17, 3, 40], 1), ([3, 0, 1], [33, 2, 9], 1),
                               ([1, 3], [11, 2], 7), ([0, 1, 2, 3, 4], [1, 2, 3, 4, 5], 3)]:
        kv_len = max(prefixes) + K
        ids, fb = _step(device, slots, prefixes, K, kv_len)
        want = model(ids, eager_cache, fb)
        got = runner.forward_step(_packed_chains(ids, prefixes, slots), len(slots), K, kv_len)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # Every request slot holds exactly what the eager forward wrote; only the scratch slot differs.
        real = eager_cache._view[:, :MAX_BATCH]
        torch.testing.assert_close(graph_cache._view[:, :MAX_BATCH], real, rtol=1e-5, atol=1e-5)
    assert runner.num_graphs >= 4


def test_padded_forward_matches_eager_cpu():
    _check("cpu", capture=False)


def test_runner_rejects_bad_scratch_and_mixed_launches():
    model, (cache, _) = _setup("cpu")
    with pytest.raises(ValueError, match="scratch_slot"):
        GraphRunner(model, cache, MAX_BATCH, scratch_slot=MAX_BATCH + 1)
    runner = GraphRunner(model, cache, MAX_BATCH, scratch_slot=MAX_BATCH)
    with pytest.raises(RuntimeError, match="launch_forward"):  # a forward graph's input is not a greedy step's
        runner.launch_input(runner.step_input(1, 2, 8, forward_only=True), 1)
    with pytest.raises(RuntimeError, match="forward-only"):
        runner.launch_forward(runner.step_input(1, 2, 8), 1)


@pytest.mark.gpu
def test_captured_graphs_match_eager_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check("cuda", capture=True)


def _eager_prefill(model, cache, device, prompt: list[int], slot: int) -> torch.Tensor:
    T = len(prompt)
    rows = torch.arange(T, device=device)[None]
    return model(torch.tensor([prompt], device=device), cache,
                 ForwardBatch(rows, rows, torch.tensor([slot], device=device), T, None), last_only=True)[:, 0]


def _check_prefill(device, capture):
    model, (eager_cache, graph_cache) = _setup(device)
    runner = GraphRunner(model, graph_cache, MAX_BATCH, scratch_slot=MAX_BATCH, min_kv=16, capture=capture,
                         max_prefill=32, prefill_tokens=64)
    assert runner.prefill_buckets == (16, 32) and runner.prefill_bucket(33) is None
    assert runner.max_prefill_prompts(16) == 4 and runner.max_prefill_prompts(32) == 2
    assert runner.prefill_shapes() == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32)]
    # One prompt, and several of different lengths in one graph (3 real + 1 padding row in the
    # scratch slot): each prompt's logits and cache rows are what its own eager prefill gives.
    for batch in [[(2, 5)], [(0, 16)], [(4, 17)], [(2, 31)], [(1, 3), (3, 16), (0, 9)], [(2, 20), (4, 32)]]:
        prompts = [torch.randint(0, CFG.vocab_size, (T,)).tolist() for _, T in batch]
        slots = [slot for slot, _ in batch]
        want = torch.cat([_eager_prefill(model, eager_cache, device, p, s) for p, s in zip(prompts, slots)])
        got = runner.prefill(prompts, slots)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for p, slot in zip(prompts, slots):  # the prompt's rows hold what the eager prefill wrote
            T = len(p)
            torch.testing.assert_close(graph_cache._view[:, slot, :T], eager_cache._view[:, slot, :T],
                                       rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tokens"):
        runner.prefill([list(range(33))], [0])
    with pytest.raises(ValueError, match="prompts"):
        runner.prefill([[1, 2]] * 5, [0, 1, 2, 3, 4])  # more than one graph of bucket 16 takes
    with pytest.raises(ValueError, match="slot"):
        runner.prefill([[1, 2], [3]], [0])
    with pytest.raises(ValueError, match="tokens"):
        runner.prefill([[1, 2], []], [0, 1])


def test_padded_prefill_matches_eager_cpu():
    _check_prefill("cpu", capture=False)


@pytest.mark.gpu
def test_captured_prefill_matches_eager_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_prefill("cuda", capture=True)


def test_graph_prefill_chunks_group_by_length_bucket():
    from verifier.engine.core import graph_prefill_chunks
    from verifier.engine.request import Request
    from verifier.step.sampling import SamplingParams

    model, (cache, _) = _setup("cpu")
    runner = GraphRunner(model, cache, MAX_BATCH, scratch_slot=MAX_BATCH, capture=False, max_prefill=32,
                         prefill_tokens=64)
    reqs = [Request(f"r{i}", [1] * T, SamplingParams()) for i, T in enumerate([3, 20, 5, 40, 16, 7, 30, 2, 9])]
    chunks = graph_prefill_chunks(reqs, runner, max_tokens=64)
    lens = [[len(r.prompt_ids) for r in c] for c in chunks]
    # Bucket 16 takes 4 prompts a graph, bucket 32 two; the 40-token prompt has no graph (eager).
    assert lens == [[3, 5, 16, 7], [2, 9], [20, 30], [40]]
    assert sorted(r.req_id for c in chunks for r in c) == sorted(r.req_id for r in reqs)


def _two_runners_and_chains_cuda():
    """Two graph runners over identical bf16 caches (random contents) and a packed greedy step of
    three requests with chains of K nodes; returns (runners, packed, forward ids, its ForwardBatch, kv rows)."""
    from verifier.step.tree_batch import pack_rows

    torch.manual_seed(0)
    model = build_model(CFG, None, "cuda", torch.bfloat16)
    caches = [KVCache(2, MAX_BATCH + 1, MAX_LEN, 2, 8, "cuda", torch.bfloat16) for _ in range(2)]
    for c in caches:
        c.data.copy_(torch.randn(c.data.shape, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16))
    runners = [GraphRunner(model, c, MAX_BATCH, scratch_slot=MAX_BATCH, min_kv=16, capture=True) for c in caches]
    slots, prefixes, K = [3, 0, 4], [20, 5, 9], 4
    kv_len = runners[0].kv_bucket(max(prefixes) + K)
    ids, fb = _step("cuda", slots, prefixes, K, kv_len)  # chains of K nodes
    host_ids = ids.cpu().numpy()
    chain = np.tile(np.arange(-1, K - 2), (len(slots), 1))  # draft node i's parent: node i - 1 (-1: the root)
    packed = pack_rows(host_ids[:, 0].tolist(), host_ids[:, 1:], chain, np.ones((len(slots), K - 1), np.float32),
                       np.full(len(slots), K - 1), prefixes, slots)
    return runners, packed, ids, fb, max(prefixes) + K


@pytest.mark.gpu
def test_greedy_step_logits_stay_in_the_model_dtype_cuda():
    """The one-graph greedy step hands the LM head's bf16 logits to the argmax without a float32
    copy: they are the forward graph's float32 logits exactly (same buckets, same kernels), and
    the roots' predictions are their argmax."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runners, packed, ids, fb, rows = _two_runners_and_chains_cuda()
    want = runners[0].forward_step(packed.host, packed.bs, packed.K, rows)
    r = runners[1].greedy_step(packed.host, packed.bs, packed.K, rows)
    assert r.logits.dtype == torch.bfloat16 and want.dtype == torch.bfloat16  # both as the LM head gave them
    assert torch.equal(r.logits, want)
    # each root's prediction is its row's argmax (the rest of predicts follows the accepted path)
    assert r.predicts.reshape(packed.bs, packed.K)[:, 0].tolist() == want[:, 0].argmax(-1).tolist()


@pytest.mark.gpu
def test_greedy_step_idle_work_runs_while_the_gpu_works_cuda():
    """greedy_step's ``idle`` is called while the step runs, until it says it has nothing left;
    the results are those of a step without it (same cache contents, same inputs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runners, packed, _, _, rows = _two_runners_and_chains_cuda()
    calls = []

    def idle() -> bool:
        calls.append(1)
        return len(calls) < 3

    plain = runners[0].greedy_step(packed.host, packed.bs, packed.K, rows)
    busy = runners[1].greedy_step(packed.host, packed.bs, packed.K, rows, idle=idle)
    assert len(calls) <= 3  # stops asking once idle() returns False (or once the step is done)
    for a, b in zip((plain.accept_index, plain.accept_token_num, plain.predicts, plain.bad),
                    (busy.accept_index, busy.accept_token_num, busy.predicts, busy.bad)):
        assert np.array_equal(a, b)


@pytest.mark.gpu
def test_processed_steps_replay_captured_forward_graphs_cuda():
    """Steps whose logits are processed (a presence penalty) on a CUDA engine: the forward part
    replays as a captured forward graph of the step's buckets; the penalty, verification and KV
    compaction run eagerly. The greedy outputs equal plain decoding's on an engine without graphs
    (the same functions, eagerly, at the exact shapes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tiny_lm import tiny_lm_cuda

    from verifier.draft.drafter import Drafter
    from verifier.engine.core import Engine, EngineConfig
    from verifier.step.sampling import SamplingParams

    lm = tiny_lm_cuda(vocab_size=64, seed=5)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [6, 7, 8, 6, 7, 8]]
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5)
    # The same kernels in both engines (no norm_linear, no compiled elementwise ops): only the
    # graphs' padding differs.
    same = dict(max_batch=4, max_len=128, max_budget=4, native_linear="off", compile=False)
    want = [r.output_ids for r in Engine(lm.model, lm.codec, None, EngineConfig(budget=0, cuda_graphs=False, **same))
            .generate(prompts, params)]
    eng = Engine(lm.model, lm.codec, Drafter(vocab_size=64), EngineConfig(budget=4, **same))
    for _ in range(2):  # the second round drafts from the first one's outputs
        assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert eng.stats.spec_steps > 0 and eng.stats.accepted_tokens > 0
    assert eng.graphs._forwards and all(g.graph is not None for g in eng.graphs._forwards.values())
