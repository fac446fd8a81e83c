#!/usr/bin/env python3
"""A step's penalty processing: the batched ops of ``verifier.step.penalties`` against the per-request
ops they replaced (a dozen small ops per penalized request, each a kernel launch and its Python).

For each shape (batch x nodes, penalized requests) both process the same float32 logits [bs, K, V]
of the same requests (a 200-token prompt, 100 output tokens, each step one more; presence 0.5,
frequency 0.5, repetition 1.1, as ``bench/penalty_workload.py``), chain-shaped trees; each call's
wall time includes the device's (synchronized), median of --repeats after warm-up (and the first
shape once untimed: a process's first calls pay the ops' lazy initialisation). Before timing,
both results are compared (the greedy choice of every node must agree; the largest difference is
reported). Ratio: per-request time over batched time.

    python3 bench/penalties.py [--shapes 1x1p1,8x16p8,64x1p32,64x8p32,64x16p64] [--out bench/results/penalties.json]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_report  # noqa: E402
from bench.penalty_workload import PENALTIES  # noqa: E402
from verifier.engine.request import Request  # noqa: E402
from verifier.step.penalties import PenaltyCounts, process_logits  # noqa: E402
from verifier.step.sampling import SamplingParams  # noqa: E402

EOS = (2,)


class PerRequest:
    """The replaced processing, kept as the baseline: each penalized request's counts on the device
    (updated with its new tokens) and its penalties applied to its own rows, one request at a time."""

    def __init__(self) -> None:
        self.state: dict[str, list] = {}

    @torch.inference_mode()
    def __call__(self, logits, reqs, tokens, tree_mask):
        for b, req in enumerate(reqs):
            if req.params.penalized:
                self._one(logits[b], req, tokens[b], tree_mask[b])
        return logits

    def _one(self, logits, req, tokens, mask):
        p, (K, V), dev = req.params, logits.shape, logits.device
        st = self.state.get(req.req_id)
        if st is None:
            prompt = torch.zeros(V, dtype=torch.bool, device=dev)
            prompt[torch.tensor(req.prompt_ids, dtype=torch.int64, device=dev)] = True
            st = self.state[req.req_id] = [0, torch.zeros(V, dtype=torch.float32, device=dev), prompt]
        if st[0] < len(req.output_ids):
            new = torch.tensor(req.output_ids[st[0]:], dtype=torch.int64, device=dev).clamp_(0, V - 1)
            st[1].index_add_(0, new, torch.ones(len(new), dtype=torch.float32, device=dev))
            st[0] = len(req.output_ids)
        counts = st[1].expand(K, V).clone()
        if K > 1:
            counts.scatter_add_(1, tokens[1:].clamp(0, V - 1)[None].expand(K, K - 1), mask[:, 1:].to(logits.dtype))
        if p.repetition_penalty != 1.0:
            seen = (counts > 0) | st[2]
            r = p.repetition_penalty
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
        if p.frequency_penalty:
            logits.sub_(p.frequency_penalty * counts)
        if p.presence_penalty:
            logits.sub_(p.presence_penalty * (counts > 0).to(logits.dtype))


def requests(bs: int, penalized: int, V: int, g: torch.Generator) -> list[Request]:
    reqs = []
    for b in range(bs):
        params = SamplingParams(max_tokens=4096, **(PENALTIES if b < penalized else {}))
        r = Request(f"r{b}", torch.randint(0, V, (200,), generator=g).tolist(), params)
        r.slot, r.output_ids = b, torch.randint(0, V, (100,), generator=g).tolist()
        reqs.append(r)
    return reqs


def timed(fn, repeats: int, dev: torch.device) -> float:
    """Median wall microseconds of fn(), the device synchronized after each call."""
    times = []
    for i in range(repeats + 3):
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 3:
            times.append(1e6 * (time.perf_counter() - t))
    return statistics.median(times)


def shape(bs: int, K: int, penalized: int, V: int, dev: torch.device, repeats: int) -> dict:
    g = torch.Generator().manual_seed(bs * 1000 + K * 10 + penalized)
    base = (torch.randn(bs, K, V, generator=g) * 3.0).to(dev)
    tokens = torch.randint(0, V, (bs, K), generator=g).to(dev)
    tree_mask = torch.ones(K, K, dtype=torch.bool).tril().expand(bs, K, K).contiguous().to(dev)
    reqs = requests(bs, penalized, V, g)
    arms = {"batched": (copy.deepcopy(reqs), PenaltyCounts(bs)), "per_request": (copy.deepcopy(reqs), PerRequest())}
    work = {name: torch.empty_like(base) for name in arms}

    def step(name):
        rs, state = arms[name]
        x = work[name]
        x.copy_(base)
        for r in rs:  # each step one more output token per request (the counts' update runs)
            r.output_ids.append((len(r.output_ids) * 7919 + int(r.req_id[1:])) % V)
        if name == "batched":
            process_logits(x, rs, tokens, tree_mask, EOS, state)
        else:
            state(x, rs, tokens, tree_mask)
        return x

    a, b = step("batched").clone(), step("per_request").clone()
    same_choice = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    max_diff = float((a - b).abs().max())
    t_new, t_old = (timed(lambda n=name: step(n), repeats, dev) for name in ("batched", "per_request"))
    return {"bs": bs, "K": K, "penalized": penalized, "batched_us": round(t_new, 1), "per_request_us": round(t_old, 1),
            "x": round(t_old / t_new, 2), "same_choice": same_choice, "max_abs_diff": max_diff}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"BxKpP,..." -> [(B, K, P)]; ValueError on anything else."""
    out = []
    for s in (x.strip().lower() for x in text.split(",")):
        if not s:
            continue
        try:
            bk, p = s.split("p")
            b, k = bk.split("x")
            out.append((int(b), int(k), int(p)))
        except ValueError:
            raise ValueError(f"--shapes: expected BxKpP entries like 64x8p32, got {s!r}") from None
    if not out or any(b < 1 or not 1 <= k <= 64 or not 0 <= p <= b for b, k, p in out):
        raise ValueError("--shapes: expected B >= 1, 1 <= K <= 64, 0 <= P <= B")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1p1,1x16p1,8x16p8,64x1p32,64x8p32,64x16p64",
                   help="batch x nodes p penalized requests, comma-separated")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "penalties.json"))
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    if args.vocab < 2 or args.repeats < 1:
        p.error("--vocab: expected >= 2; --repeats: expected >= 1")
    dev = torch.device(args.device)
    # An untimed first shape: the first calls of a process pay the ops' lazy initialisation (on the
    # H100 the first shape timed 1 x 1 at 551 us batched against 187-201 us once warm).
    shape(*shapes[0], args.vocab, dev, 1)
    res = [shape(b, k, pen, args.vocab, dev, args.repeats) for b, k, pen in shapes]
    for r in res:
        print(f"penalties bs {r['bs']} K {r['K']} penalized {r['penalized']}: batched {r['batched_us']} us, "
              f"per request {r['per_request_us']} us: x{r['x']} (same choice {r['same_choice']}, "
              f"max diff {r['max_abs_diff']:.3g})", flush=True)
    summary = {f"b{r['bs']}_k{r['K']}_p{r['penalized']}_x": r["x"] for r in res}
    summary["min_x"] = min(r["x"] for r in res)
    summary["all_same_choice"] = all(r["same_choice"] for r in res)
    env = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    write_report(args.out, {"env": env, "vocab": args.vocab, "penalties": PENALTIES, "shapes": res, "summary": summary}, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
