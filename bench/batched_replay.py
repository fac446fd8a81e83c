"""A trace replayed with the verifier engine's corpus calls (``bench/acceptance.py --batch N``).

``acceptance.replay_engine`` replays one request after another, each drafted and extended alone, and
waits for the learned corpus between requests. The engine (``verifier/engine``) instead runs up to
``batch`` requests at once (continuous batching, in file order): a request's first output token comes
from its prefill and is committed before any draft; then every step drafts all running requests in
one call, verifies each tree against the true continuation, commits each accepted path plus the bonus
token in one ``extend_runs`` call, and finishes the requests that reached their end, without waiting
for the learned corpus' worker. MAT as ``bench/e2e.py`` counts it: output tokens over verify steps.
At a fixed budget this is what the engine does with a local corpus (docs/ranking.md, "End to end").
"""

from __future__ import annotations

from corpus_service import CorpusConfig, NgramCorpus

from bench.acceptance import accept_path
from bench.traces import Trace


def replay_batched(traces: list[Trace], budget: int, config: CorpusConfig, batch: int) -> dict:
    if batch < 1:
        raise ValueError(f"batch: expected >= 1, got {batch}")
    eng = NgramCorpus(config)
    waiting = list(range(len(traces)))
    live: dict[int, int] = {}  # trace index -> output tokens committed
    steps = drafted = accepted = 0
    while waiting or live:
        while waiting and len(live) < batch:  # admitted: prompt, then the prefill's token
            k = waiting.pop(0)
            eng.start_request(f"r{k}", traces[k].prompt_ids)
            eng.extend(f"r{k}", traces[k].output_ids[:1])
            live[k] = 1
        ids = [k for k in live if live[k] < len(traces[k].output_ids)]
        if ids:
            trees = eng.draft([f"r{k}" for k in ids], budget)
            runs = []
            for j, k in enumerate(ids):
                toks, parents, _ = trees.tree(j)
                out, i = traces[k].output_ids, live[k]
                a = accept_path(toks, parents, out[i:])
                runs.append(out[i:i + a + 1])
                live[k] = i + len(runs[-1])
                steps, drafted, accepted = steps + 1, drafted + len(toks), accepted + a
            eng.extend_runs([f"r{k}" for k in ids], runs)
        for k in [k for k in live if live[k] >= len(traces[k].output_ids)]:
            eng.finish(f"r{k}")
            del live[k]
    tokens = sum(len(t.output_ids) for t in traces)
    return {"mat": tokens / max(steps, 1), "accepted_per_drafted_node": accepted / max(drafted, 1),
            "drafted_nodes_per_step": drafted / max(steps, 1), "batch": batch}
