#!/usr/bin/env python3
"""Device time of one verifier step, without model weights to transfer: a random-weight model of a
real shape (default SmolLM2-135M), bf16, on the GPU.

For batch B and K tree nodes per request it times (medians over --repeats, after warm-up):
- ``replay``: the captured forward part alone (GraphRunner.forward_step's forward graph);
- ``step``: the whole one-graph greedy step (GraphRunner.greedy_step: copy in, replay, copy out);
with the native kernels (verifier.kernels: RoPE/KV-store, attention, and norm_linear for steps of
at most 32 tokens) and the layers' other elementwise ops compiled (verifier.model.fusion); as
same-run baselines, the same with torch's matmuls and compiled norms/SiLU instead of norm_linear
(``torch_linear``), with torch attention too (SDPA over gathered K/V), and with eager elementwise
ops too. Also the batched prefill of B prompts
against prefilling them one by one. With --kernels, a kernel table per shape (torch profiler):
where a step's device time goes, kernel by kernel (``torch_linear`` is how every step of an engine runs
whose max_batch x (max_budget + 1) exceeds the 32 rows ``kernels.norm_linear`` takes: 64 slots, say). With --first-launch, only the host time of a
step graph's first launch after capture against its later launches, with the graph uploaded at
capture (the default) and without.
Prints one summary line, writes JSON.

    python3 bench/step_profile.py --out bench/results/step_profile.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizers import Tokenizer, models  # noqa: E402

from bench.common import write_report  # noqa: E402
from verifier.budget.cost_probe import chain_step  # noqa: E402
from verifier.engine.core import Engine, EngineConfig  # noqa: E402
from verifier.model import ModelConfig, TextCodec, build_model, fusion  # noqa: E402
from verifier.step.cuda_graphs import next_bucket  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402
from verifier.step.tree_batch import pack_trees  # noqa: E402


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def kernel_table(fn, steps: int, device: torch.device, top: int = 10) -> list[list]:
    """The costliest kernels of ``steps`` calls of fn (torch profiler): [name, launches per call,
    microseconds per call], by time; on the CPU (a smoke test), the costliest ops by CPU time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append([e.key[:90], round(e.count / steps, 2), round(us / steps, 1)])
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def profile(model, codec, batches: list[int], ks: list[int], prefix: int, repeats: int, compiled: bool,
            native: bool = True, linear: bool = True, kernel_steps: int = 0) -> dict:
    fusion.disable_compile()
    model.native_kernels, model.native_linear = native, linear
    dev = model.device
    # The engine decides norm_linear itself (EngineConfig.native_linear): "on" where every step of
    # its shape fits the kernel, else off; its start-up probe ("auto") would override ``linear``.
    eng = Engine(model, codec, None, EngineConfig(max_batch=max(batches), max_len=prefix + max(ks) + 64, budget=0,
                                                  max_budget=max(15, max(ks) - 1),  # trees of max(ks) nodes
                                                  compile=compiled, capture_at_start=False,
                                                  native_linear="on" if linear else "off",
                                                  emulate_graphs=dev.type != "cuda"))  # CPU: a smoke test
    out: dict = {}
    L = eng.graphs.kv_bucket(prefix + max(ks))
    for B in batches:
        for K in ks:
            host = chain_step(B, K, prefix)  # chains of K nodes after the prefix, as the greedy step's below
            forward = lambda: eng.graphs.forward_step(host, B, K, L)  # noqa: E731
            for _ in range(3):
                forward()
            graph = eng.graphs._forwards[(next_bucket(B, eng.graphs.batch_buckets), K, L)].graph
            replay = graph.replay if graph is not None else forward
            chain = (np.arange(K - 1), np.arange(K - 1) - 1, np.ones(K - 1, np.float32))
            packed = pack_trees([5] * B, [chain] * B, [prefix] * B, list(range(B)), K)
            for _ in range(3):
                eng.graphs.greedy_step(packed.host, B, K, prefix + K)
            step = lambda: eng.graphs.greedy_step(packed.host, B, K, prefix + K)  # noqa: E731
            out[f"B{B}_K{K}"] = {"replay_ms": timed_ms(replay, repeats, dev), "step_ms": timed_ms(step, repeats, dev)}
            if kernel_steps:
                out[f"B{B}_K{K}"]["kernels"] = kernel_table(step, kernel_steps, dev)
    # Batched prefill vs one prompt at a time (the engine's _prefill on the same requests).
    prompts = [[(7 * i + j) % 1000 for j in range(prefix)] for i in range(max(batches))]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.generate(prompts, params)  # warm
    batched = timed_ms(lambda: eng.generate(prompts, params), 3, dev)
    single = timed_ms(lambda: [eng.generate([p], params) for p in prompts], 3, dev)
    out["prefill_ms"] = {"batched": batched, "one_by_one": single, "prompts": len(prompts), "tokens": prefix}
    return out


