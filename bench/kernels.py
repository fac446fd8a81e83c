"""Verifier kernels: CUDA vs the torch reference vs torch.compile of the reference (GPU only).

Two workloads per (batch, K), vocab 49152:
  greedy:   the whole greedy post-processing of a step: tree indices from (tokens, parents),
            greedy verify, KV compaction of a Llama-3-8B-shaped cache (64 K/V caches of 8 heads x
            128 bf16 = 2 KiB per token each);
  sampling: tree rejection sampling against float32 target probabilities [bs, K, vocab];
  attention_mask: the dense [bs, K, kv_len] prefix + tree mask for SDPA (prefixes 100..2000).
The kernels are timed as CUDA-graph replays (20 steps per graph, CUDA events, median of 10
replays), i.e. GPU time without Python launch overhead; the reference and its compiled form are
timed per eager call (CUDA events, median). Speedups are against the same run's reference.

    python3 bench/kernels.py [--out bench/results/kernels.json] [--compile-k 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_report  # noqa: E402
from verifier import kernels  # noqa: E402
from verifier.step import reference as ref  # noqa: E402

VOCAB = 49152
NUM_CACHES, ROW = 64, 8 * 128  # 32 layers x (K, V), 8 KV heads x head_dim 128


def make_inputs(bs, K, vocab, seed=0, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.arange(K, device=dev)
    parents = (torch.rand(bs, K, generator=g, device=dev) * idx).long()  # random recursive tree
    parents[:, 0] = -1
    tokens = torch.randint(0, vocab, (bs, K), generator=g, device=dev)
    prefix = torch.randint(100, 2000, (bs,), generator=g, device=dev)
    _, links = ref.tree_indices_from_parents(parents, prefix)
    first = links.retrive_next_token
    follow = (torch.rand(bs, K, generator=g, device=dev) < 0.7) & (first >= 0)
    targets = torch.where(follow, tokens.gather(1, first.clamp(min=0)), torch.randint(0, vocab, (bs, K), generator=g, device=dev))
    probs = torch.softmax(torch.randn(bs, K, vocab, generator=g, device=dev) * 3, -1)
    coins, final = torch.rand(bs, K, generator=g, device=dev), torch.rand(bs, generator=g, device=dev)
    slots = torch.arange(bs * K, device=dev).reshape(bs, K)
    cache = torch.zeros(NUM_CACHES, bs * K, ROW, dtype=torch.bfloat16, device=dev)
    mask = ref.tree_mask_from_parents(parents)
    return dict(mask=mask, parents=parents, tokens=tokens, prefix=prefix, targets=targets, probs=probs,
                coins=coins, final=final, slots=slots, cache=cache, links=links)


def greedy_step(impl, x, K):
    _, idx = impl.tree_indices_from_parents(x["parents"], x["prefix"])
    res = impl.verify_tree_greedy(x["tokens"], *idx[1:], x["targets"], K)
    impl.compact_kv_cache(x["cache"], x["slots"], res.accept_index, res.accept_token_num)
    return res


def sampling_step(impl, x, K):
    return impl.tree_speculative_sampling(x["tokens"], *x["links"][1:], x["coins"], x["final"], x["probs"], K)


def mask_step(impl, x, K):
    # prefixes are < 2000 (make_inputs); columns padded to a multiple of 16
    return impl.tree_attention_mask(x["mask"], x["prefix"], (2000 + K + 15) // 16 * 16)


def time_graph(fn, steps=20, replays=10) -> float:
    """Median GPU microseconds per call of fn, captured `steps` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / steps)
    return statistics.median(times)


def time_eager(fn, reps=10, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


class _Compiled:
    """The reference's functions under torch.compile (one compile per K and batch, so only for --compile-k x --compile-batches)."""

    def __init__(self):
        self.verify_tree_greedy = torch.compile(ref.verify_tree_greedy, dynamic=False)
        self.tree_speculative_sampling = torch.compile(ref.tree_speculative_sampling, dynamic=False)
        self.tree_indices_from_parents = torch.compile(ref.tree_indices_from_parents, dynamic=False)
        self.compact_kv_cache = torch.compile(ref.compact_kv_cache, dynamic=False)
        self.tree_attention_mask = torch.compile(ref.tree_attention_mask, dynamic=False)


def run(batches, ks, compile_ks, compile_batches, vocab):
    compiled = _Compiled()
    records = []
    for K in ks:
        for bs in batches:
            x = make_inputs(bs, K, vocab)
            for op, step in (("greedy", greedy_step), ("sampling", sampling_step), ("attention_mask", mask_step)):
                rec = dict(op=op, batch=bs, K=K, vocab=vocab)
                rec["kernel_us"] = time_graph(lambda: step(kernels, x, K))
                rec["kernel_eager_us"] = time_eager(lambda: step(kernels, x, K))
                rec["reference_us"] = time_eager(lambda: step(ref, x, K), reps=5)
                rec["compiled_us"] = None
                if K in compile_ks and bs in compile_batches:
                    t0 = time.perf_counter()
                    try:
                        step(compiled, x, K)
                        rec["compile_s"] = time.perf_counter() - t0
                        rec["compiled_us"] = time_eager(lambda: step(compiled, x, K), reps=5)
                    except Exception as e:  # an inductor failure is a result too, not a crash
                        rec["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rec["speedup_vs_reference"] = rec["reference_us"] / rec["kernel_us"]
                if rec["compiled_us"]:
                    rec["speedup_vs_compiled"] = rec["compiled_us"] / rec["kernel_us"]
                if op == "sampling":  # the bonus draw reads one vocab row per request
                    rec["sampling_row_GBps"] = bs * vocab * 4 / (rec["kernel_us"] * 1e-6) / 1e9
                records.append(rec)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
            del x
            torch.cuda.empty_cache()
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/kernels.json")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--ks", default="8,16,32,64")
    parser.add_argument("--compile-k", default="16", help="K values for which torch.compile is timed ('' = none)")
    parser.add_argument("--compile-batches", default="64", help="batch sizes for which torch.compile is timed")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device", file=sys.stderr)
        return 1
    parse = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    records = run(parse(args.batches), parse(args.ks), parse(args.compile_k), parse(args.compile_batches), args.vocab)
    pick = {(r["op"], r["batch"], r["K"]): r for r in records}
    g, s = pick.get(("greedy", 64, 16)), pick.get(("sampling", 64, 16))
    speedups = [r["speedup_vs_reference"] for r in records]
    summary = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__,
        greedy_bs64_k16_us=g and g["kernel_us"], sampling_bs64_k16_us=s and s["kernel_us"],
        median_speedup_vs_reference=statistics.median(speedups),
        min_speedup_vs_reference=min(speedups),
    )
    # Targets: greedy post-processing at batch 64 x 16 nodes <= 50 us, sampling <= 200 us.
    write_report(args.out, dict(summary=summary, records=records), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
