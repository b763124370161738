"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns, whether raised by our code or by Litestar (validation, 404 for an
unknown route, 405, 413 for an oversized body), is rendered as
`{"error": {"message", "type", "param", "code"}}` so OpenAI SDKs raise their usual exceptions.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

logger = logging.getLogger("wllm.server")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body; raise it anywhere in a handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def service_unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="service_unavailable",
                    headers={"Retry-After": str(retry_after)})


def upload_timeout(timeout_s: float) -> APIError:
    """408 for a body that did not arrive within --timeout-body (sent by the connection watchdog too)."""
    return APIError(408, f"The request body did not arrive within {timeout_s:g} s of its headers "
                         "(--timeout-body); the connection is closed.", code="request_timeout")


def client_closed() -> APIError:
    # Nobody reads this; 499 ("client closed request", as nginx logs it) marks it in logs and metrics.
    return APIError(499, "client closed the request", code="client_closed_request")


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

_CODE_BY_STATUS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_response(err: APIError) -> Response[Any]:
    """The Litestar response for an APIError."""
    return Response(
        content=msgspec.json.encode(err.body()),
        status_code=err.status_code,
        media_type="application/json",
        headers=err.headers,
    )


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    """Turn Litestar's validation details into one readable message plus the offending field."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    for item in extra:
        if isinstance(item, dict) and item.get("message"):
            message = str(item["message"])
            # msgspec paths look like "Expected `int`, got `str` - at `$.max_tokens`"; keep the field.
            param = None
            if "at `$." in message:
                param = message.rsplit("at `$.", 1)[1].rstrip("`")
            elif item.get("key") and item.get("key") != "data":
                param = str(item["key"])
            return f"Invalid request: {message}", param
    detail = exc.detail or "Invalid request body"
    if "decoding" in detail.lower() or "json" in detail.lower():
        return f"Invalid request: the body is not valid JSON ({detail})", None
    return f"Invalid request: {detail}", None


def handle_api_error(_: Request[Any, Any, Any], exc: APIError) -> Response[Any]:
    return error_response(exc)


def handle_http_exception(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    if isinstance(exc, ValidationException) or status == 400:
        if isinstance(exc, ValidationException):
            message, param = _validation_message(exc)
        else:  # Litestar raises a bare 400 ClientException when the body cannot be decoded
            message, param = f"Invalid request: the body is not valid JSON ({exc.detail})", None
        return error_response(APIError(400, message, param=param))
    if status >= 500:
        logger.error("internal error: %s", exc.detail)
        return error_response(APIError(status, "Internal server error", type="internal_error"))
    message = exc.detail or "Request failed"
    if status == 413:
        message = "Request body too large"
    elif status == 404:
        message = f"Not found: {exc.detail}" if exc.detail and exc.detail != "Not Found" else "Not found"
    err = APIError(status, message, type=_TYPE_BY_STATUS.get(status, "invalid_request_error"),
                   code=_CODE_BY_STATUS.get(status))
    err.headers.update({k: v for k, v in (exc.headers or {}).items()})
    return error_response(err)


def handle_unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    # A bug on our side: log the traceback, tell the client only that it was ours.
    logger.exception("unhandled exception while serving a request", exc_info=exc)
    return error_response(APIError(500, "Internal server error", type="internal_error"))


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
