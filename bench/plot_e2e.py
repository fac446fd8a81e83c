#!/usr/bin/env python3
"""Tokens/s against batch size from ``bench/e2e.py`` results: plain decoding, speculation with the
in-process corpus and with the remote corpus (SmolLM2 part), one PNG.

Input: the JSON that e2e.py writes (``--out``), or its printed log (the ``smollm2 batch N: {...}``
lines), for runs whose JSON did not survive. Needs matplotlib (requirements/bench.txt).

    python3 bench/plot_e2e.py bench/results/e2e_h200.json --out docs/e2e_tok_s.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MODES = ("plain", "local", "remote")
_LINE = re.compile(r"^smollm2 batch (\d+): (\{.*\})\s*$")


def load_rows(path: Path) -> dict[int, dict[str, float]]:
    """{batch: {mode: tok/s}} from an e2e JSON or log; ValueError if it holds no SmolLM2 rows."""
    text = path.read_text()
    rows: dict[int, dict[str, float]] = {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        for line in text.splitlines():
            m = _LINE.match(line)
            if m:
                rows[int(m.group(1))] = {k: v["tok_s"] for k, v in json.loads(m.group(2)).items() if k in MODES}
    else:
        for B, row in ((data.get("smollm2") or {}).get("batches") or {}).items():
            rows[int(B)] = {k: row[k]["tok_s"] for k in MODES if isinstance(row.get(k), dict)}
        if not rows:  # older JSON layouts: the flat summary keys
            for key, v in (data.get("summary") or {}).items():
                m = re.fullmatch(r"smol_b(\d+)_(plain|local|remote)_tok_s", key)
                if m:
                    rows.setdefault(int(m.group(1)), {})[m.group(2)] = v
    if not rows:
        raise ValueError(f"{path}: no SmolLM2 rows (expected e2e.py's JSON or its 'smollm2 batch N:' log lines)")
    return dict(sorted(rows.items()))


def plot(rows: dict[int, dict[str, float]], out: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plot_e2e: matplotlib is needed ({e}); pip install -r requirements/bench.txt") from e
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    labels = {"plain": "no speculation", "local": "in-process corpus", "remote": "remote corpus (gRPC, pipelined)"}
    for mode in MODES:
        pts = [(B, r[mode]) for B, r in rows.items() if mode in r]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=labels[mode])
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(rows), [str(b) for b in rows])
    ax.set_xlabel("batch size (requests decoded together)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="e2e.py JSON or log")
    p.add_argument("--out", type=Path, default=Path("docs/e2e_tok_s.png"))
    p.add_argument("--title", default="SmolLM2-135M bf16, Spec-Bench dev prompts")
    args = p.parse_args(argv)
    rows = load_rows(args.results)
    plot(rows, args.out, args.title)
    print(f"plot_e2e: {len(rows)} batch sizes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
