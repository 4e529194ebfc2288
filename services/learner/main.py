"""`minite learner`: the learner service process (GRPO loop + gRPC + REST + /metrics)."""
from __future__ import annotations

import logging
import sys
import threading

from grpc_health.v1 import health_pb2

from minite.v1 import learner_pb2, learner_pb2_grpc

from ..common import rpc
from ..common.serve import run_http, setup_logging
from ..common.settings import LearnerSettings, parse
from .grpc_api import PROTECTED, LearnerServicer
from .rest import build_app
from .runtime import LearnerRuntime

log = logging.getLogger("minite.learner")
SERVICE = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name


def start_grpc(settings: LearnerSettings, runtime: LearnerRuntime):
    """The started gRPC server of this service -> (server, bound port, health servicer)."""
    return rpc.make_server(
        settings, [SERVICE], lambda s: learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(runtime), s),
        protected=PROTECTED)


def serve(settings: LearnerSettings) -> bool:
    setup_logging(settings)
    runtime = LearnerRuntime(settings)
    server, port, health = start_grpc(settings, runtime)

    def ready(http):
        http_port = http.servers[0].sockets[0].getsockname()[1] if http.servers else settings.http_port
        print(f"minite-learner ready grpc={port} http={http_port} weight_version={runtime.version}", flush=True)
        runtime.start()
        if settings.exit_when_done:  # `minite up`: end the process once training is over
            def watch():
                runtime.thread.join()
                http.should_exit = True
            threading.Thread(target=watch, daemon=True).start()
    stopped = {"loop_was_running": False}

    def stop_training():  # on SIGTERM/SIGINT: the step in progress finishes (or is cut), then the loop ends
        for name in (SERVICE, ""):
            health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        stopped["loop_was_running"] = runtime.thread.is_alive()
        _stop_loop(runtime, settings.drain_timeout)

    try:
        run_http(build_app(runtime), settings, on_ready=ready, on_stop=stop_training)
    finally:
        for name in (SERVICE, ""):
            health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if not stopped["loop_was_running"]:
            stopped["loop_was_running"] = runtime.thread.is_alive()
        _stop_loop(runtime, settings.drain_timeout)
        if not runtime.thread.is_alive():
            runtime.trainer.end()  # (a data-parallel learner: release the other ranks, if the loop did not)
        server.stop(grace=3).wait()
        log.info("stopped")
    # a non-zero exit when the training loop failed on its own (not when it was stopped in a step that waited)
    return stopped["loop_was_running"] or not (runtime.last_error and not runtime.done)


def _stop_loop(runtime: LearnerRuntime, timeout: float) -> None:
    """Stop the training loop: up to `timeout` s for the step in progress, then its calls to the rollout
    replicas are cancelled (their channels closed), so no thread is left waiting on a replica that does
    not answer (the process would otherwise hang at exit until the calls' own timeouts)."""
    runtime.stopping.set()
    if runtime.thread.is_alive():
        runtime.thread.join(timeout)
    if runtime.thread.is_alive():
        log.warning("the step in progress did not end within %.0f s: cancelling its calls to the replicas", timeout)
    for rep in runtime.rollout.replicas:
        rep.channel.close()  # (a no-op once closed; the learner makes no more calls now)
    if runtime.thread.is_alive():
        runtime.thread.join(5)
    runtime.rollout.pool.shutdown(wait=False, cancel_futures=True)


def follow(settings: LearnerSettings) -> None:
    """A data-parallel rank other than 0: no servers; train with rank 0 until it ends the run."""
    import signal

    from minite_core.rl.loop import run
    from minite_core.rl.trainer import Follower, Trainer

    setup_logging(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains and ends the run; torchrun SIGKILLs a stuck rank
        signal.signal(sig, signal.SIG_IGN)
    run(settings, trainer=Trainer(settings, Follower()))


def main(argv: list[str]) -> int:
    settings = parse(LearnerSettings, argv, "minite learner")
    try:
        if settings.data_parallel != "none":
            from minite_core.rl import distributed

            group = distributed.setup(settings.data_parallel)
            if not group.leader:
                follow(settings)
                return 0
        if not serve(settings):
            return 1
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # start-up problems: a model dir, a port, a flag
        print(f"minite learner: error: {e}", file=sys.stderr)
        return 2
    return 0
