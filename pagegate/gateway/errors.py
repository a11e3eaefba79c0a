"""The OpenAI error body and the exceptions the gateway raises to produce it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class APIError(Exception):
    """An error the client should see as `{"error": {"message", "type", "param", "code"}}`."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


class BadRequest(APIError):
    status_code = 400


class Unauthorized(APIError):
    status_code = 401
    default_code = "invalid_api_key"


class Forbidden(APIError):
    """A valid key that may not do this (an ordinary key on a management route: pagegate.gateway.auth)."""

    status_code = 403
    error_type = "permission_error"
    default_code = "admin_key_required"


class NotFound(APIError):
    status_code = 404
    default_code = "not_found"


class MethodNotAllowed(APIError):
    status_code = 405
    default_code = "method_not_allowed"


class PayloadTooLarge(APIError):
    status_code = 413
    default_code = "request_too_large"


class UnsupportedMediaType(APIError):
    status_code = 415
    default_code = "unsupported_media_type"


class Overloaded(APIError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class ClientClosed(APIError):
    """The client left before its request was read (nginx's 499): nobody receives the answer."""

    status_code = 499
    default_code = "client_closed_request"


class ServerError(APIError):
    status_code = 500
    error_type = "server_error"
    default_code = "internal_error"


class ServiceUnavailable(APIError):
    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class EngineStalled(ServiceUnavailable):
    """An engine core with work has not finished a step within --engine-step-timeout (it hangs)."""

    default_code = "engine_stalled"


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The exact shape OpenAI returns (and its SDK parses) for every error."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


_STATUS_TYPES = {401: Unauthorized, 404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge, 415: UnsupportedMediaType}


def from_status(status_code: int, message: str) -> APIError:
    """An APIError for a plain HTTP status (Starlette's routing 404/405, ...)."""
    cls = _STATUS_TYPES.get(status_code, ServerError if status_code >= 500 else BadRequest)
    error = cls(message)
    error.status_code = status_code
    return error


def to_api_error(exc: BaseException) -> APIError:
    """Map anything raised while serving a request onto the error the client sees."""
    from pagegate.engine.errors import (
        EngineDeadError,
        EngineStalledError,
        InvalidParamError,
        RequestFailedError,
    )

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineStalledError):
        return EngineStalled(str(exc))
    if isinstance(exc, InvalidParamError):
        return BadRequest(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestFailedError):  # this request alone cannot run here (e.g. more pages than exist)
        return BadRequest(f"The request failed: {exc}", code="request_failed")
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(f"The engine is not running: {exc}", code="engine_dead")
    return ServerError(f"Internal error: {type(exc).__name__}: {exc}")


@contextmanager
def client_params(rename: Callable[[str], str]) -> Iterator[None]:
    """A 400 raised inside names the field the client sent: `rename` maps a chat completion's param (the
    request another API is translated into) to its own, in `param` and where the message quotes it."""
    from pagegate.engine.errors import InvalidParamError

    try:
        yield
    except (APIError, InvalidParamError) as exc:
        error = to_api_error(exc)
        if error.param is not None:
            theirs = rename(error.param)
            error.message = error.message.replace(f"'{error.param}'", f"'{theirs}'")
            error.args = (error.message,)
            error.param = theirs
        raise error from None


def without_tags(param: str, list_path: str, tags: frozenset[str]) -> str:
    """`list_path.N.<tag>.rest` -> `list_path.N.rest`: pydantic puts the `type` of an item of a discriminated
    union into an error's location; the client sent no field of that name."""
    parts = param.split(".")
    at = len(list_path.split("."))
    if param.startswith(list_path + ".") and len(parts) > at + 1 and parts[at].isdigit() and parts[at + 1] in tags:
        del parts[at + 1]
    return ".".join(parts)


def rename_prefix(param: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """`param` with the first matching dotted prefix of `pairs` (ours, theirs) replaced."""
    for ours, theirs in pairs:
        if param == ours or param.startswith(ours + "."):
            return theirs + param[len(ours):]
    return param


# -- Anthropic's shape, on /v1/messages ---------------------------------------------------------------
MESSAGES_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """The Messages API's routes answer errors as Anthropic's clients read them."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(error: APIError) -> dict:
    """{"type": "error", "error": {"type", "message"}}; Anthropic's shape has no param, so a message that does
    not name its field starts with it, as Anthropic's own do (`stop_sequences: ...`)."""
    status = error.status_code
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}
