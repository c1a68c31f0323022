"""The chat stream's first chunk (the role) leaves with the first token, not before the
prompt is computed: clients time the first chunk as the time to first token."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from paged.engine.async_engine import SeqUpdate
from paged.engine.core import EngineOutput
from paged.engine.outputs import OutputState
from paged.sampling.params import SamplingParams
from paged.server.protocol import ChatCompletionRequest
from paged.server.serving import Prompt
from paged.server.serving_chat import _stream


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
    from paged.server.serving import SSEResponse

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
