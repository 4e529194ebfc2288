"""minite.v1.LearnerService over gRPC: SubmitTrajectories, Score and ScoreBatch (each needs the token when
one is configured: scoring runs on the training loop's engine and lock, as REST's /v1/score), Status.
A ScoreBatch holds at most MAX_SCORE_BATCH sequences (a bounded share of the learner; it is scored a
row group at a time, the training step first: common/turns.py CountedLock)."""
from __future__ import annotations

import grpc

from minite.v1 import learner_pb2 as pb
from minite.v1 import learner_pb2_grpc as pb_grpc

from .runtime import LearnerRuntime, StaleVersion, UnknownVersion

PROTECTED = {"/minite.v1.LearnerService/SubmitTrajectories", "/minite.v1.LearnerService/Score",
             "/minite.v1.LearnerService/ScoreBatch"}
MAX_TRAJECTORIES = 4096  # per call: bounded memory (each is also bounded by the model's context)
MAX_SCORE_BATCH = 256  # sequences per ScoreBatch: 4 row groups of SCORE_BATCH; more calls for more


class LearnerServicer(pb_grpc.LearnerServiceServicer):
    def __init__(self, runtime: LearnerRuntime):
        self.rt = runtime

    def SubmitTrajectories(self, request_iterator, context):
        batch = []
        try:
            for t in request_iterator:  # checked as they arrive: nothing unbounded is buffered
                if len(batch) == MAX_TRAJECTORIES:
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {MAX_TRAJECTORIES} trajectories in one call")
                traj = {"prompt_ids": list(t.prompt_ids), "completion_ids": list(t.completion_ids),
                        "rollout_logprobs": list(t.rollout_logprobs), "reward": t.reward,
                        "weight_version": t.weight_version, "temperature": t.temperature or 1.0}
                self.rt.check_trajectory(traj, len(batch))
                batch.append(traj)
            stats = self.rt.submit(batch)
        except StaleVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.SubmitSummary(accepted=len(batch), tokens=stats.tokens, logprob_abs_diff_max=stats.max_abs_diff,
                                kl_k3=stats.kl_k3, bitwise_equal_ratio=stats.bitwise_equal_ratio)

    def Score(self, request, context):
        try:
            lps, version = self.rt.score(list(request.prompt_ids), list(request.completion_ids),
                                         request.temperature or 1.0, request.weight_version)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnknownVersion as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.ScoreResponse(logprobs=lps, weight_version=version)

    def ScoreBatch(self, request, context):
        if len(request.items) > MAX_SCORE_BATCH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.items)} items: at most {MAX_SCORE_BATCH} "
                          "per ScoreBatch call (split the batch)")
        if not request.items:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no items to score")
        try:
            results = self.rt.score_batch([(list(r.prompt_ids), list(r.completion_ids), r.temperature or 1.0,
                                            r.weight_version) for r in request.items])
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnknownVersion as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.ScoreBatchResponse(results=[pb.ScoreResponse(logprobs=lps, weight_version=v) for lps, v in results])

    def Status(self, request, context):
        s = self.rt.status()
        return pb.StatusResponse(step=s["step"], weight_version=s["weight_version"], total_steps=s["total_steps"],
                                 running=s["running"], done=s["done"], reward_mean=s["reward_mean"],
                                 logprob_abs_diff_max=s["logprob_abs_diff_max"],
                                 rollout_replicas=s["rollout_replicas"], last_error=s["last_error"])
