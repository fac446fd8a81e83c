"""POST /v1/update-weights (verifier/api/weights.py) on the real SmolLM2 model behind a real uvicorn
server: new weights go into the live tensors and the model then computes exactly what a model loaded
with them computes; running requests finish first (or the update gives up, changing nothing); bad
input is a 4xx with a message; off unless enabled."""

import threading
import time

import pytest
import torch

from tests.verifier.conftest import load_smollm2
from tests.verifier.engine_fixtures import ADMIN, serve_api
from tests.verifier.tiny_lm import next_logits, tiny_lm
from verifier.api import weights as weights_api
from verifier.model.loader import copy_weights_, read_weights

SIGMA, SEED = 0.014075, 7
PROMPT = [1, 9690, 2683, 314, 260, 3349, 30]


@pytest.fixture(scope="module")
def own_model():
    """A model of its own: the tests change its weights (the session's smollm2 stays as loaded)."""
    return load_smollm2()


@pytest.fixture(scope="module")
def perturbed_logits():
    return next_logits(load_smollm2(weight_noise_sigma=SIGMA, weight_noise_seed=SEED).model, PROMPT)


def test_copied_weights_compute_what_a_fresh_load_computes(own_model, perturbed_logits):
    before = next_logits(own_model.model, PROMPT)
    ptrs = [p.data_ptr() for p in own_model.model.parameters()]
    cfg, state = read_weights("smollm2", SIGMA, SEED)
    n = copy_weights_(own_model.model, cfg, state)
    assert n == sum(p.numel() for p in own_model.model.parameters())
    assert [p.data_ptr() for p in own_model.model.parameters()] == ptrs  # in place: graphs stay valid
    assert torch.equal(next_logits(own_model.model, PROMPT), perturbed_logits)
    assert not torch.equal(perturbed_logits, before)
    copy_weights_(own_model.model, *read_weights("smollm2"))  # back to the weights as shipped
    assert torch.equal(next_logits(own_model.model, PROMPT), before)


def test_another_architecture_is_refused_before_any_copy(own_model):
    before = next_logits(own_model.model, PROMPT)
    tiny = tiny_lm()
    with pytest.raises(ValueError, match="another architecture"):
        copy_weights_(own_model.model, tiny.model.config, dict(tiny.model.state_dict()))
    cfg, state = read_weights("smollm2")
    state["norm.weight"] = state["norm.weight"][:-1]
    with pytest.raises(ValueError, match="norm.weight has shape"):
        copy_weights_(own_model.model, cfg, state)
    assert torch.equal(next_logits(own_model.model, PROMPT), before)


def test_off_unless_enabled(own_model):
    with serve_api(own_model, budget=4) as client:
        r = client.post("/v1/update-weights", json={}, headers=ADMIN)
        assert r.status_code == 403 and "--allow-weight-updates" in r.json()["error"]["message"]
        assert client.get("/healthz").json()["weights"]["updates_enabled"] is False


def test_update_over_http(own_model, perturbed_logits, tmp_path, monkeypatch):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    (tmp_path / "dir").mkdir()
    with serve_api(own_model, budget=4, weights_from="smollm2", weights_dir=str(tmp_path)) as client:
        before = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        orig = next_logits(own_model.model, PROMPT)
        assert client.post("/v1/update-weights", json={}).status_code == 401  # no admin key: not even read
        for bad, why in (({"weight_noise_sigma": 2}, "weight_noise_sigma"), ({"seed": 1}, "seed"),
                         ({"model": str(tmp_path / "none.gguf")}, "nothing at"),
                         ({"model": "dir"}, "config.json")):
            r = client.post("/v1/update-weights", json=bad, headers=ADMIN)
            assert r.status_code == 400 and why in r.json()["error"]["message"], (bad, r.text)

        # A request runs while an update drains: one that may wait 0.05 s for it gives up and changes
        # nothing; one that may wait long enough lets it finish with the old weights, then swaps. Each
        # request starts only once its update has read the weights (a gate around the real read), so
        # that it is still running when the drain begins however slow the read is on a loaded machine.
        read, go = threading.Event(), threading.Event()

        def gated_read(*args):
            out = read_weights(*args)
            read.set()
            assert go.wait(120)
            return out

        monkeypatch.setattr(weights_api, "read_weights", gated_read)

        def during_drain(request: dict, max_tokens: int, update: dict):
            read.clear()
            go.clear()
            answer = {}
            up = threading.Thread(target=lambda: answer.update(r=client.post("/v1/update-weights", json=update,
                                                                              headers=ADMIN)))
            up.start()
            assert read.wait(120)
            t = threading.Thread(target=lambda: request.update(r=client.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True})))
            t.start()
            deadline = time.monotonic() + 60
            while 'ngram_verifier_requests{state="running"} 1.0' not in client.get("/metrics").text:
                assert time.monotonic() < deadline
            go.set()
            up.join(120)
            t.join(120)
            return answer["r"]

        short = {}
        r = during_drain(short, 400, {"weight_noise_sigma": SIGMA, "weight_noise_seed": SEED, "drain_timeout_s": 0.05})
        assert r.status_code == 503 and "unchanged" in r.json()["error"]["message"]
        assert short["r"].status_code == 200
        assert torch.equal(next_logits(own_model.model, PROMPT), orig)
        long = {}
        r = during_drain(long, 600, {"weight_noise_sigma": SIGMA, "weight_noise_seed": SEED, "policy_version": 3})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["drained_requests"] == 1 and out["policy_version"] == {"version": 3, "corpus": "local"}
        assert long["r"].status_code == 200 and long["r"].json()["usage"]["completion_tokens"] == 600
        assert torch.equal(next_logits(own_model.model, PROMPT), perturbed_logits)
        health = client.get("/healthz").json()["weights"]
        assert health["updates"] == 1 and health["failed_updates"] == 3 and not health["updating"]
        assert health["last"]["weight_noise_seed"] == SEED

        r = client.post("/v1/update-weights", json={}, headers=ADMIN)  # the served model's own weights again
        assert r.status_code == 200
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
