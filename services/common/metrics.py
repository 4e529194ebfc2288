"""Prometheus metrics of both services (prometheus-client), all prefixed `minite_`.

The serving set is named and labelled as vLLM does it (vllm:num_requests_running{model_name=...} ->
minite_num_requests_running{model_name=...}, vllm:generation_tokens_total -> minite_generation_tokens_total,
...) so dashboards and alerts carry over; `model_name` is the served model name GET /v1/models reports.
The weight-sync set has no model_name: the learner exports the same names, and the dashboard compares them.

The drift set is filled from `minite_core.consistency.drift_stats` (the same function the diagnose CLI and
the RL loop use) and from the per-token |Δlogp| values. The training set (`minite_learner_*`) is the
learner's per-step metrics dict, the same keys the RL loop writes to metrics.jsonl, so Prometheus and
metrics.jsonl agree.

Each service has its own registry, so both can live in one process (tests) without clashing; each registry
also carries the process_* (CPU, memory, open fds, start time), python_info and python_gc_* collectors of
the process it runs in (two ProcessCollectors in one process are fine: each is on its own registry).
"""
from __future__ import annotations

import math

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector,
                               ProcessCollector)

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# |Δlogp| is exactly 0 when the engines agree: the first bucket catches exact equality
DRIFT = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)
SYNC = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# metrics.jsonl key (minite_core/rl/trainer.py, grpo.py) -> (gauge name, help) of the learner's last step
TRAINING = {
    "loss": ("minite_learner_loss", "GRPO loss of the last step"),
    "kl": ("minite_learner_kl", "Mean per-token KL(policy || reference), k3 estimate, last step (0 when beta = 0: "
           "no reference model)"),
    "entropy": ("minite_learner_entropy", "Mean per-token entropy of the policy on the last step's completions"),
    "grad_norm": ("minite_learner_grad_norm", "Gradient norm of the last step, before clipping"),
    "clip_ratio": ("minite_learner_clip_ratio", "Fraction of the last step's completion tokens whose ratio was "
                   "clipped"),
}


def _number(v) -> float | None:
    """v as a float, or None when it is not a number (a missing key, a string, None)."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    GCCollector(registry=r)
    return r


class _ModelLabelled:
    """A labelled metric with its first label (model_name) fixed: callers name the other labels only,
    `.labels(protocol, status)`."""

    def __init__(self, metric, model_name: str):
        self.metric, self.model_name = metric, model_name

    def labels(self, *values):
        return self.metric.labels(self.model_name, *values)


class RolloutMetrics:
    def __init__(self, model_name: str):
        r = self.registry = _registry()
        m = ["model_name"]

        def serving(kind, name, doc, **kw):  # one child: the served model's
            return kind(name, doc, m, registry=r, **kw).labels(model_name)

        self.running = serving(Gauge, "minite_num_requests_running", "Sequences in the decode batch")
        self.waiting = serving(Gauge, "minite_num_requests_waiting", "Sequences waiting for a KV-cache slot")
        self.kv_usage = serving(Gauge, "minite_kv_cache_usage_perc", "Fraction of KV-cache slots in use (0-1)")
        self.prompt_tokens = serving(Counter, "minite_prompt_tokens", "Prefilled prompt tokens")
        # (vLLM: vllm:generation_tokens_total; the attribute keeps its old name)
        self.generated_tokens = serving(Counter, "minite_generation_tokens", "Sampled (generated) tokens")
        self.ttft = serving(Histogram, "minite_time_to_first_token_seconds", "Request arrival to its first token",
                            buckets=LATENCY)
        self.itl = serving(Histogram, "minite_inter_token_latency_seconds", "Time between a sequence's tokens",
                           buckets=LATENCY)
        self.e2e = serving(Histogram, "minite_e2e_request_latency_seconds", "Request arrival to its last token",
                           buckets=LATENCY)
        self.requests = _ModelLabelled(Counter("minite_requests", "Generation requests by protocol and outcome",
                                               m + ["protocol", "status"], registry=r), model_name)
        self.weight_version = Gauge("minite_weight_version", "The weight version now serving", registry=r)
        self.sync_seconds = Histogram("minite_weight_sync_seconds", "Receiving and applying one weight push",
                                      buckets=SYNC, registry=r)
        self.sync_bytes = Counter("minite_weight_sync_bytes", "Weight bytes received in accepted pushes", registry=r)
        self.sync_rejected = Counter("minite_weight_sync_rejected", "Weight pushes refused (malformed, corrupt, "
                                     "stale or abandoned)", registry=r)


class LearnerMetrics:
    def __init__(self):
        r = self.registry = _registry()
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
        self.training = {k: Gauge(name, doc, registry=r) for k, (name, doc) in TRAINING.items()}
        self.step_seconds = Histogram("minite_learner_step_seconds", "Wall time of one GRPO step: sampling, "
                                      "rewards, scoring, the optimizer step and the weight push", buckets=STEP,
                                      registry=r)

    def record_step(self, m: dict) -> None:
        """A step's metrics dict (the RL loop's, as written to metrics.jsonl). A key that is missing or not a
        number is left out; a NaN or infinite loss, KL, entropy or grad norm is exported as it is (a diverged
        step shows as NaN / +Inf, not as the last good value); counters and the step-time histogram take
        finite values only (one NaN would poison their sums for the life of the process)."""
        tokens, seconds, reward = (_number(m.get(k)) for k in ("tokens", "seconds", "reward"))
        self.steps.inc()
        if tokens is not None and math.isfinite(tokens) and tokens >= 0:
            self.tokens.inc(tokens)
        if seconds is not None and math.isfinite(seconds) and seconds >= 0:
            self.step_seconds.observe(seconds)
        if reward is not None:
            self.reward.set(reward)
        for k, v in m.items():
            if k.startswith("rewards/") and k.endswith("/mean") and (v := _number(v)) is not None and v == v:
                self.reward_by_function.labels(k[len("rewards/"):-len("/mean")]).set(v)  # (NaN: none applies)
        for k, gauge in self.training.items():
            if (v := _number(m.get(k))) is not None:
                gauge.set(v)

    def record_eval(self, m: dict) -> None:
        """An evaluation's `eval/...` metrics (the RL loop's), as minite_eval{metric=...}."""
        for k, v in m.items():
            if k.startswith("eval/") and (v := _number(v)) is not None and v == v:  # (NaN: no sample applies)
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
