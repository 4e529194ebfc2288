"""`minite rollout`: the rollout service process (gRPC + REST + /metrics on one engine)."""
from __future__ import annotations

import logging
import sys

from grpc_health.v1 import health_pb2

from minite.v1 import rollout_pb2, rollout_pb2_grpc

from ..common import rpc
from ..common.serve import run_http, setup_logging
from ..common.settings import RolloutSettings, parse
from .grpc_api import PROTECTED, RolloutServicer
from .rest import build_app
from .runtime import RolloutRuntime

log = logging.getLogger("minite.rollout")
SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


GRPC_SPARE_WORKERS = 16  # beyond one per admissible call: health checks, weight pushes and refusals get a thread
GRPC_STOP_GRACE_S = 3.0  # after the drain: how long gRPC calls still sending their answer get


def start_grpc(settings: RolloutSettings, runtime: RolloutRuntime):
    """The started gRPC server of this service -> (server, bound port, health servicer).

    A Generate call holds a worker thread until its completion is done, and at most max_slots +
    max_waiting calls can be admitted at once (each holds >= 1 sequence, running or waiting): with that
    many workers and a few to spare, admitted calls never take every thread, so health checks, weight
    pushes and refusals are answered at once however full the queue is."""
    workers = settings.max_slots + settings.max_waiting + GRPC_SPARE_WORKERS
    return rpc.make_server(
        settings, [SERVICE], lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(runtime), s),
        protected=PROTECTED, workers=workers)


def serve(settings: RolloutSettings) -> None:
    setup_logging(settings)
    runtime = RolloutRuntime(settings)
    server, port, health = start_grpc(settings, runtime)

    def ready(http):
        http_port = http.servers[0].sockets[0].getsockname()[1] if http.servers else settings.http_port
        # one parseable line: tests and `minite up` read the bound ports from it
        print(f"minite-rollout ready grpc={port} http={http_port} model={settings.model_name} "
              f"weight_version={runtime.version}", flush=True)

    def stop_taking_work():  # on SIGTERM/SIGINT, while HTTP and gRPC still answer (new work: 503 / UNAVAILABLE)
        for name in (SERVICE, ""):
            health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        drained = runtime.drain(timeout=settings.drain_timeout)
        log.info("drained: %s", "every request in flight finished" if drained else "the rest was cut")

    orderly = False
    try:
        orderly = run_http(build_app(runtime), settings, on_ready=ready, on_stop=stop_taking_work)
    finally:
        for name in (SERVICE, ""):
            health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        runtime.drain(timeout=0 if not orderly else settings.drain_timeout)  # (done already after a signal)
        server.stop(grace=GRPC_STOP_GRACE_S if orderly else 0.5).wait()
        runtime.stop()
        log.info("stopped")


def main(argv: list[str]) -> int:
    settings = parse(RolloutSettings, argv, "minite rollout")
    try:
        serve(settings)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # start-up problems: a model dir, a port, a flag
        print(f"minite rollout: error: {e}", file=sys.stderr)
        return 2
    return 0
