"""A TCP proxy process between the verifier's corpus client and the corpus (tests/tcp_proxy.py)
stalls or cuts the connection mid-generation: the verifier never waits on the corpus longer than
its draft deadline, every request completes with the tokens of plain decoding, and speculation
from the remote corpus resumes once bytes flow again. Real SmolLM2 on the CPU, real server."""

from __future__ import annotations

import time

import pytest
from engine_fixtures import engine

from tests.tcp_proxy import ProxyProcess
from verifier.draft.drafter import DraftConfig, Drafter
from verifier.step.sampling import SamplingParams

DRAFT_TIMEOUT_S = 0.1
CLIENT_TIMEOUT_S = 20.0  # far above the bound below: a step that waited on the client would show
WAIT_BOUND_S = 3.0  # the draft deadline plus a loaded machine's scheduling slack
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
FAULT_PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def proxy(corpus_server):
    p = ProxyProcess(corpus_server.target).start()
    yield p
    p.stop()


def _timed(drafter: Drafter, waits: list[float]) -> None:
    """Records how long each step's draft call (remote wait plus any fallback) takes."""
    real = drafter.draft

    def draft(req_ids, budget):
        t0 = time.perf_counter()
        try:
            return real(req_ids, budget)
        finally:
            waits.append(time.perf_counter() - t0)

    drafter.draft = draft


def _until_remote(eng, drafter, prompt, timeout: float = 60.0) -> None:
    """Steps requests until a step drafts from the remote corpus."""
    before = drafter.stats.remote_steps
    req = eng.add_request(prompt, PARAMS)
    deadline = time.monotonic() + timeout
    while drafter.stats.remote_steps == before:
        assert time.monotonic() < deadline, f"speculation from the remote corpus did not resume: {drafter.stats}"
        if req.finished:
            req = eng.add_request(prompt, PARAMS)
        eng.step()
        time.sleep(0.02)
    while eng.has_work():
        eng.step()


def test_proxy_stall_and_cut_mid_generation(smollm2, trace_rows, proxy, monkeypatch):
    prompt, fault_prompts = trace_rows[0]["prompt_ids"], [trace_rows[i]["prompt_ids"] for i in (1, 2)]
    plain = engine(smollm2, None).generate(fault_prompts, FAULT_PARAMS)
    monkeypatch.setattr("verifier.draft.sources.BREAKER_COOLDOWN_S", 0.3)
    drafter = Drafter(proxy.address, DraftConfig(draft_timeout_s=DRAFT_TIMEOUT_S, corpus_timeout_s=CLIENT_TIMEOUT_S),
                      vocab_size=smollm2.model.config.vocab_size)
    eng = engine(smollm2, drafter)
    waits: list[float] = []
    _timed(drafter, waits)
    try:
        _until_remote(eng, drafter, prompt)
        for fault, fault_prompt, expect in zip(("stall", "cut"), fault_prompts, plain):
            t0 = time.monotonic()
            proxy.set_mode(fault)  # before the request: every draft of it meets the fault
            waits.clear()
            fallback_before = drafter.stats.fallback_steps
            req = eng.add_request(fault_prompt, FAULT_PARAMS)
            while not req.finished:
                eng.step()
            assert req.output_ids == expect.output_ids and req.finish_reason == "length", fault
            assert drafter.stats.fallback_steps > fallback_before, (fault, drafter.stats)
            assert max(waits) < WAIT_BOUND_S, f"a step waited {max(waits):.2f}s on the corpus ({fault})"
            t1 = time.monotonic()
            proxy.set_mode("pass")
            _until_remote(eng, drafter, prompt)
            print(f"{fault}: request done in {t1 - t0:.1f}s (longest draft wait {max(waits):.3f}s), "
                  f"remote drafting back after {time.monotonic() - t1:.1f}s")
    finally:
        proxy.set_mode("pass")
        drafter.close()
