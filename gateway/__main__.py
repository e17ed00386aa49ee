"""python -m gateway --target HOST:PORT [--draft HOST:PORT] --tokenizer DIR --port P --http-port H

The gateway: gRPC dflash.v1.Gateway and the OpenAI-compatible HTTP API in one process and one
event loop. It serves only after its upstreams are SERVING and compatible
(docs/architecture.md §7)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import ssl
import sys

import grpc
import uvicorn

from gateway import background, grpc_api
from gateway import config as gateway_config
from gateway.auth import ApiKeyInterceptor, ApiKeys
from gateway.config import GatewayConfig
from gateway.http_api import build_app
from gateway.service import GatewayService
from gateway.state import GatewayState
from services.common import tls
from services.common.guard import Drain, wait_idle
from services.common.logs import setup_logging
from services.common.server import build_server, install_stop_signals

log = logging.getLogger("dflash.gateway")
GRACE_S = 5.0


class HttpServer(uvicorn.Server):
    """uvicorn on the running loop; signals are the gateway's, not uvicorn's."""

    task: asyncio.Task

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.splitlines()[0])
    gateway_config.add_arguments(p)
    args = p.parse_args(argv)
    try:
        config = gateway_config.from_args(args)
        tls.check_readable(config.server_tls, config.upstream_tls)
    except ValueError as e:            # TlsConfigError too
        p.error(str(e))
    return config


async def serve(config: GatewayConfig) -> int:
    state = GatewayState(config)
    service = GatewayService(state)
    await state.readiness.start()           # health: "" SERVING, dflash.v1.Gateway NOT_SERVING
    grpc_server = await _start_grpc(config, state, service) if config.port else None
    http = None
    if config.http_port:
        http = await _start_http(config, service)
        if http is None:
            await state.close()
            return 1
    log.info("listening (NOT_SERVING until upstreams are ready)",
             extra={"grpc_port": config.port, "http_port": config.http_port,
                    "target": config.target, "draft": config.draft or "-"})
    state.start_watching()
    stop = asyncio.Event()
    install_stop_signals(stop)
    status = {"code": 0}
    watchdog = asyncio.create_task(_startup_deadline(state, stop, status))
    await stop.wait()
    watchdog.cancel()
    await _shutdown(service, grpc_server, http)
    return status["code"]


async def _start_grpc(config: GatewayConfig, state: GatewayState,
                      service: GatewayService) -> grpc.aio.Server:
    servicer = grpc_api.GatewayServicer(service)
    keys = ApiKeys(config.api_keys)
    server = build_server(config.port, config.host, config.max_message_bytes, state.readiness,
                          lambda s: grpc_api.add_to_server(servicer, s),
                          tls=config.server_tls,
                          interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else [],
                          max_receive_bytes=config.max_request_bytes)
    await server.start()
    return server


async def _start_http(config: GatewayConfig, service: GatewayService) -> HttpServer | None:
    http = HttpServer(uvicorn.Config(build_app(service), host=config.host,
                                     port=config.http_port, log_level="warning", access_log=False,
                                     lifespan="off", timeout_graceful_shutdown=GRACE_S,
                                     **_https(config.server_tls)))
    http.task = asyncio.create_task(http.serve(), name="http")
    while not http.started and not http.task.done():
        await asyncio.sleep(0.05)
    if http.task.done():
        log.error("the HTTP API could not start on %s:%d", config.host, config.http_port)
        return None
    return http


def _https(server_tls: tls.ServerTls) -> dict:
    """uvicorn's TLS settings: the gateway's certificate serves HTTPS too (and with a client CA,
    HTTPS clients need a certificate as well)."""
    if not server_tls.enabled:
        return {}
    extra = {"ssl_certfile": server_tls.cert, "ssl_keyfile": server_tls.key}
    if server_tls.mutual:
        extra.update(ssl_ca_certs=server_tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return extra


async def _shutdown(service: GatewayService, grpc_server: grpc.aio.Server | None,
                    http: HttpServer | None) -> None:
    """Drain: NOT_SERVING and new requests refused (503 / UNAVAILABLE) while the ones in flight
    finish, for up to --drain-grace; then the servers stop, cancelling what is left (its
    sequences are released) before the upstream channels close."""
    state = service.state
    drain = Drain(state.config.drain_grace_s, idle=lambda: service.idle)
    log.info("stopping: draining %d requests for up to %.0f s", service.admission.active,
             drain.grace_s)
    service.start_draining()
    if state.metrics_model:
        await state.readiness.set(False)
    drained = await wait_idle(drain)
    log.info("drained" if drained else "drain grace period over; cancelling what is left",
             extra={"requests_left": service.admission.active})
    stops = []
    if grpc_server is not None:
        await state.readiness.health.enter_graceful_shutdown()
        stops.append(grpc_server.stop(1.0 if drained else 0))
    if http is not None:
        http.should_exit = True
        stops.append(http.task)
    await asyncio.gather(*stops, return_exceptions=True)
    await background.drain(state.config.release_timeout_s)
    await state.close()


async def _startup_deadline(state: GatewayState, stop: asyncio.Event, status: dict) -> None:
    """After --startup-timeout: serve without a draft that never came; exit 1 if the target
    never became SERVING (a refused pair stays up, NOT_SERVING, saying why)."""
    timeout = state.config.startup_timeout_s
    if not timeout:
        return
    try:
        await asyncio.wait_for(state.ready_event.wait(), timeout)
        return
    except asyncio.TimeoutError:
        pass
    state.end_draft_grace()
    if not any(t.serving for t in state.targets):
        log.error("target not SERVING after %.0f s: %s; exiting", timeout, state.reason)
        status["code"] = 1
        stop.set()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    setup_logging(config.log_level, "gateway")
    sys.exit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
