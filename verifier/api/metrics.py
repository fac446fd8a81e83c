"""Prometheus metrics: request counters here, engine and corpus counters read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.core import Engine


class EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        s = e.stats
        for name, doc, value in (
            ("ngram_verifier_steps", "engine steps", s.steps),
            ("ngram_verifier_generated_tokens", "tokens generated", s.generated_tokens),
            ("ngram_verifier_prefill_tokens", "prompt tokens prefilled", s.prefill_tokens),
            ("ngram_verifier_draft_tokens", "draft nodes verified", s.draft_tokens),
            ("ngram_verifier_accepted_draft_tokens", "draft tokens accepted", s.accepted_tokens),
            ("ngram_verifier_step_seconds", "time spent in engine steps", s.step_seconds),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if e.drafter is not None:
            d = e.drafter.stats
            c = CounterMetricFamily("ngram_verifier_draft_steps", "draft calls by source", labels=["source"])
            c.add_metric(["remote"], d.remote_steps)
            c.add_metric(["fallback"], d.fallback_steps)
            c.add_metric(["local"], d.local_steps)
            yield c
            a = CounterMetricFamily("ngram_verifier_remote_asks", "pipelined remote tree requests", labels=["outcome"])
            a.add_metric(["sent"], d.asks)
            a.add_metric(["skipped"], d.asks_skipped)  # remote_asks=adaptive: their trees added nothing
            yield a
            yield CounterMetricFamily("ngram_verifier_remote_gain_tokens",
                                      "accepted tokens that only the remote corpus' trees drafted", value=d.remote_gain_tokens)
            yield CounterMetricFamily("ngram_verifier_corpus_errors", "failed remote corpus calls", value=d.remote_errors)
            yield CounterMetricFamily("ngram_verifier_corpus_client_restarts",
                                      "dead corpus client processes replaced", value=d.client_restarts)
            h = e.drafter.health
            if h is not None:  # a corpus service (corpus_service/client/health.py)
                yield CounterMetricFamily("ngram_verifier_corpus_outages", "times the corpus service became unreachable",
                                          value=h.outages)
                yield CounterMetricFamily("ngram_verifier_corpus_unreachable_seconds",
                                          "time the corpus service was unreachable", value=h.total_outage_seconds())
                yield GaugeMetricFamily("ngram_verifier_corpus_unreachable", "1 while the corpus service cannot be reached",
                                        value=int(h.unreachable))
                yield GaugeMetricFamily("ngram_verifier_corpus_remote_drafting",
                                        "1 while drafts use the corpus service (0: held until its namespace is checked, "
                                        "or off after a mismatch)", value=int(h.remote_drafting))
                yield GaugeMetricFamily("ngram_verifier_corpus_namespace_mismatch",
                                        "1 once the corpus namespace was found not to serve this model",
                                        value=int(h.namespace_state == "mismatch"))
        m = e.makespan  # verifier/budget/makespan.py: a busy period runs from an idle engine's first request to its last
        yield GaugeMetricFamily("ngram_verifier_last_makespan_seconds",
                                "the last busy period's length: a batch of requests sent together ends then", value=m.last_s)
        yield CounterMetricFamily("ngram_verifier_busy_periods", "busy periods ended", value=m.periods)
        g = GaugeMetricFamily("ngram_verifier_requests", "live requests by state", labels=["state"])
        g.add_metric(["running"], len(e.scheduler.running))
        g.add_metric(["waiting"], len(e.scheduler.waiting))
        yield g
        yield GaugeMetricFamily("ngram_verifier_budget_calibration", "observed / predicted acceptance",
                                value=e.policy.calibration)
        cal = GaugeMetricFamily("ngram_verifier_budget_rank_calibration",
                                "observed / predicted acceptance by band of draft-node ranks (learned; the node "
                                "choice uses them where BudgetPolicy.rank_bands is on)", labels=["ranks"])
        for j, c in enumerate(e.policy.band_calibrations(learned=True)):
            cal.add_metric([f"{1 << j}-{(2 << j) - 1}"], c)
        yield cal
        b = s.budget
        sw = CounterMetricFamily("ngram_verifier_budget_plain_switches",
                                 "times a batch bucket switched to plain decoding, by why (verifier/budget/policy.py)",
                                 labels=["reason"])
        sw.add_metric(["cost"], b.plain_switches_cost)
        sw.add_metric(["delivered"], b.plain_switches_delivered)
        sw.add_metric(["nothing"], b.plain_switches_nothing)
        sw.add_metric(["critical"], b.plain_switches_critical)
        yield sw
        yield CounterMetricFamily("ngram_verifier_budget_plain_steps_backoff",
                                  "steps decoded plain after drafting steps whose node choice verified no node",
                                  value=b.plain_steps_backoff)
        yield CounterMetricFamily("ngram_verifier_budget_cost_model_refits",
                                  "cost-model refreshes from observed steps", value=b.cost_model_refits)
        # Per request (verifier/budget/request_gate.py): no drafts where its own acceptance does not pay.
        rs = CounterMetricFamily("ngram_verifier_budget_request_no_draft_switches",
                                 "times a request was switched to no drafts within drafting steps, by why",
                                 labels=["reason"])
        rs.add_metric(["acceptance"], b.request_switches_acceptance)
        rs.add_metric(["kind"], b.request_switches_kind)
        yield rs
        yield CounterMetricFamily("ngram_verifier_budget_request_steps_no_draft",
                                  "request-steps of drafting steps in which the request got no drafts (its acceptance "
                                  "did not pay)", value=b.request_steps_held)


class ApiMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ngram_verifier_http_requests", "HTTP requests", ["route", "status"], registry=self.registry)
        self.latency = Histogram("ngram_verifier_request_seconds", "request latency (to the last token)", ["route"],
                                 registry=self.registry)
        self.registry.register(EngineCollector(engine))
