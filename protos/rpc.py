"""gRPC plumbing shared by the router and the workers (no torch): server options, the cluster-secret
check on internal services, health and reflection.

Internal services (workers) require ``authorization: Bearer <cluster secret>`` metadata when a
secret is configured (``PDSERVE_CLUSTER_SECRET`` or ``--cluster-secret``); the router's public
port can require an API key the same way (``api_key``: ``PDSERVE_API_KEY`` or ``--api-key-file``, kept
out of argv). Without a secret, servers bind to loopback only.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
from typing import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import env

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest gRPC message any pdserve service accepts or sends (a 1M-token prompt as ids is ~5 MB)."""

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = SERVER_OPTIONS[:2] + [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]


def cluster_secret(explicit: str | None = None) -> str | None:
    return explicit or env.cluster_secret()


def api_key(explicit: str | None = None, path: str | None = None) -> str | None:
    """The router's public API key, from ``--api-key`` (every user of the machine sees it in ``ps``: a
    warning), else ``--api-key-file`` (the file's content, surrounding whitespace stripped), else
    ``$PDSERVE_API_KEY``. Raises ValueError for both flags at once or an empty file, OSError for an
    unreadable one."""
    if explicit and path:
        raise ValueError("give --api-key or --api-key-file, not both")
    if explicit:
        logger.warning("--api-key is visible to every user of this machine (ps, /proc/PID/cmdline): "
                       "prefer $%s or --api-key-file", env.API_KEY)
        return explicit
    if path:
        with open(path) as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"API key file {path} is empty")
        if os.stat(path).st_mode & 0o077:
            logger.warning("API key file %s is readable by other users: chmod 600 it", path)
        return key
    return env.api_key()


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """``api_key`` of a parser given ``--api-key`` and ``common.flags.add_api_key_file_arg``."""
    return api_key(getattr(args, "api_key", None), getattr(args, "api_key_file", None))


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (health and reflection stay open)."""

    OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, token: str, what: str = "cluster secret") -> None:
        self._token = token.encode()
        self._what = what

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self.OPEN_PREFIXES):
            return await continuation(handler_call_details)
        md = dict(handler_call_details.invocation_metadata or ())
        got = md.get("authorization", "")
        ok = got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), self._token)
        if ok:
            return await continuation(handler_call_details)
        what = self._what
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        # Request-streaming handlers whatever the method: gRPC reads a unary request whole (up to the max
        # receive size) before calling its handler; a stream handler that never reads refuses the call
        # with only the metadata read (20 unauthenticated 60 MiB messages: peak RSS 2 GB -> 65 MB).
        async def deny(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"missing or wrong {what} in 'authorization: Bearer ...' metadata")

        if handler.response_streaming:
            async def deny_stream(request_iterator, context):
                await deny(request_iterator, context)
                yield  # pragma: no cover
            return grpc.stream_stream_rpc_method_handler(deny_stream, request_deserializer=handler.request_deserializer,
                                                         response_serializer=handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(deny, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def make_server(secret: str | None = None, what: str = "cluster secret",
                max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Server:
    """A server whose calls need ``secret``; gRPC refuses a request message over ``max_receive_bytes``
    (RESOURCE_EXHAUSTED) before any handler or interceptor sees it."""
    interceptors = [BearerAuthInterceptor(secret, what)] if secret else []
    options = [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v) for k, v in SERVER_OPTIONS]
    return grpc.aio.server(options=options, interceptors=interceptors)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> health.aio.HealthServicer:
    """Standard health service (overall + each service SERVING) and server reflection."""
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = list(service_names)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return hs


async def set_serving(hs: health.aio.HealthServicer, service_names: Iterable[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await hs.set("", status)
    for n in service_names:
        await hs.set(n, status)
