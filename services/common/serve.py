"""Running a service process: logging, the HTTP server (uvicorn) next to the gRPC server, and an
orderly stop on SIGTERM/SIGINT (stop taking work, drain what is in flight, then exit 0).

The stop, in order: the first SIGTERM/SIGINT calls the service's `on_stop` on a thread while HTTP keeps
answering (new work gets 503, /health says "draining", responses in flight keep streaming); when it
returns (the work in flight finished, or its time ran out and the rest was cut), the HTTP server closes
its listener, lets the open responses end (at most HTTP_CLOSE_S) and `run_http` returns, so the caller
stops its gRPC server and exits 0. A second signal stops at once. (uvicorn's own handling would close
the listener first, so new requests saw a refused connection rather than 503, and would re-raise the
signal once it returned, killing the process with -15 before the gRPC calls in flight were finished.)

HTTP connections have read deadlines (GuardedH11): a request head within --http-header-timeout of the
first byte, a request body that keeps arriving (--http-body-timeout between reads), and idle keep-alive
connections closed after --http-keep-alive.
"""
from __future__ import annotations

import logging
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("minite.serve")
HTTP_CLOSE_S = 5.0  # after the drain: how long open HTTP responses get to end before they are cut


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, which it lacks: a connection must complete a request's
    head (request line and headers) within `header_timeout` s of its first byte (or of the connection, for
    one that sends nothing), so a slowloris client that trickles a byte at a time is closed too; a request
    body must keep arriving (at most `body_timeout` s between reads), so a lying Content-Length cannot hold
    a connection. Between requests uvicorn's own keep-alive timeout closes an idle connection."""

    header_timeout = 10.0
    body_timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self._body_timer = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._cancel("_head_timer")
        self._cancel("_body_timer")
        super().connection_lost(exc)

    def _arm(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:  # waiting for (the rest of) a request head: one deadline, not reset by data
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.header_timeout, self._expire, "request head")
        else:
            self._cancel("_head_timer")
        self._cancel("_body_timer")
        if state is h11.SEND_BODY:  # (reset on every read: a slow upload is fine, a stalled one is not)
            self._body_timer = self.loop.call_later(self.body_timeout, self._expire, "request body")

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name, None)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _expire(self, what: str) -> None:
        if not self.transport.is_closing():
            log.info("closing %s:%s: no complete %s in time", *(self.client or ("?", "?")), what)
            self.transport.close()


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
    protocol = type("GuardedH11", (GuardedH11,), {"header_timeout": settings.http_header_timeout,
                                                  "body_timeout": settings.http_body_timeout})
    config = uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning",
                            ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
                            ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
                            timeout_graceful_shutdown=HTTP_CLOSE_S, http=protocol,
                            timeout_keep_alive=settings.http_keep_alive)
    server = _Server(config, on_stop)
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            on_ready(server)
        server.startup = startup
    server.run()
    return not server.forced
