"""What the modes of ``bench/rollouts.py`` share: the rollout traces (their names, the slices shipped
with the repository, where a trace is found, its rows as ``Sample``s, grouped by epoch), the traces'
policy perturbation, the ``--set`` CorpusConfig overrides (replay, memory) and the results' JSON."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.traces import shared_data_dir

REPO = Path(__file__).resolve().parent.parent

TRACE_NAMES = ("rollouts_dev_g8e3.jsonl", "rollouts_dev_g8e3_t07.jsonl")
# Slices of the rollout traces shipped with the repository (bench/data/README.md): the replay's
# input where the shared data folder is absent (a fresh clone, CI).
SLICE_DIR = REPO / "bench" / "data" / "traces"
SLICES = {"rollouts_dev_g8e3.jsonl": "rollouts_dev_g8e3_slice4.jsonl",
          "rollouts_dev_g8e3_t07.jsonl": "rollouts_dev_g8e3_t07_slice4.jsonl"}
# The traces' policy perturbation (../shared/data/README.md): sigma * std(W) on every linear weight.
NOISE_SIGMA = 0.014075


@dataclass(frozen=True, slots=True)
class Sample:
    """One rollout of the trace: sample ``sample`` of prompt ``key`` in epoch ``epoch``."""

    key: str
    epoch: int
    sample: int
    category: str
    temperature: float
    prompt_ids: list[int]
    output_ids: list[int]


def trace_path(name: str) -> Path:
    """A rollout trace: a path as given, else the shared data folder's, else the repository's slice."""
    p = Path(name)
    if p.exists():
        return p
    shared = shared_data_dir() / "traces" / p.name
    if shared.exists():
        return shared
    if p.name in SLICES and (SLICE_DIR / SLICES[p.name]).exists():
        return SLICE_DIR / SLICES[p.name]
    raise FileNotFoundError(f"rollout trace not found: {name} (nor {shared}, nor a shipped slice)")


def load_samples(path: Path, prompts: int | None = None, epochs: int | None = None) -> list[Sample]:
    """The trace's rows, the first ``prompts`` prompt keys (in order of appearance) and epochs < ``epochs``."""
    out: list[Sample] = []
    keys: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            for field in ("prompt_key", "epoch", "sample", "prompt_ids", "output_ids"):
                if field not in r:
                    raise ValueError(f"{path}: a row without '{field}': not a rollout trace")
            key = str(r["prompt_key"])
            if key not in keys:
                if prompts is not None and len(keys) >= prompts:
                    continue
                keys[key] = len(keys)
            if epochs is not None and int(r["epoch"]) >= epochs:
                continue
            out.append(Sample(key, int(r["epoch"]), int(r["sample"]), str(r.get("category", "all")),
                              float(r.get("temperature", 1.0)), list(r["prompt_ids"]), list(r["output_ids"])))
    if not out:
        raise ValueError(f"{path}: no rollouts selected")
    return out


def by_epoch(samples: list[Sample]) -> dict[int, list[Sample]]:
    epochs: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        epochs[s.epoch].append(s)
    return dict(sorted(epochs.items()))


def write_out(path: str, results: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
