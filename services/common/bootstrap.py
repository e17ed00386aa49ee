"""The life of a model service process (target, draft), shared by both `__main__`s:

    listen      gRPC server up, health "" SERVING, the service name NOT_SERVING
                (docs/architecture.md §7)
    start-up    the service's own stages (weights, pools, backends, graphs, warm-up), one
                engine at the end; a refusal (StartRefused) exits with EXIT_REFUSED
    serve       health SERVING until SIGTERM / SIGINT
    drain       NOT_SERVING, new sequences refused, the others finish within --drain-grace

The service plugs in its servicer (which answers UNAVAILABLE until its engine is attached), the
RPCs it refuses while draining, and its start-up stages."""
from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc

from runtime import threads
from services.common import metrics, tls
from services.common.call_socket import CallSocket, SocketMethod
from services.common.guard import Drain
from services.common.logs import setup_logging
from services.common.metrics_server import start_metrics
from services.common.server import (
    MiB,
    Readiness,
    build_server,
    install_stop_signals,
    serve_until_stopped,
)

log = logging.getLogger("dflash.service")

EXIT_REFUSED = 2
T = TypeVar("T")


class StartRefused(Exception):
    """Start-up found the service cannot serve what it was given (say why): exit EXIT_REFUSED."""


class Engine(Protocol):
    seqs: dict[str, Any]

    def stop(self) -> None: ...


class Servicer(Protocol):
    engine: Engine | None            # attached by start-up; None: every RPC answers UNAVAILABLE
    call_socket: str                 # advertised in its capabilities ("" = none) ...
    call_socket_id: str              # ... with the id its hello answers


@dataclass
class ModelService:
    role: str                                            # "target" | "draft": logs and metrics
    service_name: str                                    # health name, e.g. dflash.v1.Target
    metrics_model: str                                   # the model_name label of its metrics
    servicer: Servicer
    register: Callable[[grpc.aio.Server], list[str]]     # adds the servicer, returns its names
    refuse_while_draining: Callable[[str, Any], bool]    # (method, request) -> refuse it
    start: Callable[[], Awaitable[Engine]]               # the start-up stages, in order
    # its <M>Stream methods by call name, served on --call-socket too (call_socket.py)
    socket_methods: dict[str, SocketMethod] = field(default_factory=dict)

    def live_sequences(self) -> int:
        engine = self.servicer.engine
        return len(engine.seqs) if engine is not None else 0


async def serve(args: argparse.Namespace, service: ModelService) -> int:
    """Listens, starts up, serves until a stop signal, drains; returns the exit code."""
    metrics.init(service.metrics_model, service.role)
    readiness = Readiness(service.service_name)
    await readiness.start()
    drain = Drain(args.drain_grace, idle=lambda: not service.live_sequences(),
                  refuse=service.refuse_while_draining)
    server = build_server(args.port, args.host, args.max_message_mib * MiB, readiness,
                          service.register, tls=tls.server_from_args(args), drain=drain,
                          internal_token=args.internal_token)
    await server.start()
    log.info("listening (NOT_SERVING until ready)", extra={"port": args.port})
    sock = call_socket(args, service, drain)
    if sock is not None:
        await sock.start()
        service.servicer.call_socket, service.servicer.call_socket_id = sock.path, sock.id
    stop = asyncio.Event()
    install_stop_signals(stop)
    start_metrics(args.metrics_port, args.host)
    try:
        engine = await service.start()
    except StartRefused as e:
        log.error("refusing to serve: %s", e)
        await server.stop(0)
        return EXIT_REFUSED
    await readiness.set(True)
    try:
        await serve_until_stopped(server, readiness, stop, drain)
    finally:
        if sock is not None:
            await sock.close()
        engine.stop()
    return 0


def call_socket(args: argparse.Namespace, service: ModelService, drain: Drain) -> CallSocket | None:
    """--call-socket PATH: the per-step call streams on a unix socket too, with the same token
    and the same drain refusals as the gRPC port (not with TLS: check_server_tls refuses the
    flags)."""
    if not args.call_socket:
        return None
    return CallSocket(args.call_socket, service.socket_methods, args.internal_token,
                      drain,
                      args.max_message_mib * MiB)


async def stage(fn: Callable[..., T], *args: Any) -> T:
    """A blocking start-up stage, run off the event loop (health keeps answering) on one thread:
    only the engine thread computes in parallel (runtime/threads.py)."""
    return await asyncio.to_thread(threads.serially, fn, *args)


def run(role: str, argv: list[str] | None, parse_args: Callable[[list[str] | None], Any],
        build: Callable[[Any], ModelService]) -> int:
    """A service's `main`: arguments, logs, then `serve`. `build(args)` makes the service; a
    ValueError from it (a bad configuration) exits with EXIT_REFUSED."""
    threads.serial()            # only the engine thread computes in parallel (runtime/threads.py)
    args = parse_args(argv)
    setup_logging(args.log_level, role)
    try:
        service = build(args)
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return EXIT_REFUSED
    return asyncio.run(serve(args, service))
