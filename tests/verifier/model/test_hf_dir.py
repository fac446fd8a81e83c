"""A HF safetensors model directory (``--model DIR``) loads in the project's own environment: the
verifier's install brings safetensors. The directory is a small random-weight Llama written by the
test; the loaded model computes what a model built from the same tensors computes, and the engine
decodes with it. Broken directories say what is wrong (ValueError), never a KeyError."""

import json

import pytest
import torch

from tests.verifier.model.hf_dir import CONFIG, write_hf_dir
from tests.verifier.tiny_lm import next_logits
from verifier.engine.core import Engine, EngineConfig
from verifier.model import build_model, load_model
from verifier.model.config import ModelConfig
from verifier.model.loader import read_weights
from verifier.step.sampling import SamplingParams


def test_a_hf_directory_loads_and_decodes(tmp_path):
    state = write_hf_dir(tmp_path / "tiny-llama", seed=3)
    lm = load_model(str(tmp_path / "tiny-llama"))
    assert lm.name == "tiny-llama" and lm.model.config.num_layers == 2 and lm.codec.eos_token_ids == (63,)
    assert lm.codec.encode("t5 t9 t12") == [5, 9, 12]
    ref = build_model(ModelConfig.from_hf(CONFIG), {k.removeprefix("model."): v for k, v in state.items()}, "cpu",
                      torch.float32)
    ids = [5, 9, 12, 40, 2]
    assert torch.equal(next_logits(lm.model, ids), next_logits(ref, ids))
    other = write_hf_dir(tmp_path / "other", seed=4)
    assert not torch.equal(next_logits(load_model(str(tmp_path / "other")).model, ids), next_logits(ref, ids))
    assert other.keys() == state.keys()

    engine = Engine(lm.model, lm.codec, None, EngineConfig(max_batch=2, max_len=64, budget=0, max_budget=4))
    req = engine.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True))
    while not req.finished:
        engine.step()
    expect, ctx = [], list(ids)
    for _ in range(6):  # greedy by hand from fresh forwards
        expect.append(int(next_logits(ref, ctx).argmax()))
        ctx.append(expect[-1])
    assert req.output_ids == expect


@pytest.mark.parametrize("config,words", [
    ({}, "missing vocab_size"),
    ({**CONFIG, "num_hidden_layers": "two"}, "num_layers"),
    ({k: v for k, v in CONFIG.items() if k != "hidden_size"}, "missing hidden_size"),
    ([1, 2], "expected a JSON object"),
])
def test_a_broken_config_json_is_a_value_error_naming_it(tmp_path, config, words):
    write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words):
        read_weights(str(tmp_path / "m"))
