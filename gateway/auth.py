"""API keys on the gateway: `Authorization: Bearer <key>` over HTTP, metadata
`authorization: Bearer <key>` over gRPC; a missing or unknown key is 401 / UNAUTHENTICATED.

Keys come from --api-keys (comma-separated; env DFLASH_API_KEYS) and --api-key-file (one per
line, # comments). Only their SHA-256 digests are kept, compared in constant time. No keys
configured: the API is open. Always open: /health, /readiness, gRPC health and reflection;
/metrics unless --metrics-auth."""
from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from pathlib import Path

import grpc

PROTECTED_GRPC = "/dflash.v1.Gateway/"
OPEN_HTTP = ("/health", "/readiness")
_SCHEME = "bearer "


def load_keys(inline: str, path: str) -> tuple[str, ...]:
    """--api-keys 'k1,k2' and --api-key-file PATH -> keys (ValueError when unusable)."""
    keys = [k.strip() for k in inline.split(",") if k.strip()]
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {path!r} cannot be read: {e.strerror}") from None
        keys += [s for line in lines if (s := line.strip()) and not s.startswith("#")]
    short = [k for k in keys if len(k) < 16]
    if short:
        raise ValueError(f"{len(short)} API key(s) are shorter than 16 characters; use long "
                         f"random keys (e.g. `openssl rand -hex 32`)")
    return tuple(keys)


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]
        self.rejected = 0

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """None when allowed; else what is wrong, for the 401 / UNAUTHENTICATED message."""
        if not self.enabled:
            return None
        problem = self._problem(authorization)
        if problem is not None:
            self.rejected += 1
        return problem

    def _problem(self, authorization: str | None) -> str | None:
        if not authorization:
            return ("an API key is required: send the header `Authorization: Bearer <key>` "
                    "(gRPC: metadata `authorization: Bearer <key>`)")
        if authorization[:len(_SCHEME)].lower() != _SCHEME:
            return "the authorization must use the Bearer scheme: `Authorization: Bearer <key>`"
        digest = _digest(authorization[len(_SCHEME):].strip())
        ok = False
        for known in self._digests:            # every key compared: no early exit
            ok |= hmac.compare_digest(digest, known)
        return None if ok else "the API key is not valid"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# -- gRPC ------------------------------------------------------------------------------------------
class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """dflash.v1.Gateway methods need a key; health and reflection do not."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not (details.method or "").startswith(PROTECTED_GRPC):
            return handler
        metadata = dict(details.invocation_metadata or ())
        problem = self.keys.check(metadata.get("authorization"))
        if problem is None:
            return handler
        return _denied(handler, problem)


def _denied(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler,
             "unary_stream": grpc.unary_stream_rpc_method_handler}
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    return kinds[kind](deny, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


# -- HTTP (ASGI middleware) ------------------------------------------------------------------------
class ApiKeyMiddleware:
    """401 with OpenAI's error body and `WWW-Authenticate: Bearer` before the app sees the
    request; open_paths pass without a key."""

    def __init__(self, app, keys: ApiKeys, open_paths: tuple[str, ...]) -> None:
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        value = headers.get(b"authorization")
        problem = self.keys.check(value.decode("latin-1") if value is not None else None)
        if problem is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": problem, "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
