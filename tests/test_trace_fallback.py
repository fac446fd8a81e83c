"""The tests' trace data on a fresh clone: without the shared data folder, ``prompt_trace`` gives the
same prompts from the repository's sampled traces, and the files shipped in tests/data/ are what
they say (checked against the shared folder too wherever it is present)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, SAMPLED_TWINS, prompt_trace, read_jsonl, shared_data_dir

SIZES = {"humaneval164_greedy.jsonl": 164, "specbench_dev120_greedy.jsonl": 120}


@pytest.fixture
def shared_traces() -> Path:
    """The shared folder's traces as configured (before a test hides them), or None."""
    d = shared_data_dir() / "traces"
    return d if d.is_dir() else None


@pytest.mark.parametrize("name", sorted(SAMPLED_TWINS))
def test_without_the_shared_folder_the_same_prompts_come_from_the_repository(name, shared_traces, monkeypatch, tmp_path):
    monkeypatch.setenv("NGRAM_SHARED_DATA", str(tmp_path / "absent"))
    rows = prompt_trace(name)
    assert len(rows) == SIZES[name]
    assert len({r["id"] for r in rows}) == len(rows)  # one row per prompt: sample 0
    assert all(r["sample"] == 0 and r["temperature"] > 0 and r["prompt_ids"] and r["output_ids"] for r in rows)
    if shared_traces is not None:
        greedy = read_jsonl(shared_traces / name)
        assert [(r["id"], r["prompt_ids"]) for r in rows] == [(r["id"], r["prompt_ids"]) for r in greedy]
    with pytest.raises(FileNotFoundError, match="no trace of the same prompts"):
        prompt_trace("rollouts_dev_g8e3.jsonl")


def test_with_the_shared_folder_its_greedy_rows_come_first(tmp_path, monkeypatch):
    # A stand-in shared folder: prompt_trace reads it as it is, without falling back.
    (tmp_path / "traces").mkdir()
    row = {"id": "x", "category": "c", "sample": 0, "temperature": 0.0, "prompt_ids": [1, 2], "output_ids": [3]}
    (tmp_path / "traces" / "humaneval164_greedy.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("NGRAM_SHARED_DATA", str(tmp_path))
    assert prompt_trace("humaneval164_greedy.jsonl") == [row]


def test_shipped_greedy_head_has_the_fixture_prompts(shared_traces, monkeypatch, tmp_path):
    """tests/data/smollm2_greedy_head.jsonl holds trace_rows' prompts (as selected on a fresh clone)
    and, where the shared folder is present, its greedy rows' first 32 output tokens."""
    head = read_jsonl(REPO / "tests" / "data" / "smollm2_greedy_head.jsonl")
    monkeypatch.setenv("NGRAM_SHARED_DATA", str(tmp_path / "absent"))
    rows = [sorted(prompt_trace(n)[:12], key=lambda x: len(x["prompt_ids"]))
            for n in ("humaneval164_greedy.jsonl", "specbench_dev120_greedy.jsonl")]
    fixture = [rows[i % 2][i // 2] for i in range(8)]
    assert [(r["id"], r["prompt_ids"]) for r in head] == [(r["id"], r["prompt_ids"]) for r in fixture]
    assert all(r["temperature"] == 0.0 and 12 <= len(r["output_ids"]) <= 32 for r in head)  # test_model reads 12
    if shared_traces is not None:
        greedy = {r["id"]: r for n in SIZES for r in read_jsonl(shared_traces / n)}
        assert all(r["output_ids"] == greedy[r["id"]]["output_ids"][:32] for r in head)
        questions = shared_traces.parent / "spec_bench_dev120_question.jsonl"
        assert (REPO / "tests" / "data" / questions.name).read_bytes() == questions.read_bytes()
