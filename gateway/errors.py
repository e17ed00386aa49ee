"""One place that turns any failure of a request into what a client sees: a gRPC status code
(never UNKNOWN) or an HTTP status with OpenAI's error body."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from gateway.admission import Overloaded
from gateway.request import RequestError
from gateway.upstream import UpstreamError
from services.common.errors import NotFound, ServiceError

log = logging.getLogger("dflash.gateway.errors")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error",
              404: "invalid_request_error", 429: "rate_limit_error", 499: "request_cancelled",
              503: "service_unavailable", 504: "timeout", 500: "internal_error"}
# An upstream's status as the gateway's client should see it (an upstream's pools full after
# --pool-wait is the service's trouble, not the client's rate: 503).
UPSTREAM_CODE = {grpc.StatusCode.NOT_FOUND: grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.UNKNOWN: grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.CANCELLED: grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.UNAVAILABLE}


class ModelNotFound(NotFound):
    error_code = "model_not_found"


@dataclass(frozen=True)
class ClientError:
    code: grpc.StatusCode
    message: str
    param: str | None = None
    error_code: str | None = None      # OpenAI's error.code
    retry_after: str | None = None     # seconds, for Retry-After (HTTP) / retry-after (gRPC)

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    def openai_body(self) -> dict:
        status = self.http_status
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(status, "error"),
                          "param": self.param, "code": self.error_code or self.code.name.lower()}}


def classify(e: BaseException) -> ClientError:
    if isinstance(e, RequestError):
        return ClientError(e.code, str(e), e.param)
    if isinstance(e, Overloaded):
        return ClientError(e.code, str(e), error_code="overloaded", retry_after=e.retry_after)
    if isinstance(e, ServiceError):
        return ClientError(e.code, str(e), error_code=getattr(e, "error_code", None))
    if isinstance(e, UpstreamError):
        code = UPSTREAM_CODE.get(e.code, e.code)
        return ClientError(code, f"the {e.upstream} service failed ({e.method}: {e.code.name}): "
                                 f"{e.details}")
    log.error("internal error", exc_info=e)
    return ClientError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
