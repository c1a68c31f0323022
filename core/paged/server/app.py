"""The FastAPI app: routes, API key and body-size guard, readiness."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

import paged
from paged.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from paged.server.errors import APIError, error_body, install_handlers
from paged.server.limits import MAX_JSON_DEPTH, json_depth
from paged.server.metrics import CONTENT_TYPE, ServerMetrics
from paged.server.openapi_errors import (
    ANTHROPIC_ERRORS,
    FOUND_ERRORS,
    GET_ERRORS,
    METRICS,
    POST_ERRORS,
    errors,
)
from paged.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from paged.server.responses_protocol import ResponsesRequest
from paged.server.serving import Serving
from paged.server.serving_anthropic import AnthropicErrors, count_tokens, create_message
from paged.server.serving_chat import create_chat_completion
from paged.server.serving_completion import create_completion
from paged.server.serving_embedding import EmbeddingRequest, create_embedding
from paged.server.serving_responses import ResponseStore

OPEN_PATHS = {"/health", "/metrics", "/version", "/ping"}
STATIC_DIR = Path(__file__).with_name("static")  # the chat page (GET /) and its assets



def is_open(path: str) -> bool:
    """Paths served without the API key: the probes, the chat page and its static files."""
    return path in OPEN_PATHS or path == "/" or path.startswith("/static/")


@dataclass
class ServerState:
    serving: Serving
    metrics: ServerMetrics
    api_key: str | None = None
    max_body: int = 8 << 20
    draining: bool = False  # after SIGTERM: new requests get 503, in-flight ones finish
    inflight: int = 0  # requests inside the app (not counting the open paths)
    metrics_require_key: bool = False  # /metrics behind the API key too
    body_timeout: float = 30.0  # seconds to receive a whole request body (then 408)
    health_timeout: float = 5.0  # /health is 503 once the engine is silent this long
    # Bytes of request bodies being received at once, all connections together: stalled
    # uploads cannot pin more memory than this (beyond it, 503 until some finish).
    max_pending_body: int = 128 << 20
    pending_body: int = 0
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id (LRU)


def _refuse(status: int, message: str, param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(status, message, param, code), status)


class Guard:
    """ASGI middleware, before routing and parsing: draining (503), API key (401), body
    size (413, counted as it arrives whatever Content-Length says); a request cut at the end
    of a drain answers 503 too."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.api_key
        self.expect = f"Bearer {key}".encode() if key else None
        self.key = key.encode() if key else b""  # Anthropic's x-api-key header

    def _check(self, path: str, headers: dict[bytes, bytes]) -> JSONResponse | None:
        if is_open(path):
            if path == "/metrics" and self.state.metrics_require_key:
                return self._auth(headers)
            return None
        if self.state.draining:
            return _refuse(503, "the server is shutting down")
        refusal = self._auth(headers)
        if refusal is not None:
            return refusal
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        return self._too_big() if declared > self.state.max_body else None

    def _auth(self, headers: dict[bytes, bytes]) -> JSONResponse | None:
        """401 unless the key matches (constant time) or none is set."""
        if self.expect is None or secrets.compare_digest(
            headers.get(b"authorization", b""), self.expect
        ):
            return None
        if self.key and secrets.compare_digest(headers.get(b"x-api-key", b""), self.key):
            return None
        msg = "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key')"
        return _refuse(401, msg, code="invalid_api_key")

    def _too_big(self) -> JSONResponse:
        msg = f"body: the request body exceeds {self.state.max_body} bytes"
        return _refuse(413, msg, "body")

    async def _read_body(self, receive: Any) -> bytes | JSONResponse | None:
        """The whole body, a refusal, or None when the client went away."""
        st = self.state
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(st.body_timeout):
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return None
                    chunk = msg.get("body", b"")
                    if size + len(chunk) > st.max_body:
                        return self._too_big()
                    if st.pending_body + len(chunk) > st.max_pending_body:
                        return _refuse(503, "the server is receiving too many request bodies; "
                                       "retry shortly")  # fmt: skip
                    chunks.append(chunk)
                    size += len(chunk)
                    st.pending_body += len(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            msg = f"body: the request body was not received within {st.body_timeout:g} s"
            return _refuse(408, msg, "body")
        finally:
            st.pending_body -= size
        body = b"".join(chunks)
        if len(body) > 1 << 16:  # a scan of a large body: off the event loop
            depth = await asyncio.to_thread(json_depth, body)
        else:
            depth = json_depth(body)
        if depth > MAX_JSON_DEPTH:
            return _refuse(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels", "body")
        return body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(msg: dict[str, Any]) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self._serve(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.state.draining:
                raise
            # uvicorn cancels what still runs a second after the drain (--shutdown-timeout):
            # a JSON 503, not its plain 500 and a traceback; a started response (a stream) is
            # left for uvicorn to cut (docs/operating.md, Shutdown)
            asyncio.current_task().uncancel()  # handled: the task goes on to answer
            if not started:
                msg = "the server is shutting down: the request did not finish in time"
                await _refuse(503, msg)(scope, receive, send)

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # uvicorn adds it
        refusal = self._check(path, dict(scope.get("headers") or []))
        if refusal is not None:
            return await refusal(scope, receive, send)
        body = await self._read_body(receive)
        if body is None:
            return  # the client went away
        if isinstance(body, JSONResponse):
            return await body(scope, receive, send)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        counted = not is_open(path)
        self.state.inflight += counted
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.inflight -= counted


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()


def build_app(state: ServerState) -> Any:
    sv = state.serving
    app = FastAPI(title="paged", version=paged.__version__)
    install_handlers(app)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return FileResponse(STATIC_DIR / "chat.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/health", responses=errors(503))
    async def health() -> Response:
        silent = sv.engine.silent_for()
        if sv.engine.ready and not state.draining and silent <= state.health_timeout:
            return Response(status_code=200)
        why = sv.engine.dead or ("shutting down" if state.draining else "the engine is starting")
        if sv.engine.ready and not state.draining:
            why = f"the engine has not answered for {silent:.1f} s"
        return JSONResponse(error_body(503, why), 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": paged.__version__}

    metrics_errors = errors(401) if state.metrics_require_key else {}

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS | metrics_errors)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/fleet", responses=GET_ERRORS)
    async def fleet() -> dict[str, Any]:
        from paged.engine.replicas import fleet_view

        return fleet_view(sv.engine)

    @app.get("/v1/models", responses=GET_ERRORS)
    async def models() -> dict[str, Any]:
        sv.check_ready()
        cards = [{"id": name, "object": "model", "created": sv.created, "owned_by": "paged",
                  "root": sv.model_name, "parent": None, "max_model_len": sv.max_model_len}
                 for name in sv.model_names]  # fmt: skip
        return {"object": "list", "data": [*cards, *sv.loras.cards(sv.created)]}

    @app.get("/v1/models/{model:path}", responses=FOUND_ERRORS)
    async def model(model: str) -> dict[str, Any]:
        """One entry of /v1/models (OpenAI's models.retrieve); an id may hold a '/'."""
        for card in (await models())["data"]:
            if card["id"] == model:
                return card
        raise APIError(404, f"model: the model {model[:100]!r} does not exist", "model",
                       "model_not_found")  # fmt: skip

    @app.post("/v1/load_lora_adapter", responses=POST_ERRORS)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        sv.check_ready()
        sv.loras.check_new(req.lora_name, sv.model_names)
        await sv.off_loop(sv.loras.load, req.lora_name, req.lora_path, sv.model_names)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=POST_ERRORS)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        sv.check_ready()
        lora = sv.loras.unload(req.lora_name)
        sv.engine.unload_lora(lora.lora_int_id)  # the core frees its slot and host copy
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/v1/completions", responses=POST_ERRORS)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await until_disconnect(request, create_completion(sv, req))

    @app.post("/v1/chat/completions", responses=POST_ERRORS)
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await until_disconnect(request, create_chat_completion(sv, req))

    @app.post("/v1/embeddings", responses=POST_ERRORS)
    async def embeddings(req: EmbeddingRequest, request: Request) -> Any:
        return await until_disconnect(request, create_embedding(sv, req))

    @app.post("/v1/messages", responses=ANTHROPIC_ERRORS)
    async def messages(req: MessagesRequest, request: Request) -> Any:
        return await until_disconnect(request, create_message(sv, req))

    @app.post("/v1/messages/count_tokens", responses=ANTHROPIC_ERRORS)
    async def messages_count_tokens(req: CountTokensRequest) -> dict[str, Any]:
        return await count_tokens(sv, req)

    store = ResponseStore(sv, state.max_stored_responses)

    @app.post("/v1/responses", responses=POST_ERRORS)
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        return await until_disconnect(request, store.create(req))

    @app.get("/v1/responses/{response_id}", responses=errors(400, 401, 404, 503))
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        for name in request.query_params:  # OpenAI's stream / include / starting_after
            raise APIError(400, f"{name}: retrieving a stored response takes no query "
                           "parameters (it is returned whole, never streamed)", name)  # fmt: skip
        return store.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses=FOUND_ERRORS)
    async def delete_response(response_id: str) -> dict[str, Any]:
        return store.delete(response_id)

    @app.post("/tokenize", responses=POST_ERRORS)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        sv.check_model(req.model)
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await sv.tokenize(req.prompt, "prompt", special)
        else:
            # As chat renders its prompt (same template options, same tokenization).
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            gen = req.add_generation_prompt is not False
            _, ids = await sv.render_chat(req.messages or [], gen, tools, req.template_kwargs(),
                                          bool(req.add_special_tokens))  # fmt: skip
        tok = sv.tokenizer
        strs = await sv.off_loop(tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
        count, limit = len(ids), sv.max_model_len
        return {"count": count, "max_model_len": limit, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses=POST_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        sv.check_model(req.model)
        tok = sv.need_tokenizer("tokens")
        sv.check_ids(req.tokens, "tokens")
        return {"prompt": await sv.off_loop(tok.decode, req.tokens)}

    @app.get("/ping", responses=errors(503))
    async def ping() -> Response:
        return await health()

    # HEAD wherever GET answers (as Starlette's own routes do; FastAPI's answer 405): a twin
    # route, kept out of the OpenAPI schema (a GET+HEAD route would list each operation twice)
    for route in list(app.routes):
        if isinstance(route, APIRoute) and "GET" in route.methods:
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"],
                              include_in_schema=False)  # fmt: skip

    return AnthropicErrors(Guard(app, state))
