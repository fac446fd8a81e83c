"""POST /v1/update-weights against bad weight files and callers (a real uvicorn server serving a
small random-weight HF directory written by the test): a GGUF without the llama metadata, a
config.json of ``{}`` and a checkpoint full of NaN are 400 ``bad_weights``, counted, the weights
unchanged; paths outside --weights-dir are one and the same 403 whether they exist or not; the
route needs the admin key, not the API key."""

import pytest
import torch

from tests.verifier.engine_fixtures import ADMIN, ADMIN_KEY, serve_api
from tests.verifier.model.hf_dir import hf_state, write_hf_dir
from tests.verifier.tiny_lm import next_logits
from verifier.model import load_model

IDS = [5, 9, 12, 40, 2]
API_KEY = "api-key-of-the-tests"


@pytest.fixture
def served(tmp_path):
    """(client, model, weights dir, outside dir): the served model is tmp/served; new weights come from tmp/w."""
    write_hf_dir(tmp_path / "served", seed=1)
    (tmp_path / "w").mkdir()
    (tmp_path / "outside").mkdir()
    write_hf_dir(tmp_path / "outside" / "model", seed=2)
    lm = load_model(str(tmp_path / "served"))
    with serve_api(lm, budget=2, weights_from=str(tmp_path / "served"), weights_dir=str(tmp_path / "w"),
                   api_key=API_KEY) as client:
        yield client, lm.model, tmp_path / "w", tmp_path / "outside"


def write_gguf_without_llama_keys(path) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_string("general.name", "no llama keys")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_files_are_400_bad_weights_counted_and_change_nothing(served):
    client, model, wdir, _ = served
    before = next_logits(model, IDS)
    write_gguf_without_llama_keys(wdir / "nometa.gguf")
    write_hf_dir(wdir / "empty-config")
    (wdir / "empty-config" / "config.json").write_text("{}")
    nan = hf_state(seed=5)
    nan["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    write_hf_dir(wdir / "nan", state=nan)
    inf = hf_state(seed=5)
    inf["lm_head.weight"][0, 0] = float("inf")
    write_hf_dir(wdir / "inf", state=inf)
    cases = [("nometa.gguf", "metadata llama."), ("empty-config", "missing vocab_size"),
             ("nan", "layers.1.mlp.down_proj.weight holds NaN or Inf"), ("inf", "lm_head.weight holds NaN")]
    for name, words in cases:
        r = client.post("/v1/update-weights", json={"model": name}, headers=ADMIN)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "bad_weights" and words in err["message"], err
        assert torch.equal(next_logits(model, IDS), before)
    assert client.get("/healthz").json()["weights"]["failed_updates"] == len(cases)
    assert client.post("/v1/completions", json={"prompt": IDS, "max_tokens": 3, "temperature": 0},
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()["choices"][0]["finish_reason"] != "error"

    new = write_hf_dir(wdir / "v2", seed=9)  # a good one goes in (a relative name is taken from --weights-dir)
    r = client.post("/v1/update-weights", json={"model": "v2"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert not torch.equal(next_logits(model, IDS), before)
    assert torch.equal(next_logits(model, IDS), next_logits(load_model(str(wdir / "v2")).model, IDS))
    assert new.keys() == nan.keys()


def test_paths_outside_the_weights_dir_are_one_403(served):
    client, model, wdir, outside = served
    before = next_logits(model, IDS)
    (wdir / "link").symlink_to(outside / "model")  # inside by name, outside after symlinks
    answers = []
    for name in (str(outside / "model"), str(outside / "missing"), "../outside/model", "../outside/missing",
                 "/etc/passwd", "/no/such/file.gguf", "link", "..", str(wdir)):
        r = client.post("/v1/update-weights", json={"model": name}, headers=ADMIN)
        assert r.status_code == 403, (name, r.text)
        answers.append(r.json())
    assert all(a == answers[0] for a in answers)  # nothing in the answer says what exists
    assert answers[0]["error"]["code"] == "weights_outside_dir" and "--weights-dir" in answers[0]["error"]["message"]
    assert torch.equal(next_logits(model, IDS), before)


def test_only_the_admin_key_may_update(served):
    client, model, wdir, _ = served
    write_hf_dir(wdir / "v3", seed=11)
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}x"},
                    {"Authorization": ADMIN_KEY}):
        r = client.post("/v1/update-weights", json={"model": "v3"}, headers=headers)
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"], r.text
    assert client.get("/healthz").json()["weights"]["updates"] == 0
    assert client.post("/v1/update-weights", json={"model": "v3"}, headers=ADMIN).status_code == 200
