"""Errors as OpenAI clients expect them: one status code and one body shape for every failure.

Decided here:

- :class:`OpenAIError`, the one exception the HTTP layer and its backends
  raise to end a request with a given status (404 unknown model, 503
  overloaded with ``Retry-After``, 400 context overflow, ...).
- The body of every error response, exactly
  ``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`), as
  the OpenAI API returns it and as the ``openai`` SDK parses it into
  ``APIError.message`` / ``.type`` / ``.param`` / ``.code``.
- The mapping of request-validation failures to 400 (OpenAI never answers
  422): malformed JSON, missing fields, wrong types and out-of-range values,
  with ``param`` the offending field's dotted path (``messages.0.content``).
- That unexpected exceptions become a 500 ``server_error`` whose message
  carries no traceback or exception text (those go to the server log).
- That error responses carry the ``x-request-id`` (and, once known,
  ``x-ferrox-replica``) headers: handlers read them from ``request.state``,
  where :mod:`ferrox.cluster.openai_app` puts them as soon as they exist.
- That an error body can always be sent: strings in it that UTF-8 cannot
  encode (a lone surrogate the client sent, echoed in a message) are shown
  backslash-escaped (``\\ud800``), never left to fail the response's
  encoding and turn it into a plain-text 500 (:func:`printable`). Log lines
  built from request data go through the same function.
- What a cancellation is (:func:`is_cancellation`): ``asyncio.CancelledError``
  and Ray's ``TaskCancelledError`` family (Serve's ``RequestCancelledError``,
  and a ``RayTaskError`` wrapping a cancellation), recognised by class name
  so that this module needs no Ray. A client that goes away is normal: the
  callers log it at INFO without a traceback and answer 499.

Deliberately not here: which condition deserves which status (the callers
decide) and any retry logic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
REPLICA_HEADER = "x-ferrox-replica"

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type_for(status_code: int) -> str:
    """The OpenAI error ``type`` conventionally paired with an HTTP status."""
    if status_code in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status_code]
    return "server_error" if status_code >= 500 else "invalid_request_error"


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) backslash-escaped.

    ``"a\\ud800b"`` (one lone surrogate) -> ``"a\\\\ud800b"`` (the six
    characters ``\\ud800``); any other string is returned unchanged.
    """
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: all four keys always present,
    every string UTF-8-encodable (:func:`printable`)."""
    return {
        "error": {
            "message": printable(message),
            "type": printable(type),
            "param": None if param is None else printable(param),
            "code": printable(code) if isinstance(code, str) else code,
        }
    }


_CANCELLATION_NAMES = frozenset({"TaskCancelledError", "RequestCancelledError"})


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` means the request was cancelled (in ferrox: its client went away).

    True for ``asyncio.CancelledError`` and for Ray's ``TaskCancelledError``
    and its subclasses (Serve's ``RequestCancelledError``, ``RayTaskError``
    wrappers of either), matched by class name so that no Ray import is needed.
    """
    if isinstance(exc, asyncio.CancelledError):
        return True
    return any(cls.__name__ in _CANCELLATION_NAMES for cls in type(exc).__mro__)


