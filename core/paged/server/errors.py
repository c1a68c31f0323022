"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}.

A client's mistake is a 4xx naming the field; anything else is a 500 whose message
says what failed without paths or stack traces (those go to the server log).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("paged.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status)


_FIELD = re.compile(r"^([A-Za-z_][\w\[\].]*): ")


def bad_request(e: ValueError) -> APIError:
    """A ValueError whose message starts with 'field: ' as a 400 naming that field."""
    msg = str(e)
    m = _FIELD.match(msg)
    return APIError(400, msg, param=m.group(1) if m else None)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def _loc(loc: tuple, key: bool = False) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role', without pydantic's union tags.
    `key`: the last part is a key the client sent (an unknown field), kept whatever its name."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif key and i == len(loc) - 1 or (
            part != "body" and str(part).isidentifier() and part not in _TYPE_TAGS
        ):
            out += ("." if out else "") + str(part)
    return out or "body"


def _where(err: dict) -> str:
    return _loc(tuple(err.get("loc", ())), key=err.get("type") == "extra_forbidden")


def _within(where: str, top: str) -> bool:
    return top == "body" or where == top or where.startswith((top + ".", top + "["))


def validation_error(exc: RequestValidationError) -> APIError:
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request body")
    if errs[0].get("type") == "json_invalid":
        return APIError(400, "body: invalid JSON", param="body")
    # A union field fails once per alternative (errors at or below the first error's field):
    # lead with the alternative that got furthest (the deepest location: its discriminator
    # matched, say), then with a broken constraint (more telling than "not a string"), then
    # say each message of that field once.
    top = _where(errs[0])
    errs = [e for e in errs if _within(_where(e), top)]

    def rank(e: dict) -> tuple[int, bool]:
        return len(e.get("loc", ())), not str(e.get("type", "")).endswith(("_type", "_parsing"))

    first = max(errs, key=rank)  # the first of the best
    param = _where(first)
    msgs: list[str] = []
    for e in [first] if rank(first)[1] else errs:
        if _where(e) != param:
            continue
        msg = "field required" if e.get("type") == "missing" else str(e.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        if msg not in msgs:
            msgs.append(msg)
    if len(msgs) == 1 and (named := _FIELD.match(msgs[0])):  # a model validator's message
        if param == "body":  # that names its own field
            return bad_request(ValueError(msgs[0]))
        return APIError(400, f"{param}.{msgs[0]}", param=f"{param}.{named.group(1)}")
    return APIError(400, f"{param}: {'; or '.join(msgs[:4])}", param=param)


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or mime.endswith("+json")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and not _is_json(ctype):  # FastAPI did not parse it
            msg = f"body: send JSON with 'Content-Type: application/json', not {ctype[:60]!r}"
            return error_response(APIError(415, msg, "body"))
        return error_response(validation_error(e))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        msg = e.detail if isinstance(e.detail, str) else "request failed"
        if e.status_code == 400:  # FastAPI's body parse failures (e.g. nesting too deep)
            return error_response(APIError(400, f"body: {msg}", "body"))
        return error_response(APIError(e.status_code, msg))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(APIError(500, f"internal server error ({type(e).__name__})"))
