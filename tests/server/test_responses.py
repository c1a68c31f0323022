"""The OpenAI Responses API (/v1/responses) through the `openai` SDK and raw HTTP, on the
session's server of the default model (conftest.py), which keeps at most two responses
(--max-stored-responses 2). Greedy outputs equal chat completions' for the same conversation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tool_model import WEATHER_TOOL

MODEL = "SmolLM2-135M-Instruct"
STATUS = {"length": "incomplete", "stop": "completed"}  # chat's finish_reason -> status
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}


def respond(client, **kw):
    defaults = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}
    return client.responses.create(**defaults | kw)


def chat(client, messages, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, **kw
    )


def same(r, c) -> None:
    """The response is the chat completion's: text, status, token counts."""
    assert r.output_text == c.choices[0].message.content
    assert r.status == STATUS[c.choices[0].finish_reason]
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens


def test_text_with_instructions_equals_chat(client):
    r = respond(client, input="Name a color.", instructions="Answer in one word.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 6
    assert [(o.type, o.role) for o in r.output] == [("message", "assistant")]
    c = chat(client, [{"role": "system", "content": "Answer in one word."},
                   {"role": "user", "content": "Name a color."}])  # fmt: skip
    same(r, c)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    # a message list is the same conversation
    listed = respond(client, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Name a "}, {"type": "input_text", "text": "color."}]}],
        instructions="Answer in one word.")  # fmt: skip
    assert listed.output_text == r.output_text


def test_stream_events(client, http):
    body = {"model": MODEL, "input": "Name a color.", "max_output_tokens": 6, "temperature": 0}
    full = respond(client, input="Name a color.")
    with http.stream("POST", "/v1/responses", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln.removeprefix("event: ") for ln in lines[0::2]]
    datas = [json.loads(ln.removeprefix("data: ")) for ln in lines[1::2]]
    assert [d["type"] for d in datas] == names
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    n = names.count("response.output_text.delta")
    assert n >= 1 and names == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{full.status}",
    ]  # fmt: skip
    text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    assert text == full.output_text == datas[-4]["text"]
    last = datas[-1]["response"]
    assert last["output"][0]["content"][0]["text"] == text
    assert last["usage"]["output_tokens"] == full.usage.output_tokens
    assert datas[0]["response"]["status"] == "in_progress"
    with client.responses.stream(model=MODEL, input="Name a color.", max_output_tokens=6,
                              temperature=0) as s:  # fmt: skip
        events = list(s)  # (get_final_response() wants response.completed, not .incomplete)
    assert [e.type for e in events] == names and events[-1].response.output_text == text


def test_previous_response_id_continues_the_conversation(client):
    first = respond(client, input="Name a color.", instructions="Be brief.")
    second = respond(client, input="Name another one.", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the first's input and output, not its instructions (as OpenAI)
    conv = [{"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Name another one."}]  # fmt: skip
    same(second, chat(client, conv))
    third = respond(client, input="And a third?", previous_response_id=second.id,
                    instructions="Answer in one word.")  # fmt: skip
    conv += [{"role": "assistant", "content": second.output_text},
             {"role": "user", "content": "And a third?"}]  # fmt: skip
    same(third, chat(client, [{"role": "system", "content": "Answer in one word."}, *conv]))
    assert client.responses.retrieve(third.id).output_text == third.output_text
    with pytest.raises(openai.BadRequestError, match="stream: retrieving"):  # never ignored
        list(client.responses.retrieve(third.id, stream=True))


def test_store_is_bounded_and_errors(client):
    a, b, c = (respond(client, input=f"Count to {i}.", max_output_tokens=1) for i in (1, 2, 3))
    with pytest.raises(openai.NotFoundError):  # the least recently used of three, bound 2
        client.responses.retrieve(a.id)
    assert client.responses.retrieve(b.id).id == b.id and client.responses.retrieve(c.id).id == c.id
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, input="x", previous_response_id=a.id)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    unstored = respond(client, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(c.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(c.id)
    refused = [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ]
    for kw, param in refused:
        body = {"input": "x", "max_output_tokens": 1} | kw
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **body)
        assert e.value.body["param"].startswith(param), (kw, e.value.body)


def test_function_call_round_trip(client):
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                             tool_choice=named, max_output_tokens=40, temperature=0)  # fmt: skip
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    after = respond(client, input=[out], previous_response_id=r.id, tools=[WEATHER],
                    tool_choice="none")  # fmt: skip
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id,
             "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]  # fmt: skip
    same(after, chat(client, conv, tools=[WEATHER_TOOL], tool_choice="none"))


def test_errors_name_the_responses_field(http):
    """param (and the message's start) is the field as this API spells it."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{oops"}
    cases = [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "text", "schema": {}}}}, "text.format.schema"),
        ({"input": [{"role": "user", "content": "x"}, call], "instructions": "Be brief."},
         "input[1].arguments"),  # the item as sent, not the chat message it becomes
        ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input[0].output"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": "x"}]}]}, "input[0].output[0].type"),
    ]  # fmt: skip
    for kw, param in cases:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x"} | kw)
        e = r.json()["error"]
        assert r.status_code == 400 and e["param"] == param, (kw, e)
        assert e["message"].startswith(f"{param}: "), e
    # as chat refuses the same tool_choice
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "tool_choice": "auto"})  # fmt: skip
    same_case = http.post("/v1/responses", json={"input": "x", "tool_choice": "auto"})
    assert r.json()["error"] == same_case.json()["error"]


def test_sent_back_items_and_metadata_limits():
    """Output items sent back as the SDK dumps them (a message's phase), a function output as
    input_text parts, an output answering no call, and OpenAI's metadata limits."""
    from pydantic import ValidationError

    from paged.server.responses_protocol import ResponsesRequest

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    parts = [{"type": "input_text", "text": "sun"}, {"type": "input_text", "text": "ny"}]
    req = ResponsesRequest(input=[
        {"type": "message", "role": "assistant", "phase": "final_answer", "content": "hi"},
        {"type": "message", "role": "assistant", "phase": None, "content": "hi"},
        call, {"type": "function_call_output", "call_id": "c1", "output": parts}])  # fmt: skip
    assert req.input_messages()[-1] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    lost = {"type": "function_call_output", "call_id": "c2", "output": "x"}
    with pytest.raises(ValidationError, match=r"input\[1\]\.call_id: no earlier"):
        ResponsesRequest(input=[call, lost])
    assert ResponsesRequest(input=[lost], previous_response_id="resp_1")  # the stored calls'
    for bad in ({"k" * 65: "v"}, {"k": "v" * 513}, {str(i): "v" for i in range(17)}):
        with pytest.raises(ValidationError, match="metadata"):
            ResponsesRequest(input="x", metadata=bad)
    assert ResponsesRequest(input="x", metadata={"k" * 64: "v" * 512})


def test_developer_message_as_on_chat(client):
    """A developer message reaches the chat template as chat completions give it."""
    dev = {"role": "developer", "content": "Answer in one word."}
    user = {"role": "user", "content": "Name a color."}
    same(respond(client, input=[dev, user]), chat(client, [dev, user]))


def test_echoes_the_sampling_used(client):
    """Left unset, temperature and top_p are echoed as sampled (this model has no generation
    config defaults: 1.0), not null."""
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=1)
    assert (r.temperature, r.top_p) == (1.0, 1.0)
    r = respond(client, input="x", max_output_tokens=1, top_p=0.5)
    assert (r.temperature, r.top_p) == (0.0, 0.5)
