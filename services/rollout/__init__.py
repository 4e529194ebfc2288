"""The rollout service: the RolloutEngine behind gRPC (minite.v1.RolloutService) and REST (OpenAI-compatible)."""
