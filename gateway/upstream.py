"""One upstream service (target or draft): a long-lived grpc.aio channel, a grpc.health.v1 Watch
that follows its readiness, and its capabilities - fetched only after it reports SERVING.

Liveness: a Watch says nothing when the process stops answering (frozen, SIGSTOP, a wedged loop:
the connection stays up). So a SERVING upstream is also asked a health Check every
--liveness-interval; two in a row unanswered for --liveness-timeout each (one could be a hiccup
of a loaded host) mark it down, and its calls in flight
fail UNAVAILABLE at once - as when it dies - instead of each waiting out its deadline: the
requests wait for it within --upstream-wait and rebuild their sequences when it answers again."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.v1 import common_pb2
from gateway import call_socket
from gateway.call_stream import CallFailed, CallStream, StreamUnsupported
from gateway.config import GatewayConfig
from services.common import callers, internal_auth, metrics

log = logging.getLogger("dflash.gateway.upstream")

SERVING = health_pb2.HealthCheckResponse.SERVING
WATCH_REOPEN_S = 300.0        # a Watch carries a deadline too; it is reopened when it passes
# --wire stream: a request larger than this goes unary, so that one big message (a Propose with a
# whole prompt's features) does not hold up the small per-step calls queued behind it on the stream
STREAM_MAX_BYTES = 1 << 20
LIVENESS_MISSES = 2           # health Checks in a row past --liveness-timeout: down


class UpstreamError(Exception):
    """A failed call to an upstream, with the gRPC status it ended with."""

    def __init__(self, upstream: str, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{upstream} {method} failed: {code.name}: {details}")
        self.upstream, self.method, self.code, self.details = upstream, method, code, details


def channel_options(config: GatewayConfig) -> list[tuple[str, Any]]:
    backoff_ms = int(config.backoff_initial_s * 1000)
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # pings every keepalive_s (>= 10 s: the services' min_recv_ping_interval), also when idle
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # reconnect quickly after an upstream restart (grpc's default backoff grows to 120 s)
        ("grpc.initial_reconnect_backoff_ms", max(100, backoff_ms)),
        ("grpc.min_reconnect_backoff_ms", max(100, backoff_ms)),
        ("grpc.max_reconnect_backoff_ms", int(config.backoff_max_s * 1000)),
    ]


def _channel(address: str, config: GatewayConfig) -> grpc.aio.Channel:
    """TLS (services/common/tls.py) when --upstream-ca is given, else plaintext."""
    tls = config.upstream_tls
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=channel_options(config))
    return grpc.aio.secure_channel(address, tls.credentials(),
                                   options=channel_options(config) + tls.channel_options())


class Upstream:
    """`serving` and `capabilities` change only on the event loop; `on_change()` is called after
    every change. `capabilities` is fetched on each transition to SERVING (a restarted service
    may be a different one) and is None until then. `streamed`: per-step methods and their
    (<M>StreamRequest, <M>StreamResponse) types; with --wire stream their calls share one
    <M>Stream (CallStream); with --wire socket that stream goes over the service's call socket
    when it advertises one that opens (gateway/call_socket.py), else over gRPC."""

    def __init__(self, role: str, address: str, service_name: str, stub_factory: Callable,
                 config: GatewayConfig, on_change: Callable[[], None],
                 streamed: Mapping[str, tuple[type, type]] | None = None) -> None:
        self.role, self.address, self.service_name = role, address, service_name
        self.config = config
        self.on_change = on_change
        self.channel = _channel(address, config)
        self.stub = stub_factory(self.channel)
        # on every dflash.v1 call: the internal token and the gateway's caller key
        self.metadata = (internal_auth.metadata(config.internal_token)
                         + callers.metadata(config.caller_key))
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.streams = {method: CallStream(f"{role} {method}Stream",
                                           self._opener(method, response_type), request_type)
                        for method, (request_type, response_type) in (streamed or {}).items()
                        if config.wire in ("stream", "socket")}
        self.socket_failed = ""                 # why its call socket is not used (--wire socket)
        self.serving = False
        self.capabilities: Any = None
        self.status = "not contacted yet"      # for readiness reasons and logs
        self.generation = 0                     # +1 whenever fetched capabilities differ
        self.serving_epoch = 0                  # +1 on every transition to SERVING
        self.model_name = ""                    # metrics label, set once known
        self._watch_call: Any = None
        self._task: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None
        self._unary: set[Any] = set()           # unary calls in flight (cut when it freezes)
        self._cut = ""                          # why the calls in flight were cut
        # replicas (gateway/replicas.py, gateway/state.py): whether requests may use it now
        # (SERVING and agreeing with its role's others), the requests placed on it, the load it
        # reported last (common_pb2.EngineLoad), and whether it left the replica list
        self.usable = False
        self.placed = 0
        self.load: common_pb2.EngineLoad | None = None
        self._load_at = 0.0
        self.placed_at_load = 0                 # `placed` when the load was reported
        self.retired = False

    def _opener(self, method: str, response_type: type) -> Callable[[], Any]:
        """Opens the method's call stream (with the internal token): on the service's call
        socket with --wire socket while it works, else a gRPC <M>Stream."""
        open_stream = getattr(self.stub, f"{method}Stream")

        def open_call() -> Any:
            if self.config.wire == "socket" and not self.socket_failed \
                    and self.capabilities is not None and self.capabilities.call_socket:
                return call_socket.SocketCall(self._socket(self.capabilities, method),
                                              response_type, self.config.max_message_mib << 20,
                                              self._socket_failed)
            return open_stream(metadata=self.metadata)
        return open_call

    def _socket(self, caps: Any, method: str) -> call_socket.SocketTarget:
        return call_socket.SocketTarget(caps.call_socket, caps.call_socket_id, method,
                                        self.metadata)

    def _socket_failed(self, why: str) -> None:
        if not self.socket_failed:
            log.warning("%s at %s: its call socket is not usable from here (%s); its per-step "
                        "calls go over gRPC", self.role, self.address, why)
        self.socket_failed = why

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._watch_forever(), name=f"watch-{self.role}")
        if self.config.liveness_timeout_s > 0:
            self._probe = asyncio.create_task(self._probe_forever(), name=f"probe-{self.role}")

    async def close(self) -> None:
        for task in (self._task, self._probe):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for stream in self.streams.values():
            await stream.close()
        await self.channel.close(grace=None)

    def note_load(self, response: Any) -> None:
        """A Prefill's or Verify's report of the replica's load."""
        if response.HasField("load"):
            self.load, self._load_at = response.load, time.monotonic()
            self.placed_at_load = self.placed

    @property
    def load_age_s(self) -> float:
        return time.monotonic() - self._load_at

    def retire(self) -> None:
        """Left the replica list: no longer watched, never serving again (its channel stays
        open for the calls in flight until the set closes it)."""
        self.retired, self.usable = True, False
        for task in (self._task, self._probe):
            if task is not None:
                task.cancel()
        self._set(False, "removed from the replica list")

    def mark_failed(self, why: str) -> None:
        """A call failed with UNAVAILABLE: treat the upstream as down until its health stream
        says SERVING again (the stream is reopened so the current status is re-read)."""
        if self.serving:
            log.warning("%s marked down: %s", self.role, why)
        self._set(False, f"down: {why}")
        if self._watch_call is not None:
            self._watch_call.cancel()

    # -- calls -----------------------------------------------------------------------------
    async def call(self, method: str, request: Any, timeout: float) -> Any:
        """A call with a deadline, on the method's call stream if it has one (--wire stream),
        else unary; failures of either become the same UpstreamError (and count as metrics)."""
        try:
            if method in self.streams and request.ByteSize() <= STREAM_MAX_BYTES:
                return await self._streamed(method, request, timeout)
            return await self._unary_call(method, request, timeout)
        except grpc.aio.AioRpcError as e:
            raise self._failed(method, e.code(), e.details() or "") from None
        except CallFailed as e:
            raise self._failed(method, e.code, e.details) from None

    async def _unary_call(self, method: str, request: Any, timeout: float) -> Any:
        """A unary call that the liveness probe can cut (then UNAVAILABLE, not a cancellation
        of the caller)."""
        call = getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        self._unary.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and self._cut and not (task and task.cancelling()):
                raise CallFailed(grpc.StatusCode.UNAVAILABLE, self._cut) from None
            raise
        finally:
            self._unary.discard(call)

    async def settled(self, sequence_id: str) -> None:
        """Returns once this sequence's cancelled calls on the call streams are answered (bounded):
        the Release of a sequence is sent after this."""
        for stream in list(self.streams.values()):
            await stream.settled(sequence_id)

    async def release(self, sequence_id: str, timeout: float) -> None:
        """Best effort: a service that is down has lost the sequence, or its lease frees it. Sent
        after the sequence's cancelled calls were answered, so that none of them runs after it."""
        await self.settled(sequence_id)
        try:
            await self.stub.Release(common_pb2.ReleaseRequest(sequence_id=sequence_id),
                                    timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            self.count_error(e.code())
            log.debug("release on %s failed: %s", self.role, e.code().name)

    async def _streamed(self, method: str, request: Any, timeout: float) -> Any:
        try:
            return await self.streams[method].call(request, timeout)
        except StreamUnsupported as e:     # an older service: unary from now on (never ran)
            stream = self.streams.pop(method, None)
            if stream is not None:
                log.warning("%s: %s; sending %s calls unary", self.role, e.details, method)
                await stream.close()
            return await self._unary_call(method, request, timeout)

    def _failed(self, method: str, code: grpc.StatusCode, details: str) -> UpstreamError:
        self.count_error(code)
        if code == grpc.StatusCode.UNAVAILABLE:
            self.mark_failed(f"{method}: {details}")
        return UpstreamError(self.role, method, code, details)

    def count_error(self, code: grpc.StatusCode) -> None:
        if self.model_name:
            metrics.UPSTREAM_ERRORS.labels(self.model_name, self.role, code.name).inc()

    # -- liveness --------------------------------------------------------------------------
    async def _probe_forever(self) -> None:
        req = health_pb2.HealthCheckRequest(service=self.service_name)
        timeout = self.config.liveness_timeout_s
        missed = 0
        while True:
            if not missed:
                await asyncio.sleep(self.config.liveness_interval_s)
            if not self.serving:
                missed = 0
                continue                        # the Watch follows it until it is back
            try:
                await self._health.Check(req, timeout=timeout)
                missed = 0
            except grpc.aio.AioRpcError as e:
                missed = missed + 1 if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else 0
            if missed >= LIVENESS_MISSES and self.serving:
                missed = 0
                await self._frozen(f"it left {LIVENESS_MISSES} health Checks in a row "
                                   f"unanswered for {timeout:g} s each (--liveness-timeout)")

    async def _frozen(self, why: str) -> None:
        """Down now: not ready, and every call in flight fails UNAVAILABLE."""
        self._cut = f"{self.role} at {self.address} is not answering: {why}"
        self.mark_failed(why)
        for stream in self.streams.values():
            await stream.close(self._cut)
        for call in list(self._unary):
            call.cancel()

    # -- health watch ----------------------------------------------------------------------
    async def _watch_forever(self) -> None:
        backoff = self.config.backoff_initial_s
        while True:
            try:
                if await self._watch_once():
                    backoff = self.config.backoff_initial_s
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._set(False, _describe(e))
            except asyncio.CancelledError:
                if self._task is not None and self._task.cancelling():
                    raise                       # close(); else mark_failed() cancelled the call
            except Exception as e:
                log.exception("%s health watch failed", self.role)
                self._set(False, f"health watch failed: {type(e).__name__}: {e}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    async def _watch_once(self) -> bool:
        """Follows one Watch stream; returns True when it delivered at least one status."""
        req = health_pb2.HealthCheckRequest(service=self.service_name)
        self._watch_call = self._health.Watch(req, timeout=WATCH_REOPEN_S)
        got = False
        try:
            async for msg in self._watch_call:
                got = True
                if msg.status == SERVING:
                    await self._on_serving()
                else:
                    name = health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)
                    self._set(False, f"health {self.service_name} is {name}")
        finally:
            self._watch_call = None
        return got

    async def _on_serving(self) -> None:
        """SERVING: only now ask for capabilities (never before, docs/architecture.md §7)."""
        if self.serving:
            return
        t0 = time.monotonic()
        caps = await self.stub.GetCapabilities(common_pb2.GetCapabilitiesRequest(),
                                               timeout=self.config.capabilities_timeout_s,
                                               metadata=self.metadata)
        if _service(caps) != _service(self.capabilities):
            self.generation += 1            # a restart with the same capabilities keeps it
        await self.probe_socket(caps)
        self.capabilities = caps
        self.serving_epoch += 1
        self._cut = ""
        log.info("%s at %s is SERVING; capabilities fetched", self.role, self.address,
                 extra={"seconds": round(time.monotonic() - t0, 3)})
        self._set(True, "SERVING")

    async def probe_socket(self, caps: Any) -> None:
        """--wire socket: the call socket the service advertises is used when it opens from
        here and takes our calls (another host's path, another user's socket: gRPC)."""
        self.socket_failed = ""
        if self.config.wire != "socket" or not self.streams:
            return
        if not caps.call_socket:
            self.socket_failed = "the service has no call socket (--call-socket)"
            return
        why = await call_socket.probe(self._socket(caps, next(iter(self.streams))),
                                      self.config.capabilities_timeout_s)
        if why:
            self._socket_failed(why)
        else:
            log.info("%s at %s: per-step calls on its call socket %s", self.role, self.address,
                     caps.call_socket)

    def _set(self, serving: bool, status: str) -> None:
        changed = serving != self.serving or status != self.status
        self.serving, self.status = serving, status
        if changed:
            if not serving:
                log.info("%s at %s not serving: %s", self.role, self.address, status)
            self.on_change()


def _service(caps: Any) -> Any:
    """Capabilities as what the service is: without call_socket_id, which every process of it
    draws anew (a restart of the same service keeps its generation)."""
    if caps is None or not caps.call_socket_id:
        return caps
    out = type(caps)()
    out.CopyFrom(caps)
    out.ClearField("call_socket_id")
    return out


def _describe(e: grpc.aio.AioRpcError) -> str:
    details = (e.details() or "").splitlines()[0][:200]
    return f"{e.code().name}: {details}"
