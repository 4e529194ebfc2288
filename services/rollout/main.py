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


def start_grpc(settings: RolloutSettings, runtime: RolloutRuntime):
    """The started gRPC server of this service -> (server, bound port, health servicer)."""
    return rpc.make_server(
        settings, [SERVICE], lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(runtime), s),
        protected=PROTECTED)


def serve(settings: RolloutSettings) -> None:
    setup_logging(settings.log_level)
    runtime = RolloutRuntime(settings)
    server, port, health = start_grpc(settings, runtime)

    def ready(http):
        http_port = http.servers[0].sockets[0].getsockname()[1] if http.servers else settings.http_port
        # one parseable line: tests and `minite up` read the bound ports from it
        print(f"minite-rollout ready grpc={port} http={http_port} model={settings.model_name} "
              f"weight_version={runtime.version}", flush=True)
    try:
        run_http(build_app(runtime), settings, on_ready=ready)
    finally:
        log.info("shutting down: draining requests in flight")
        for name in (SERVICE, ""):
            health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        runtime.drain(timeout=30)
        server.stop(grace=5).wait()
        runtime.stop()


def main(argv: list[str]) -> int:
    settings = parse(RolloutSettings, argv, "minite rollout")
    try:
        serve(settings)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # start-up problems: a model dir, a port, a flag
        print(f"minite rollout: error: {e}", file=sys.stderr)
        return 2
    return 0
