"""Loading real-model traces (../shared/data/traces/*.jsonl) for replay benchmarks."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """The shared data folder: $NGRAM_SHARED_DATA, else ../shared/data beside the repository."""
    env = os.environ.get("NGRAM_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@dataclass(frozen=True, slots=True)
class Trace:
    id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]


def load_traces(path: str | Path, limit: int | None = None) -> list[Trace]:
    path = Path(path)
    if not path.exists():
        candidate = shared_data_dir() / "traces" / path.name
        if candidate.exists():
            path = candidate
        else:
            raise FileNotFoundError(f"trace file not found: {path} (nor {candidate})")
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(Trace(f"{r['id']}#{r.get('sample', 0)}", str(r.get("category", "all")), list(r["prompt_ids"]), list(r["output_ids"])))
            if limit and len(out) >= limit:
                break
    return out


def default_trace_files() -> list[Path]:
    d = shared_data_dir() / "traces"
    return [d / "specbench_dev120_greedy.jsonl", d / "humaneval164_greedy.jsonl"]
