"""The two engines: RolloutEngine samples with a KV cache, Learner scores full sequences; both call
the same `minite_core.ops`, so their logprobs agree bit for bit."""
from .learner import Learner
from .rollout import Completion, RolloutEngine, SamplingParams, check_temperature

__all__ = ["Completion", "Learner", "RolloutEngine", "SamplingParams", "check_temperature"]
