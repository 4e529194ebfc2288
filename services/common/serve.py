"""Running a service process: logging, the HTTP server (uvicorn) next to the gRPC server, and an
orderly stop on SIGTERM/SIGINT (stop taking work, drain what is in flight, then exit 0).

The stop, in order: the first SIGTERM/SIGINT calls the service's `on_stop` on a thread while HTTP keeps
answering (new work gets 503, /health says "draining", responses in flight keep streaming); when it
returns (the work in flight finished, or its time ran out and the rest was cut), the HTTP server closes
its listener, lets the open responses end (at most HTTP_CLOSE_S) and `run_http` returns, so the caller
stops its gRPC server and exits 0. A second signal stops at once. (uvicorn's own handling would close
the listener first, so new requests saw a refused connection rather than 503, and would re-raise the
signal once it returned, killing the process with -15 before the gRPC calls in flight were finished.)
"""
from __future__ import annotations

import logging
import threading

import uvicorn

log = logging.getLogger("minite.serve")
HTTP_CLOSE_S = 5.0  # after the drain: how long open HTTP responses get to end before they are cut


def setup_logging(settings) -> None:
    """Logging at the settings' level; a warning when the service runs without a token (settings.py allows
    that only on a loopback address, or with --insecure)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.token is None:
        log.warning("no auth token (MINITE_AUTH_TOKEN): anyone who can reach %s may push weights, score and "
                    "control this service%s", settings.host, "" if not settings.insecure else " (--insecure)")


class _Server(uvicorn.Server):
    """uvicorn.Server with the stop described above. The signal handler only records the signal; the
    drain thread is started from the event loop (on_tick, every 0.1 s), not from the handler."""

    def __init__(self, config, on_stop=None):
        super().__init__(config)
        self.on_stop = on_stop
        self.stop_signal: int | None = None
        self.drainer: threading.Thread | None = None
        self.forced = False

    def handle_exit(self, sig, frame) -> None:  # (not re-raised after the stop: an orderly stop exits 0)
        if self.stop_signal is not None or self.on_stop is None:
            if self.stop_signal is not None:  # a second signal: open responses get 1 s, then they are cut
                self.forced = True
                self.config.timeout_graceful_shutdown = 1
            self.should_exit = True
        self.stop_signal = sig

    def _drain(self) -> None:
        try:
            self.on_stop()
        except Exception:
            log.exception("draining failed; stopping now")
        finally:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.stop_signal is not None and self.drainer is None and self.on_stop is not None and not self.should_exit:
            log.info("signal %d: stopping; new work is refused, the work in flight finishes", self.stop_signal)
            self.drainer = threading.Thread(target=self._drain, name="drain", daemon=True)
            self.drainer.start()
        return await super().on_tick(counter)


def run_http(app, settings, on_ready=None, on_stop=None) -> bool:
    """Serve `app` on settings.host:settings.http_port until SIGTERM/SIGINT (blocking), stopping as the
    module docstring says: `on_stop()` (blocking, on a thread) drains the service while HTTP still
    answers. Returns False when the stop was forced (a second signal), True otherwise."""
    config = uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning",
                            ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
                            ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
                            timeout_graceful_shutdown=HTTP_CLOSE_S)
    server = _Server(config, on_stop)
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            on_ready(server)
        server.startup = startup
    server.run()
    return not server.forced
