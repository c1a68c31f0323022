"""The Anthropic and Responses stream formats of an output holding reasoning, text and tool
calls, without a server: a fake engine replays fixed text pieces through the streams, which
must carry exactly the non-streamed blocks."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from tool_model import TIME_TOOL, WEATHER_TOOL

TEXT = [
    "<think>Paris", ", so the weather.</th", "ink>Let me", " check.\n<tool_call>\n",
    '{"name": "get_weather", "arguments": {"city": "Pa', 'ris", "unit": "celsius"}}',
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"utc_offset": 1}}',
    "\n</tool_call>",
]  # fmt: skip
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


class FakeServing:
    """What the stream code asks of Serving: generate() replays TEXT, one piece a step."""

    model_name = "fake"

    async def generate(self, rid, prompts):
        out = SimpleNamespace(token_ids=[], finish_reason=None, stop_reason=None, text="")
        pending = []
        for i, piece in enumerate(TEXT):
            out.token_ids.append(i)
            out.text += piece
            pending.append(piece)
            last = i == len(TEXT) - 1
            if last:
                out.finish_reason = "stop"

            def delta(p=tuple(pending)):
                pending.clear()
                return "".join(p)

            state = SimpleNamespace(out=out, finished=last, text_delta=delta)
            yield (
                0,
                SimpleNamespace(index=0, state=state, output=SimpleNamespace(num_cached_tokens=3)),
            )


def parsing():
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=USER, tools=[WEATHER_TOOL, TIME_TOOL])
    return ChatParsing(ParsingOptions(True, "hermes", "qwen3"), req, "")


def sse(raw: list[str]) -> list[tuple[str, dict]]:
    events = []
    for chunk in raw:
        name, data = chunk.strip().split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def collect(agen) -> list[str]:
    return [x async for x in agen]


@pytest.fixture
def prompt():
    from paged.sampling.params import SamplingParams
    from paged.server.serving import Prompt

    return Prompt("", [1, 2, 3, 4], SamplingParams(max_tokens=50))


def test_anthropic_stream_of_thinking_text_and_tool_use(prompt):
    from paged.server.output_blocks import BlockStream, full_blocks
    from paged.server.serving_anthropic import _block, _stream

    sv = FakeServing()
    p = parsing()
    events = sse(asyncio.run(collect(_stream(sv, "msg_1", prompt, BlockStream(p, "toolu")))))
    names = [n for n, _ in events]
    assert all(d["type"] == n for n, d in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b.get("name")) for b in starts] == [
        ("thinking", None), ("text", None), ("tool_use", "get_weather"), ("tool_use", "get_time")
    ]  # fmt: skip
    joined = {}
    for n, d in events:
        if n == "content_block_delta" and d["delta"]["type"] != "signature_delta":
            piece = next(v for k, v in d["delta"].items() if k != "type")
            joined[d["index"]] = joined.get(d["index"], "") + piece
    want, _ = full_blocks(p, "".join(TEXT), "toolu")
    got = [_block(b) for b in want]
    assert joined[0] == got[0]["thinking"] == "Paris, so the weather."
    assert joined[1] == got[1]["text"] == "Let me check."
    assert json.loads(joined[2]) == got[2]["input"] == {"city": "Paris", "unit": "celsius"}
    assert json.loads(joined[3]) == got[3]["input"] == {"utc_offset": 1}
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(TEXT)
    assert delta["usage"]["cache_read_input_tokens"] == 3


def test_responses_stream_of_reasoning_text_and_function_calls(prompt):
    from paged.server.output_blocks import BlockStream
    from paged.server.responses_protocol import ResponsesRequest
    from paged.server.serving_responses import ResponseStore, Run

    sv = FakeServing()
    store = ResponseStore(sv, 4)
    req = ResponsesRequest(input="Weather and time in Paris?")
    run = Run(sv, req, "resp_1", req.input_messages())
    raw = asyncio.run(collect(store._stream(run, prompt, BlockStream(parsing(), "call"))))
    events = sse(raw)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    text_item = ["response.output_item.added", "response.content_part.added"]
    assert names == [
        "response.created", "response.in_progress",
        *text_item, *["response.reasoning_text.delta"] * 2, "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        *text_item, *["response.output_text.delta"] * 2, "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * 2,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"
    ]  # fmt: skip
    assert final["output"][0]["content"][0]["text"] == "Paris, so the weather."
    assert final["output"][1]["content"][0]["text"] == "Let me check."
    calls = [(o["name"], json.loads(o["arguments"])) for o in final["output"][2:]]
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                     ("get_time", {"utc_offset": 1})]  # fmt: skip
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert done == final["output"]
    # stored with its conversation: the next turn sees the reasoning, text and calls
    conv = store.items["resp_1"].conversation
    assert conv[-1]["content"] == "Let me check."
    assert conv[-1]["reasoning_content"] == "Paris, so the weather."
    assert [c["function"]["name"] for c in conv[-1]["tool_calls"]] == ["get_weather", "get_time"]
