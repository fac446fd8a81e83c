"""The corpus killed in the middle of a generation: the request completes (same tokens as plain
decoding), drafting falls back in process, and remote drafts resume once the corpus is back."""

import time

from engine_fixtures import engine

from verifier.draft.drafter import DraftConfig, Drafter
from verifier.step.sampling import SamplingParams


def test_corpus_killed_mid_generation(smollm2, trace_rows, corpus_server):
    prompt = trace_rows[0]["prompt_ids"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    (plain,) = engine(smollm2, None).generate([prompt], params)
    draft = DraftConfig(draft_timeout_s=2.0)
    drafter = Drafter(corpus_server.target, draft, vocab_size=smollm2.model.config.vocab_size)
    eng = engine(smollm2, drafter)
    try:
        req = eng.add_request(prompt, params)
        while drafter.stats.remote_steps < 3:
            eng.step()
        corpus_server.kill()  # kill -9 mid-generation
        while not req.finished:
            eng.step()
        assert req.output_ids == plain.output_ids and req.finish_reason == "length"
        # The outage is seen (pipelined drafts may finish the request on trees fetched before it:
        # then the next request's steps see it), and those requests complete as plain decoding does.
        deadline = time.monotonic() + 60
        while drafter.stats.remote_errors + drafter.stats.fallback_steps == 0 and time.monotonic() < deadline:
            (more,) = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
            assert more.output_ids == plain.output_ids[:6]
        assert drafter.stats.remote_errors + drafter.stats.fallback_steps > 0, drafter.stats

        corpus_server.start(grpc_port=corpus_server.grpc_port)  # back on the same address
        before = drafter.stats.remote_steps
        req2 = eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        deadline = time.monotonic() + 60
        while drafter.stats.remote_steps == before and time.monotonic() < deadline:
            if req2.finished:
                req2 = eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
            eng.step()
            time.sleep(0.1)  # let the breaker's cool-down pass
        assert drafter.stats.remote_steps > before, drafter.stats
    finally:
        drafter.close()
