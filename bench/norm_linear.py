"""A decoder's projections at a decode / verify step's few rows: ``kernels.norm_linear`` (the residual
add and RMSNorm folded into the matmul, SwiGLU into its epilogue) against torch's ops for the same
work (``verifier.step.reference.norm_linear``: the add, the norm, cuBLAS's matmul, SiLU * up), in the
same run.

Each layer of the model preset gets its own random bf16 weights, so that, as in a real step, the
weights stream from device memory rather than sit in L2 (SmolLM2-135M: 30 layers, 7 MiB each). Per
row count M, a CUDA graph replays every layer's four projections (qkv with the add and norm, o,
gate/up with the norm and SwiGLU, down), and one graph per projection replays that projection of
every layer: microseconds per layer (the median of --replays replays). ``rows_independent``: row r of
an M-row call equals the same row computed alone, bit for bit (what keeps greedy speculative output
equal to plain decoding; GPU only). Prints one summary line (per-layer times and torch / native per M), writes
JSON. On a CPU both sides are the torch reference, timed eagerly (a smoke test).

    python3 bench/norm_linear.py [--model smollm2-135m] [--rows 1,8,16,32] [--out bench/results/norm_linear.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_report  # noqa: E402
from bench.kernels import time_graph  # noqa: E402
from verifier import kernels  # noqa: E402
from verifier.model import ModelConfig  # noqa: E402
from verifier.step import reference as ref  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def parse_ints(s: str) -> list[int]:
    vals = [int(v) for v in s.split(",") if v.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, comma-separated, got {s!r}")
    return vals


def shapes(cfg: ModelConfig) -> dict[str, tuple[bool, bool, int, int]]:
    """projection -> (norm prologue with the residual add, silu, N, K)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return {"qkv": (True, False, qkv, h), "o": (False, False, h, cfg.num_heads * cfg.head_dim),
            "gate_up": (True, True, i, h), "down": (False, False, h, i)}


class Stack:
    """Random weights of every layer, and one call's inputs per projection at M rows."""

    def __init__(self, cfg: ModelConfig, layers: int, dev: torch.device, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.shapes, self.layers = shapes(cfg), layers

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

        self.w = {p: [rnd((2 if silu else 1) * n, k, scale=k ** -0.5) for _ in range(layers)]
                  for p, (_, silu, n, k) in self.shapes.items()}
        self.norm = {p: 1 + rnd(k, scale=0.1) for p, (_, _, _, k) in self.shapes.items()}
        self.rnd = rnd

    def inputs(self, M: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {p: (self.rnd(M, k), self.rnd(M, k)) for p, (_, _, _, k) in self.shapes.items()}

    def call(self, fn, p: str, layer: int, x: torch.Tensor, r: torch.Tensor):
        norm, silu, _, _ = self.shapes[p]
        if norm:
            return fn(x, self.w[p][layer], None, r, self.norm[p], 1e-5, silu)
        return fn(x, self.w[p][layer], None, None, None, 1e-5, False)


def timed_us(fn, dev: torch.device, replays: int) -> float:
    """Median microseconds of one fn(): CUDA-graph replays on a GPU (bench.kernels.time_graph), eager
    calls on a CPU."""
    if dev.type == "cuda":
        return time_graph(fn, steps=1, replays=replays)
    fn()
    times = []
    for _ in range(replays):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def rows_independent(stack: Stack, M: int, dev: torch.device) -> bool:
    inp = stack.inputs(M)
    for p, (x, r) in inp.items():
        full = stack.call(kernels.norm_linear, p, 0, x, r)[0]
        for row in sorted({0, M // 2, M - 1}):
            alone = stack.call(kernels.norm_linear, p, 0, x[row:row + 1].contiguous(), r[row:row + 1].contiguous())[0]
            if not torch.equal(alone[0], full[row]):
                return False
    return True


def run(cfg: ModelConfig, layers: int, rows: list[int], dev: torch.device, replays: int) -> dict:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    stack = Stack(cfg, layers, dev, dtype)
    impls = {"native": kernels.norm_linear, "torch": ref.norm_linear}
    out: dict = {}
    for M in rows:
        inp = stack.inputs(M)
        # On a CPU both sides are the reference, whose rows may depend on the batch's shape (BLAS).
        row: dict = {"rows_independent": rows_independent(stack, M, dev) if dev.type == "cuda" else None}
        for name, fn in impls.items():
            whole = lambda: [stack.call(fn, p, li, *inp[p]) for li in range(layers) for p in PROJECTIONS]  # noqa: E731
            row[f"{name}_layer_us"] = round(timed_us(whole, dev, replays) / layers, 2)
            for p in PROJECTIONS:
                one = lambda: [stack.call(fn, p, li, *inp[p]) for li in range(layers)]  # noqa: E731
                row[f"{name}_{p}_us"] = round(timed_us(one, dev, replays) / layers, 2)
        row["torch_vs_native"] = round(row["torch_layer_us"] / row["native_layer_us"], 3)
        out[str(M)] = row
        print(f"M={M}: " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a ModelConfig preset name")
    p.add_argument("--layers", type=int, default=0, help="layers of weights (0: the preset's)")
    p.add_argument("--rows", type=parse_ints, default=[1, 8, 16, 32], help="rows (tokens) per call, at most 32")
    p.add_argument("--replays", type=int, default=15)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "norm_linear.json"))
    args = p.parse_args(argv)
    if max(args.rows) > kernels.NORM_LINEAR_MAX_ROWS:
        p.error(f"--rows: at most {kernels.NORM_LINEAR_MAX_ROWS} (the kernel's limit)")
    if args.layers < 0 or args.replays < 1:
        p.error("--layers must be >= 0 and --replays >= 1")
    cfg = ModelConfig.from_name(args.model)
    layers = args.layers or cfg.num_layers
    dev = torch.device(args.device)
    res = {"model": args.model, "layers": layers, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "rows": run(cfg, layers, args.rows, dev, args.replays)}
    summary = {f"M{m}_{k}": v for m, r in res["rows"].items() for k, v in r.items()
               if k in ("native_layer_us", "torch_layer_us", "torch_vs_native")}
    checked = [r["rows_independent"] for r in res["rows"].values() if r["rows_independent"] is not None]
    summary["rows_independent"] = all(checked) if checked else None
    write_report(args.out, res, summary)
    return res


if __name__ == "__main__":
    main()
