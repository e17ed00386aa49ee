"""gRPC server bootstrap shared by the model services: limits, keepalive, health, reflection,
and a graceful stop on SIGTERM/SIGINT (health goes NOT_SERVING first)."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("dflash.server")

MiB = 1024 * 1024


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # accept client keepalive pings every >= 10 s, also without calls in flight
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


class Readiness:
    """grpc.health.v1 status for one service name plus "" (liveness). NOT_SERVING until
    `set_serving()`; listeners (metrics gauges) are told of every change."""

    def __init__(self, service_name: str) -> None:
        self.service_name = service_name
        self.health = health.aio.HealthServicer()
        self.ready = False
        self.listeners: list[Callable[[bool], None]] = []

    async def start(self) -> None:
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set(self, ready: bool) -> None:
        from services.common import metrics
        metrics.set_ready(ready)
        self.ready = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(self.service_name, status)
        for fn in self.listeners:
            fn(ready)
        log.info("health %s -> %s", self.service_name, "SERVING" if ready else "NOT_SERVING")


def build_server(port: int, host: str, max_message_bytes: int, readiness: Readiness,
                 register: Callable[[grpc.aio.Server], list[str]]) -> grpc.aio.Server:
    """`register(server)` adds the servicers and returns their full service names."""
    server = grpc.aio.server(options=server_options(max_message_bytes))
    names = register(server)
    health_pb2_grpc.add_HealthServicer_to_server(readiness.health, server)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def serve_until_stopped(server: grpc.aio.Server, readiness: Readiness, stop: asyncio.Event,
                              grace_s: float = 5.0) -> None:
    await stop.wait()
    log.info("stopping: health NOT_SERVING, draining for up to %.1f s", grace_s)
    await readiness.set(False)
    await readiness.health.enter_graceful_shutdown()
    await server.stop(grace_s)