class OpenAIError(Exception):
    """End the request with ``status_code`` and an OpenAI-style error body.

    ``type`` defaults to the conventional type for the status
    (:func:`error_type_for`: 400 invalid_request_error, 404 not_found_error,
    503 overloaded_error, other 5xx server_error). ``headers`` are added to
    the response (e.g. ``{"Retry-After": "1"}`` with a 503).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = int(status_code)
        self.message = message
        self.type = type or error_type_for(self.status_code)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"OpenAIError({self.status_code}, {self.message!r}, type={self.type!r}, param={self.param!r})"


# ------------------------------------------------------------------ validation -> 400

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Tags pydantic puts in ``loc`` for the members of a union of plain types.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "dict", "list", "tuple", "set", "frozenset"})


def param_path(loc: Sequence[Any]) -> str | None:
    """The dotted path of a pydantic error location, for the OpenAI ``param``.

    FastAPI's leading ``"body"`` is dropped, and so are the tags pydantic
    inserts for union members and validator wrappers (``"list[int]"``,
    ``"function-after[...]"``), which are no field names.
    ``("body", "messages", 0, "content")`` -> ``"messages.0.content"``;
    ``()`` -> ``None``.
    """
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    kept = [
        str(p)
        for p in parts
        if (isinstance(p, int) and not isinstance(p, bool))
        or (isinstance(p, str) and _IDENTIFIER.match(p) and p not in _TYPE_TAGS)
    ]
    return ".".join(kept) or None


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(error: Mapping[str, Any]) -> tuple[str, str | None, str]:
    kind = str(error.get("type", ""))
    loc = tuple(error.get("loc", ()))
    msg = str(error.get("msg", "invalid value"))
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", msg)
        return f"We could not parse the JSON body of your request: {detail}", None, "invalid_json"
    param = param_path(loc)
    if param is None:
        if kind == "missing":
            return "The request body is missing; send a JSON object", None, "missing_body"
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return "The request body must be a JSON object", None, "invalid_type"
        return msg, None, "invalid_value"
    if kind == "missing":
        return f"Missing required parameter: '{param}'", param, "missing_required_parameter"
    if kind == "unsupported_parameter":
        return msg, param, "unsupported_parameter"
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    if f"'{param.rsplit('.', 1)[-1]}'" in msg:  # our own messages already name the field
        return msg, param, code
    got = ""
    if "input" in error and not isinstance(error["input"], (dict, list)):
        got = f" (got {_short(error['input'])})"
    return f"Invalid value for '{param}': {msg}{got}", param, code


def validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """A 400 :class:`OpenAIError` describing pydantic / FastAPI validation errors.

    ``errors`` are ``ValidationError.errors()`` or ``RequestValidationError.errors()``
    dicts. ``param`` and ``code`` come from the first error; the message
    names the other offending fields too.
    """
    if not errors:
        return OpenAIError(400, "Invalid request", code="invalid_value")
    message, param, code = _describe(errors[0])
    others = []
    for error in errors[1:]:
        other = param_path(tuple(error.get("loc", ())))
        if other and other != param and other not in others:
            others.append(other)
    if others:
        message += "; also invalid: " + ", ".join(f"'{o}'" for o in others)
    return OpenAIError(400, message, param=param, code=code)


# ------------------------------------------------------------------------- handlers


def response_headers(request: Request) -> dict[str, str]:
    """``x-request-id`` / ``x-ferrox-replica`` for a response to ``request``.

    The request id is the one the app assigned (``request.state.request_id``)
    or, before it assigned one, the client's own ``x-request-id`` header.
    """
    headers: dict[str, str] = {}
    request_id = getattr(request.state, "request_id", None) or request.headers.get(REQUEST_ID_HEADER)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    replica = getattr(request.state, "replica", None)
    if replica:
        headers[REPLICA_HEADER] = replica
    return headers


def error_response(request: Request, error: OpenAIError) -> JSONResponse:
    headers = response_headers(request)
    headers.update(error.headers)
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


async def _on_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(request, exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(request, validation_error(exc.errors()))


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    code: str | None = None
    if status == 404 and detail == "Not Found":
        detail, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
    elif status == 405 and detail == "Method Not Allowed":
        detail, code = f"Method {request.method} is not allowed for {request.url.path}", "method_not_allowed"
    error = OpenAIError(status, detail, code=code, headers=dict(exc.headers or {}))
    return error_response(request, error)


def cancelled_error() -> OpenAIError:
    """The answer to a cancelled request: 499 (nginx's "client closed request");
    rarely read, as its client has usually gone."""
    return OpenAIError(499, "The request was cancelled before it completed", code="request_cancelled")


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    headers = response_headers(request)
    where = (printable(request.method), printable(request.url.path), headers.get(REQUEST_ID_HEADER))
    if is_cancellation(exc):
        logger.info("%s %s (request id %s) was cancelled: %s", *where, type(exc).__name__)
        return error_response(request, cancelled_error())
    logger.exception("unhandled error in %s %s (request id %s)", *where, exc_info=exc)
    message = "The server had an error while processing your request"
    if REQUEST_ID_HEADER in headers:
        message += f" (request id {headers[REQUEST_ID_HEADER]})"
    error = OpenAIError(500, message, type="server_error", code="internal_error")
    return error_response(request, error)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` returns an OpenAI-style body.

    - :class:`OpenAIError` -> its status, body and headers;
    - request validation (malformed JSON, missing / wrong-typed / out-of-range
      fields) -> 400 with ``param`` the field's dotted path, never 422;
    - Starlette/FastAPI ``HTTPException`` (unknown route 404, 405, ...) -> that
      status with an OpenAI body;
    - anything else -> 500 ``server_error``, logged, with no exception text.
      (Starlette re-raises such an exception after sending the 500 so the
      server logs it; in-process test transports must not re-raise it.)
    """
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)
