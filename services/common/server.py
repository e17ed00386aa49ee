"""gRPC server bootstrap shared by the three services: limits, keepalive, TLS (services/common/
tls.py), health, reflection, the guard interceptor (services/common/guard.py), and the drain on
SIGTERM/SIGINT: health NOT_SERVING first, new work refused, the rest finished within the grace
period, then the server stops."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.guard import Drain, GuardInterceptor, wait_idle
from services.common.tls import ServerTls

log = logging.getLogger("dflash.server")

MiB = 1024 * 1024
STOP_GRACE_S = 2.0


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
                 register: Callable[[grpc.aio.Server], list[str]], tls: ServerTls | None = None,
                 drain: Drain | None = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 max_receive_bytes: int | None = None, internal_token: str = ""
                 ) -> grpc.aio.Server:
    """`register(server)` adds the servicers and returns their full service names. tls None or
    disabled: plaintext. max_receive_bytes: a smaller limit on incoming messages (the gateway's
    public port); requests past a limit are answered RESOURCE_EXHAUSTED by grpc. internal_token:
    the secret every dflash.v1 call must carry (the target and draft; services/common/
    internal_auth.py)."""
    options = server_options(max_message_bytes)
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options,
                             interceptors=[*interceptors, GuardInterceptor(drain, internal_token)])
    names = register(server)
    health_pb2_grpc.add_HealthServicer_to_server(readiness.health, server)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    if tls is not None and tls.enabled:
        bound = server.add_secure_port(address, tls.credentials())
        log.info("TLS on %s%s", address,
                 " (mutual: client certificates required)" if tls.mutual else "")
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def serve_until_stopped(server: grpc.aio.Server, readiness: Readiness, stop: asyncio.Event,
                              drain: Drain | None = None) -> None:
    """After `stop`: NOT_SERVING, then drain (new work refused by the guard; the rest may finish
    until drain.idle() or the grace period), then the server stops, giving RPCs still running
    STOP_GRACE_S (long-lived health Watch streams of clients would otherwise hold it)."""
    await stop.wait()
    drain = drain or Drain(grace_s=5.0)
    t0 = time.monotonic()
    log.info("stopping: health NOT_SERVING, draining for up to %.1f s", drain.grace_s)
    await readiness.set(False)
    drain.draining = True
    idle = await wait_idle(drain)
    await readiness.health.enter_graceful_shutdown()
    await server.stop(STOP_GRACE_S)
    log.info("stopped", extra={"drained": idle, "refused_while_draining": drain.refused,
                               "seconds": round(time.monotonic() - t0, 2)})