def first_launch(model, codec, batches: list[int], ks: list[int], prefix: int) -> dict:
    """Host milliseconds of a step graph's first launch after its capture, against its later launches
    (medians over the shapes), with the upload at capture (GraphRunner.upload_at_capture) off and on."""
    fusion.disable_compile()
    model.native_kernels = model.native_linear = True
    dev = model.device
    out: dict = {}
    for upload in (False, True):
        eng = Engine(model, codec, None, EngineConfig(max_batch=max(batches), max_len=prefix + max(ks) + 64, budget=0,
                                                  max_budget=max(15, max(ks) - 1),  # trees of max(ks) nodes
                                                      capture_at_start=False, emulate_graphs=dev.type != "cuda"))
        eng.graphs.upload_at_capture = upload
        L = eng.graphs.kv_bucket(prefix + max(ks))
        first, later = [], []
        for B in batches:
            for K in ks:
                chain = (np.arange(K - 1), np.arange(K - 1) - 1, np.ones(K - 1, np.float32))
                packed = pack_trees([5] * B, [chain] * B, [prefix] * B, list(range(B)), K)
                eng.graphs._steps[(B, K, L)] = eng.graphs._build_step(B, K, L)  # captured, not launched
                for times in (first, later, later, later):
                    sync(dev)
                    t = time.perf_counter()
                    launch = eng.graphs.launch_greedy_step(packed.host, B, K, prefix + K)
                    times.append((time.perf_counter() - t) * 1e3)
                    eng.graphs.collect(launch)
        out["upload_at_capture" if upload else "upload_at_first_launch"] = {
            "first_launch_host_ms": round(statistics.median(first), 3), "later_launch_host_ms": round(statistics.median(later), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a ModelConfig preset name")
    p.add_argument("--batches", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--ks", type=parse_ints, default=[1, 16])
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (the measurement); cpu runs the same code eagerly, as a smoke test")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_profile.json"))
    p.add_argument("--skip-eager", action="store_true", help="skip the eager-ops baseline (the slowest)")
    p.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps of each shape (native, torch matmuls, torch attention) and record "
                        "their costliest kernels per step under 'kernels' (0: off)")
    p.add_argument("--first-launch", action="store_true",
                   help="only measure the host time of step graphs' first launches (upload at capture off and on)")
    args = p.parse_args(argv)
    if args.kernels < 0:
        p.error(f"--kernels: expected 0 (off) or a number of steps, got {args.kernels}")
    cfg = ModelConfig.from_name(args.model)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = build_model(cfg, None, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    codec = TextCodec(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), "", (cfg.vocab_size - 1,))
    if args.first_launch:
        res = {"model": args.model, "prefix": args.prefix, "first_launch": first_launch(model, codec, args.batches, args.ks,
                                                                                      args.prefix)}
        write_report(args.out, res, res["first_launch"])
        return 0
    res = {"model": args.model, "prefix": args.prefix,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch_attention": profile(model, codec, args.batches, args.ks, args.prefix, args.repeats, True, False, False,
                                      args.kernels),
           "torch_linear": profile(model, codec, args.batches, args.ks, args.prefix, args.repeats, True, True, False,
                                   args.kernels),
           "native": profile(model, codec, args.batches, args.ks, args.prefix, args.repeats, True, True, True,
                             args.kernels)}
    if not args.skip_eager:
        res["eager_ops"] = profile(model, codec, args.batches, args.ks, args.prefix, args.repeats, False, False, False)
    b1 = f"B{args.batches[0]}_K{args.ks[0]}"
    t, c = res["torch_attention"][b1], res["native"][b1]

    def vs(base: str) -> dict:
        return {k: round(res["native"][k]["step_ms"] / res[base][k]["step_ms"], 3) for k in res["native"] if k.startswith("B")}

    res["summary"] = {f"{b1}_step_ms": c["step_ms"], f"{b1}_step_ms_torch_linear": res["torch_linear"][b1]["step_ms"],
                      f"{b1}_step_ms_torch_attention": t["step_ms"],
                      "native_vs_torch_linear": vs("torch_linear"), "native_vs_torch_attention": vs("torch_attention"),
                      "prefill_batched_vs_one_by_one": round(res["native"]["prefill_ms"]["batched"]
                                                             / res["native"]["prefill_ms"]["one_by_one"], 3)}
    if "eager_ops" in res:
        res["summary"]["compiled_vs_eager"] = round(t["step_ms"] / res["eager_ops"][b1]["step_ms"], 3)
    write_report(args.out, res, res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
