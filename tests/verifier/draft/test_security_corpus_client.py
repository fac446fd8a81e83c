"""The verifier drafting from a corpus that requires TLS and a namespace-scoped token (the real
SmolLM2 model): remote drafts and plain decoding's output with the right credentials; in-process
drafts with a wrong token, which the drafter's error does not show."""

import json

import pytest
from engine_fixtures import engine

from tests.corpus_service.certs import make_certs
from tests.corpus_service.service_fixtures import ServerProcess
from verifier.config import VerifierConfig
from verifier.draft.drafter import CorpusEndpoint, DraftConfig, Drafter
from verifier.step.sampling import SamplingParams

DRAFT_TOKEN = "tok-verifier-draft-0123456789ab"
WRONG_TOKEN = "tok-verifier-draft-0123456789ac"


@pytest.fixture(scope="module")
def secured_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("secured-corpus")
    certs = make_certs(d / "certs")
    clients = [{"name": "verifier", "token": DRAFT_TOKEN, "namespaces": ["default"], "role": "draft"}]
    (d / "tokens.json").write_text(json.dumps({"clients": clients}))
    srv = ServerProcess(d, "--max-budget", "32", "--client-tokens", str(d / "tokens.json"),
                        "--tls-cert", certs.server_cert, "--tls-key", certs.server_key).start()
    yield srv, certs
    if srv.alive():
        srv.stop()


def test_verifier_drafts_over_tls_with_its_token(smollm2, trace_rows, secured_corpus):
    srv, certs = secured_corpus
    prompt = trace_rows[0]["prompt_ids"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    (plain,) = engine(smollm2, None).generate([prompt], params)
    vocab = smollm2.model.config.vocab_size
    draft = DraftConfig(draft_timeout_s=5.0)
    drafter = Drafter(CorpusEndpoint(srv.target, token=DRAFT_TOKEN, tls=certs.ca), draft, vocab_size=vocab)
    try:
        (out,) = engine(smollm2, drafter).generate([prompt], params)
        assert out.output_ids == plain.output_ids
        assert drafter.stats.remote_steps > 0 and drafter.stats.remote_errors == 0, drafter.stats
    finally:
        drafter.close()


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_a_wrong_token_falls_back_in_process_and_is_not_shown(secured_corpus, mode):
    srv, certs = secured_corpus
    draft = DraftConfig(draft_timeout_s=5.0, remote_drafts=mode)
    wrong = Drafter(CorpusEndpoint(srv.target, token=WRONG_TOKEN, tls=certs.ca), draft)
    try:
        wrong.start_request("r", [5, 6, 7, 8, 5, 6])
        batch = wrong.draft(["r"], 4)  # drafted in process: the corpus never fails a request
        assert batch.tree(0)[0][:2] == [7, 8]
        if mode == "pipelined":  # the remote call runs behind the step: let it fail, then step again
            wrong.dispatch()
            wrong._ahead[0].result(timeout=10)
            assert wrong.draft(["r"], 4).tree(0)[0][:2] == [7, 8]
        assert wrong.stats.remote_steps == 0 and "CorpusUnauthenticated" in wrong.stats.last_error
        assert WRONG_TOKEN not in wrong.stats.last_error
    finally:
        wrong.close()


def test_verifier_config_carries_the_corpus_credentials_without_showing_them():
    cfg = VerifierConfig(corpus="127.0.0.1:1", corpus_token=DRAFT_TOKEN, corpus_tls_ca="ca.pem")
    assert cfg.corpus_token == DRAFT_TOKEN and DRAFT_TOKEN not in repr(cfg)
