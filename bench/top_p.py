"""Top-k / top-p verification from the logits against the processed path it replaced (GPU only).

A sampled step with top-p (or top-k) used to take the processed path: a float32 copy of the logits,
``target_probs`` (a sort of every [vocab] row, two softmaxes, a scatter back) and tree rejection
sampling over the written [bs, K, vocab] distribution. It now verifies from the LM head's bf16
logits: ``kernels.logit_floor`` (a radix select per row) and ``kernels.tree_sampling_logits``
with that floor. For each (batch, nodes) both are timed per eager call on the same random logits
(CUDA events, median of --repeats after warm-up), with the floor kernel alone; the ratio is the
processed path's time over the logits path's. T = 0.8, top-p 0.95 on every row (--top-k adds a
top-k), vocab 49152.

    python3 bench/top_p.py [--shapes 1x1,1x16,8x16,64x1,64x8,64x16] [--out bench/results/top_p.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_report  # noqa: E402
from bench.kernels import make_inputs, time_eager  # noqa: E402
from verifier import kernels  # noqa: E402
from verifier.step.sampling import target_probs  # noqa: E402


def shape(bs: int, K: int, vocab: int, top_k: int, repeats: int) -> dict:
    x = make_inputs(bs, K, vocab, seed=bs + K)
    g = torch.Generator(device="cuda").manual_seed(bs * 100 + K)
    # Spread like a language model's logits: a few strong candidates over a long tail.
    logits = (torch.randn(bs, K, vocab, device="cuda", generator=g) * 2.5).to(torch.bfloat16)
    rows = bs * K
    temp = torch.full((rows,), 0.8, device="cuda")
    tk = torch.full((rows,), float(top_k), device="cuda")
    tp = torch.full((rows,), 0.95, device="cuda")
    links = x["links"][1:]

    def logits_path():
        return kernels.tree_sampling_logits(x["tokens"], *links, x["coins"], x["final"], logits, temp, K,
                                            top_k=tk, top_p=tp)

    def processed_path():
        flat = logits.view(rows, vocab).float()
        probs = target_probs(flat, temp, tk.long(), tp, truncated=True).view(bs, K, vocab)
        return kernels.tree_speculative_sampling(x["tokens"], *links, x["coins"], x["final"], probs, K)

    def floor_only():
        return kernels.logit_floor(logits.view(rows, vocab), temp, tk if top_k else None, tp)

    new, old, floor = (time_eager(f, reps=repeats) for f in (logits_path, processed_path, floor_only))
    return {"bs": bs, "K": K, "logits_path_us": round(new, 1), "processed_path_us": round(old, 1),
            "floor_us": round(floor, 1), "x": round(old / new, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1,1x16,8x16,64x1,64x8,64x16", help="batch x nodes, comma-separated")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--top-k", type=int, default=0, help="a top-k on every row too (0: off)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "top_p.json"))
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--shapes: expected BxK pairs like 64x8, got {args.shapes!r}")
    if not shapes or any(len(s) != 2 or s[0] < 1 or not 1 <= s[1] <= kernels.MAX_NODES for s in shapes):
        p.error(f"--shapes: expected BxK pairs with B >= 1 and 1 <= K <= {kernels.MAX_NODES}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the kernels are CUDA; the CPU runs the reference)")
    res = [shape(bs, K, args.vocab, args.top_k, args.repeats) for bs, K in shapes]
    for r in res:
        print(f"top_p bs {r['bs']} K {r['K']}: logits path {r['logits_path_us']} us (floor {r['floor_us']}), "
              f"processed {r['processed_path_us']} us: x{r['x']}", flush=True)
    summary = {f"b{r['bs']}_k{r['K']}_x": r["x"] for r in res}
    summary["min_x"] = min(r["x"] for r in res)
    write_report(args.out, {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__},
                            "vocab": args.vocab, "top_k": args.top_k, "shapes": res, "summary": summary}, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
