"""The chat stream's first chunk (the role) leaves with the first token, not before the
prompt is computed: clients time the first chunk as the time to first token. A request the
engine refuses before its first token is a 4xx on every streaming route, as without stream;
a failure after it ends the stream with an error event."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from paged.engine.async_engine import EngineDeadError, SeqUpdate
from paged.engine.core import UNSATISFIABLE, EngineOutput
from paged.engine.outputs import OutputState
from paged.sampling.params import SamplingParams
from paged.server.anthropic_protocol import MessagesRequest
from paged.server.errors import APIError
from paged.server.protocol import ChatCompletionRequest, CompletionRequest
from paged.server.responses_protocol import ResponsesRequest
from paged.server.serving import Prompt, Serving, SSEResponse
from paged.server.serving_anthropic import create_message
from paged.server.serving_chat import _stream, create_chat_completion
from paged.server.serving_completion import create_completion
from paged.server.serving_responses import ResponseStore

CHAT = [{"role": "user", "content": "hi"}]
POOLING = (  # the engine core's refusal of a generation request on a pooling model
    "model: this model runs for pooling (--runner pooling, no LM head): it serves "
    "embeddings (/v1/embeddings, LLM.embed), not generation"
)


def test_role_chunk_waits_for_the_first_token():
    params = SamplingParams(max_tokens=2)
    first_token = asyncio.Event()

    async def generate(rid, prompts):
        await first_token.wait()  # the prefill
        st = OutputState(0, None, [1, 2], params)
        eo = EngineOutput(rid, [7], False)
        st.update(eo)
        yield 0, SeqUpdate(0, st, eo)

    sv = SimpleNamespace(model_name="m", tokenizer=None, generate=generate)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)

    async def run() -> list[str]:
        gen = _stream(sv, req, "chatcmpl-1", Prompt("hi", [1, 2], params))
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert not nxt.done(), "a chunk was sent before the first token"
        first_token.set()
        out = [await nxt]
        async for c in gen:
            out.append(c)
        return out

    chunks = asyncio.run(run())
    assert '"role":"assistant"' in chunks[0]
    assert chunks[-1] == "data: [DONE]\n\n"


def test_sse_body_starts_before_the_head_and_is_closed():
    """SSEResponse runs its body to its first wait (the request sent to the engine) before the
    response head goes out, sends every chunk in order, and closes the body at the end."""
    events: list[str] = []

    async def body():
        try:
            events.append("body started")
            await asyncio.sleep(0.01)  # the engine's first token
            for i in range(3):
                yield f"data: {i}\n\n"
        finally:
            events.append("body closed")

    async def send(msg: dict) -> None:
        events.append(msg["type"] + (f" {msg['body'].decode()!r}" if msg.get("body") else ""))

    async def receive() -> dict:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(SSEResponse(body())(scope, receive, send))
    assert events == ["body started", "http.response.start",
                      *(f"http.response.body 'data: {i}\\n\\n'" for i in range(3)),
                      "body closed", "http.response.body"]  # fmt: skip


class FakeEngine:
    """An AsyncEngine that refuses every request (`refusal`) before its first token, or
    sends one token and then dies (`refusal` None)."""

    info = {"max_model_len": 256, "vocab_size": 49152, "eos_token_ids": []}
    dead = None
    ready = True

    def __init__(self, tokenizer, refusal: str | None) -> None:
        self.tokenizer, self.refusal = tokenizer, refusal

    async def generate(self, rid, ids, params, lora=None, user=None):
        await asyncio.sleep(0)  # the engine's answer comes later
        if self.refusal is not None:
            raise ValueError(self.refusal)
        st = OutputState(0, self.tokenizer, ids, params)
        eo = EngineOutput(rid, [28], False)
        st.update(eo)
        yield SeqUpdate(0, st, eo)
        raise EngineDeadError("the engine core process exited (code -9)")


@pytest.fixture(scope="module")
def tokenizer():
    from paged.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


SCHEMA = {"type": "object"}
ROUTES = {  # route -> (create(sv, stream), the field of its structured output as sent)
    "chat": (lambda sv, s: create_chat_completion(sv, ChatCompletionRequest(
        messages=CHAT, stream=s, guided_choice=["yes"])), "guided_choice"),
    "completions": (lambda sv, s: create_completion(sv, CompletionRequest(
        prompt="hi", stream=s, structured_outputs={"grammar": "root ::= root"})),
        "structured_outputs.grammar"),
    "responses": (lambda sv, s: ResponseStore(sv, 2).create(ResponsesRequest(
        input="hi", stream=s, text={"format": {"type": "json_schema", "name": "x",
                                               "schema": SCHEMA}})), "text.format.schema"),
    "messages": (lambda sv, s: create_message(sv, MessagesRequest(
        messages=CHAT, max_tokens=4, stream=s,
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}})),
        "output_config.format.schema"),
}  # fmt: skip


@pytest.mark.parametrize("refusal", [POOLING, UNSATISFIABLE], ids=["pooling", "no-token"])
@pytest.mark.parametrize("route", ROUTES)
def test_engine_refusal_before_the_stream_is_the_same_4xx(tokenizer, route, refusal):
    """Refused before its first token (a pooling model, constraints no token can meet), a
    stream is the 400 the request gets without stream, naming the field as the client sent
    it, before any response head: not a 200 with an error event."""
    create, field = ROUTES[route]
    sv = Serving(FakeEngine(tokenizer, refusal), "m", None)

    async def error(stream: bool) -> APIError:
        with pytest.raises(APIError) as e:
            await create(sv, stream)
        return e.value

    for stream in (False, True):
        e = asyncio.run(error(stream))
        param = "model" if refusal == POOLING else field
        assert (e.status, e.type, e.param) == (400, "invalid_request_error", param), e.message
        assert e.message == param + refusal[refusal.index(":") :]


@pytest.mark.parametrize("route", ROUTES)
def test_failure_after_the_first_token_ends_the_stream(tokenizer, route):
    """The engine dies after the first token: the stream (200) carries it, then an error."""
    sv = Serving(FakeEngine(tokenizer, None), "m", None)

    async def body() -> str:
        resp = await ROUTES[route][0](sv, True)
        assert isinstance(resp, SSEResponse)
        return "".join([c async for c in resp.body_iterator])

    text = asyncio.run(body())
    died = text.index("the engine is not running")  # the error event, last
    assert '":","' in text[:died], text  # after the first token (",")
    assert "data: {" not in text[died:], text
