"""The demo's prompts on a machine without the shared data folder: the repository's own traces
(the same HumanEval and Spec-Bench prompts), each prompt once, not the built-in fallback."""

import json
from pathlib import Path

from verifier.demo import DemoConfig, demo_prompts

SHIPPED = Path(__file__).resolve().parents[2] / "bench" / "data" / "traces"


def test_without_shared_data_the_repository_traces_give_the_prompts(tmp_path):
    prompts, source = demo_prompts(DemoConfig(prompts=6, data_dir=str(tmp_path)), codec=None)
    assert Path(source) == SHIPPED
    assert len(prompts) == 6 and len({tuple(p) for p in prompts}) == 6  # four samples per prompt: once each
    first = json.loads((SHIPPED / "humaneval164_t07x4.jsonl").open().readline())["prompt_ids"]
    assert prompts[0] == first  # HumanEval and Spec-Bench alternate, in file order
