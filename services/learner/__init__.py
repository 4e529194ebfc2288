"""The learner service: the GRPO loop over remote rollout replicas, behind gRPC (minite.v1.LearnerService) and REST."""
