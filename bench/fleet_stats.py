"""The fleet benchmark's reading of its replicas (``bench/rollouts.py fleet``): their engine counters
from ``/metrics``, summed, and an epoch's phase (its bulk, while many requests are live, or its tail)
from two such readings and the requests that finished in it."""

from __future__ import annotations


# What the replicas' engines did over the arm (their /metrics, summed): where a step's time went and how
# often drafting was on, to read a makespan ratio by.
REPLICA_COUNTERS = ("ngram_verifier_steps", "ngram_verifier_step_seconds", "ngram_verifier_generated_tokens",
                    "ngram_verifier_draft_tokens", "ngram_verifier_accepted_draft_tokens",
                    "ngram_verifier_budget_plain_switches", "ngram_verifier_budget_request_steps_no_draft")


def add_counters(text: str, out: dict[str, float]) -> dict[str, float]:
    """REPLICA_COUNTERS of one replica's /metrics ``text`` added into ``out`` (label values in the key)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        if fam.name in REPLICA_COUNTERS:
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                key = sample.name + "".join(f"_{v}" for v in sample.labels.values())
                out[key] = out.get(key, 0.0) + sample.value
    return out


def replica_metrics(urls: list[str]) -> dict:
    import httpx

    out: dict[str, float] = {}
    for u in urls:
        add_counters(httpx.get(u + "/metrics", timeout=30).text, out)
    steps = out.get("ngram_verifier_steps_total", 0.0)
    if steps:
        out["seconds_per_step"] = out.get("ngram_verifier_step_seconds_total", 0.0) / steps
    return out


async def fetch_text(http, url: str) -> str:
    async with http.get(url) as r:
        return await r.text()


def phase_stats(before: dict[str, float], after: dict[str, float], seconds: float, finished: list[dict]) -> dict:
    """One phase of an epoch: its seconds, the replicas' engine steps and their tokens, draft nodes
    (the budget spent) and accepted drafts between two counter readings, and the requests that
    finished in it (their own MAT: output tokens over their verify steps)."""
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = d("ngram_verifier_steps_total")
    gen, drafted = d("ngram_verifier_generated_tokens_total"), d("ngram_verifier_draft_tokens_total")
    req_steps = sum(x["steps"] for x in finished)
    switches = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in after
                   if k.startswith("ngram_verifier_budget_plain_switches"))
    return {"seconds": round(seconds, 3), "engine_steps": int(steps),
            "step_ms": round(1e3 * d("ngram_verifier_step_seconds_total") / steps, 3) if steps else None,
            "tokens": int(gen), "tokens_per_engine_step": round(gen / steps, 2) if steps else None,
            "draft_nodes_per_engine_step": round(drafted / steps, 2) if steps else None,
            "acceptance": round(d("ngram_verifier_accepted_draft_tokens_total") / drafted, 3) if drafted else None,
            "plain_switches": int(switches), "requests_finished": len(finished),
            "finished_mat": round(sum(x["tokens"] for x in finished) / req_steps, 3) if req_steps else None}
