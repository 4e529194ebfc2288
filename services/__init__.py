"""The miniTE services: a rollout service (gRPC + OpenAI-compatible REST) and a learner service (GRPO).

They hold no numerics: every tensor operation comes from `minite_core`; these packages are transport,
scheduling threads, validation, auth and metrics.
"""
