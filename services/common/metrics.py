"""Prometheus metrics of both services (prometheus-client), all prefixed `minite_`.

The serving set is named as vLLM names it (vllm:num_requests_running -> minite_num_requests_running,
...) so dashboards carry over. The drift set is filled from `minite_core.consistency.drift_stats` (the
same function the diagnose CLI and the RL loop use) and from the per-token |Δlogp| values. Each service
has its own registry, so both can live in one process (tests) without clashing.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# |Δlogp| is exactly 0 when the engines agree: the first bucket catches exact equality
DRIFT = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)
SYNC = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RolloutMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("minite_num_requests_running", "Sequences in the decode batch", registry=r)
        self.waiting = Gauge("minite_num_requests_waiting", "Sequences waiting for a KV-cache slot", registry=r)
        self.kv_usage = Gauge("minite_kv_cache_usage_perc", "Fraction of KV-cache slots in use (0-1)", registry=r)
        self.prompt_tokens = Counter("minite_prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generated_tokens = Counter("minite_generated_tokens", "Sampled tokens", registry=r)
        self.ttft = Histogram("minite_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY, registry=r)
        self.itl = Histogram("minite_inter_token_latency_seconds", "Time between a sequence's tokens",
                             buckets=LATENCY, registry=r)
        self.e2e = Histogram("minite_e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=LATENCY, registry=r)
        self.requests = Counter("minite_requests", "Generation requests by protocol and outcome",
                                ["protocol", "status"], registry=r)
        self.weight_version = Gauge("minite_weight_version", "The weight version now serving", registry=r)
        self.sync_seconds = Histogram("minite_weight_sync_seconds", "Receiving and applying one weight push",
                                      buckets=SYNC, registry=r)
        self.sync_bytes = Counter("minite_weight_sync_bytes", "Weight bytes received in accepted pushes", registry=r)
        self.sync_rejected = Counter("minite_weight_sync_rejected", "Weight pushes refused", registry=r)


class LearnerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.abs_diff = Histogram("minite_logprob_abs_diff", "Per-token |rollout logprob - learner logprob|",
                                  buckets=DRIFT, registry=r)
        self.abs_diff_max = Gauge("minite_logprob_abs_diff_max", "Largest per-token |Δlogp| of the last batch", registry=r)
        self.kl_k3 = Gauge("minite_kl_k3", "k3 estimate of KL(rollout || learner), last batch", registry=r)
        self.mismatch = Gauge("minite_token_mismatch_ratio", "Tokens whose |Δlogp| exceeds 1e-3, last batch", registry=r)
        self.bitwise = Gauge("minite_bitwise_equal_ratio", "Tokens whose logprobs are bitwise equal, last batch", registry=r)
        self.weight_version = Gauge("minite_weight_version", "The learner's weight version", registry=r)
        self.sync_seconds = Histogram("minite_weight_sync_seconds", "Pushing one weight version to one replica",
                                      buckets=SYNC, registry=r)
        self.sync_bytes = Counter("minite_weight_sync_bytes", "Weight bytes pushed to replicas", registry=r)
        self.tokens = Counter("minite_learner_tokens", "Completion tokens trained on", registry=r)
        self.steps = Counter("minite_learner_steps", "GRPO steps taken", registry=r)
        self.reward = Gauge("minite_reward_mean", "Mean reward of the last step's completions", registry=r)
        self.reward_by_function = Gauge("minite_reward_function_mean", "Mean reward of each reward function, last "
                                        "step (samples it applies to)", ["function"], registry=r)
        self.eval = Gauge("minite_eval", "The last evaluation on the eval prompts: reward (greedy), accuracy, "
                          "rewards/<function>/mean, sampled/reward, pass@k", ["metric"], registry=r)

    def record_eval(self, m: dict) -> None:
        """An evaluation's `eval/...` metrics (the RL loop's), as minite_eval{metric=...}."""
        for k, v in m.items():
            if k.startswith("eval/") and v == v:  # (NaN: no sample the function applies to)
                self.eval.labels(k[len("eval/"):]).set(v)

    def record_drift(self, diffs, stats) -> None:
        """diffs: per-token |Δlogp| (iterable of floats); stats: a consistency.DriftStats."""
        for d in diffs:
            self.abs_diff.observe(d)
        self.abs_diff_max.set(stats.max_abs_diff)
        self.kl_k3.set(stats.kl_k3)
        self.mismatch.set(stats.mismatch_ratio)
        self.bitwise.set(stats.bitwise_equal_ratio)


def add_metrics_route(app, registry: CollectorRegistry) -> None:
    """GET /metrics on a FastAPI app (exactly that path: no redirect to /metrics/)."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @app.get("/metrics", include_in_schema=False)
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
