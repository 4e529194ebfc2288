"""gRPC plumbing both services share: the server (message limits, health checking, reflection, TLS),
the shared-token check, and client channels.

Auth: methods listed as protected need the metadata `authorization: Bearer <token>`; a missing or
wrong token is refused with UNAUTHENTICATED and logged with the method and peer, never the token.
A request that does not parse as its message ends INVALID_ARGUMENT (grpc's own answer is INTERNAL).
"""
from __future__ import annotations

import hmac
import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .settings import MB

log = logging.getLogger("minite.auth")


def token_ok(expected: str | None, header: str | None) -> bool:
    """Does an `authorization` value carry the expected token? (No token configured: everything passes.)"""
    if expected is None:
        return True
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":  # (auth schemes are case-insensitive, RFC 7235)
        return False
    return hmac.compare_digest(token.strip().encode(), expected.encode())


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str | None, protected: set[str]):
        self.token, self.protected = token, protected

    def intercept_service(self, continuation, details):
        if self.token is None or details.method not in self.protected:
            return continuation(details)
        header = dict(details.invocation_metadata).get("authorization")
        if token_ok(self.token, header):
            return continuation(details)
        reason = "missing" if not header else "wrong"
        handler = continuation(details)

        def deny(_request, context):
            log.warning("refused %s: %s token (peer %s)", details.method, reason, context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{reason} token: {details.method} needs "
                          "'authorization: Bearer <token>' metadata")
        if handler is not None and handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler is not None and handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class DecodeInterceptor(grpc.ServerInterceptor):
    """Parse requests ourselves so that bytes that are not the method's message end INVALID_ARGUMENT with
    the message type named (grpc would answer INTERNAL "Exception deserializing request!")."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        desc = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        what = desc.full_name if desc is not None else "request"

        def decode(raw, context):
            try:
                return parse(raw)
            except Exception as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {what} message: {e}")

        out = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                lambda it, ctx: handler.stream_stream((decode(r, ctx) for r in it), ctx), response_serializer=out)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                lambda it, ctx: handler.stream_unary((decode(r, ctx) for r in it), ctx), response_serializer=out)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                lambda raw, ctx: handler.unary_stream(decode(raw, ctx), ctx), response_serializer=out)
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, ctx: handler.unary_unary(decode(raw, ctx), ctx), response_serializer=out)


def message_options(max_mb: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_mb * MB), ("grpc.max_send_message_length", max_mb * MB)]


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_reflection(server, service_names: list[str]) -> None:
    """Server reflection, v1 and v1alpha (grpcurl and Postman ask for v1, older tools for v1alpha).
    grpcio-reflection ships only v1alpha; v1 is the same protocol with the same messages under another
    package name, so its method is served by the same servicer (the bytes on the wire are identical)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    servicer = reflection.ReflectionServicer(service_names + [reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),))


def make_server(settings, service_names: list[str], add_servicers, *, protected: set[str], workers: int = 32):
    """A started gRPC server on settings.host:settings.grpc_port with health (SERVING for every service)
    and reflection; `add_servicers(server)` registers ours. Returns (server, bound port, health servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                         interceptors=[TokenInterceptor(settings.token, protected), DecodeInterceptor()],
                         # no SO_REUSEPORT (grpc's default): a second server on a port in use must fail to bind,
                         # not start "ready" and take part of the traffic, weight pushes included
                         options=message_options(settings.max_message_mb) + [("grpc.so_reuseport", 0)],
                         maximum_concurrent_rpcs=4 * workers)
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_reflection(server, service_names + [health.SERVICE_NAME])
    address = f"{settings.host}:{settings.grpc_port}"
    try:
        if settings.tls_cert:
            creds = grpc.ssl_server_credentials([(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # (grpc >= 1.60 raises "Failed to bind"; older versions return 0)
        port = 0
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}: the port is in use (or the address is not this host's)")
    server.start()
    for name in service_names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def channel(address: str, settings) -> grpc.Channel:
    """A client channel to another miniTE service, TLS when settings.tls_ca is set."""
    opts = message_options(settings.max_message_mb)
    if settings.tls_ca:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(settings.tls_ca.read_bytes()), options=opts)
    return grpc.insecure_channel(address, options=opts)


def auth_metadata(settings) -> tuple:
    return (("authorization", f"Bearer {settings.token}"),) if settings.token else ()
