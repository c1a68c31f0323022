"""The error responses the OpenAPI schema (/openapi.json, /docs) declares per kind of route:
the statuses the server really sends, in OpenAI's error shape (Anthropic's under /v1/messages).
FastAPI's own 422 is never sent: invalid bodies get 400, a body that is not JSON 415."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error of the API: OpenAI's shape (paged/server/errors.py)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The errors under /v1/messages: Anthropic's shape."""

    type: str = "error"
    error: AnthropicErrorDetail


# The error statuses the OpenAPI schema declares (FastAPI's own 422 is never sent: invalid
# bodies get 400, a body that is not JSON 415): one dict per kind of route.
_WHY = {
    400: "Invalid request: the message names the field (param)",
    401: "Missing or wrong API key (with --api-key)",
    404: "Unknown model, adapter or stored response",
    408: "The request body was not received in time",
    413: "The request body is too large",
    415: "The body is not JSON (send Content-Type: application/json)",
    503: "The engine is starting, has died, or the server is shutting down",
    "default": "Any other error (500: an internal error)",
}


def errors(*statuses: int | str, model: type[BaseModel] = ErrorResponse) -> dict:
    return {s: {"model": model, "description": _WHY[s]} for s in (*statuses, "default")}


GET_ERRORS = errors(401, 503)
FOUND_ERRORS = errors(401, 404, 503)  # a GET naming something that may not exist
POST_ERRORS = errors(400, 401, 404, 408, 413, 415, 503)
ANTHROPIC_ERRORS = errors(400, 401, 404, 408, 413, 415, 503, model=AnthropicErrorResponse)
METRICS = {200: {"description": "Prometheus metrics", "content": {"text/plain": {}}}}
