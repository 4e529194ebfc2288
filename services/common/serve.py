"""Running a service process: logging, the HTTP server (uvicorn) next to the gRPC server, and an
orderly stop on SIGTERM/SIGINT (stop taking work, drain what is in flight, then exit)."""
from __future__ import annotations

import logging

import uvicorn


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_http(app, settings, on_ready=None) -> None:
    """Serve `app` on settings.host:settings.http_port until SIGTERM/SIGINT (blocking)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning",
                            ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
                            ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            on_ready(server)
        server.startup = startup
    server.run()
