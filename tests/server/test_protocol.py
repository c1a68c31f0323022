"""Request validation, error mapping, the guard middleware and metrics, without a server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from paged.server.app import Guard
from paged.server.errors import install_handlers
from paged.server.metrics import ServerMetrics
from paged.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_shapes(prompt):
    assert CompletionRequest(prompt=prompt).prompt == prompt


def test_sampling_params_from_request():
    req = CompletionRequest(prompt="x", temperature=0.5, top_k=5, seed=3, stop="\n",
                            logit_bias={"7": -2.5}, n=2)  # fmt: skip
    p = req.sampling_params(10)
    assert (p.temperature, p.top_k, p.seed, p.stop, p.n) == (0.5, 5, 3, ["\n"], 2)
    assert p.logit_bias == {7: -2.5} and p.max_tokens == 10
    assert CompletionRequest(prompt="x").sampling_params(None).temperature == 1.0


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 1, "guided_choice": ["a"]}, "min_tokens"),  # the grammar ends it
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
    ],
)
def test_sampling_errors_name_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        CompletionRequest(prompt="x", **fields).sampling_params(2)


def test_chat_message_parts():
    req = ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]  # fmt: skip
    )
    # text parts joined with a newline, as vLLM joins them
    assert req.messages[0].as_template_input(0) == {"role": "user", "content": "a\nb"}
    img = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content"):
        img.messages[0].as_template_input(0)


def test_tokenize_needs_one_input():
    with pytest.raises(ValueError):
        TokenizeRequest()
    with pytest.raises(ValueError):
        TokenizeRequest(prompt="a", messages=[{"role": "user", "content": "b"}])
    tool = {"type": "function", "function": {"name": "f"}}
    for extra in ({"add_generation_prompt": False}, {"tools": [tool]},  # chat only: not ignored
                  {"continue_final_message": True}, {"chat_template_kwargs": {}}):  # fmt: skip
        with pytest.raises(ValueError, match=f"{next(iter(extra))}: applies to messages"):
            TokenizeRequest(prompt="a", **extra)


def test_tokenize_template_options_follow_chat():
    """continue_final_message needs the generation prompt off, as on chat (its default: on)."""
    msgs = [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    for gen in (None, True):
        with pytest.raises(ValueError, match="continue_final_message: cannot be used"):
            TokenizeRequest(messages=msgs, continue_final_message=True, add_generation_prompt=gen)
    req = TokenizeRequest(messages=msgs, continue_final_message=True, add_generation_prompt=False,
                          chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert req.template_kwargs() == {"enable_thinking": False, "continue_final_message": True}


@pytest.mark.parametrize("cls, key", [(CompletionRequest, "prompt"),
                                      (ChatCompletionRequest, "messages")])  # fmt: skip
def test_truncate_prompt_tokens_values(cls, key):
    """-1 (the context length) or a positive count, as vLLM's; 0 and below -1 refused."""
    body = {key: "a" if key == "prompt" else [{"role": "user", "content": "a"}]}
    assert cls(**body, truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            cls(**body, truncate_prompt_tokens=bad)


@pytest.fixture(scope="module")
def app_client():
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict:
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        return {}

    state = SimpleNamespace(api_key="k", max_body=1000, draining=False, inflight=0,
                            body_timeout=5.0, max_pending_body=1 << 20, pending_body=0)  # fmt: skip
    with TestClient(Guard(app, state), headers={"Authorization": "Bearer k"}) as c:
        yield c


def _error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_validation_errors_are_400_with_param(app_client):
    c = app_client
    assert _error(c.post("/v1/completions", json={"prompt": "x", "n": 0}), 400)["param"] == "n"
    assert _error(c.post("/v1/completions", json={}), 400)["param"] == "prompt"
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "bot"}]}
    assert _error(c.post("/v1/chat/completions", json=bad), 400)["param"] == "messages[1].role"
    bad = {"messages": [{"role": "system", "content": "x"}, {"role": "user"}]}  # as offline chat()
    err = _error(c.post("/v1/chat/completions", json=bad), 400)
    assert err["param"] == "messages[1].content" and "a user message needs it" in err["message"]
    ok = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}  # a prefix
    assert c.post("/v1/chat/completions", json=ok).status_code == 200
    r = c.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert _error(r, 400)["param"] == "body"
    r = c.post("/v1/completions", json={"prompt": "x", "whatever": 1})  # never silently ignored
    assert _error(r, 400)["param"] == "whatever"
    for key in ("some-field", "a.b", "0", "x y", "top_k "):  # named whatever the name
        r = c.post("/v1/completions", json={"prompt": "x", key: 1})
        assert _error(r, 400)["param"] == key
    bad = {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text",
                                                                               "x-y": 1}}
    assert _error(c.post("/v1/chat/completions", json=bad), 400)["param"] == "response_format.x-y"
    assert c.post("/v1/completions", json={"prompt": "x", "user": "u"}).status_code == 200


def test_strict_types_and_openais_tool_rules(app_client):
    """No lax coercion where OpenAI refuses: completions' logprobs is an integer (chat's is a
    boolean), parallel_tool_calls a boolean; a tool message names its call; function names
    match ^[a-zA-Z0-9_-]{1,64}$."""
    c = app_client
    r = c.post("/v1/completions", json={"prompt": "x", "logprobs": True})
    assert _error(r, 400)["param"] == "logprobs"
    assert c.post("/v1/completions", json={"prompt": "x", "logprobs": 1}).status_code == 200
    user = {"role": "user", "content": "x"}
    tool = {"type": "function", "function": {"name": "get-weather_2"}}
    ok = {"messages": [user], "tools": [tool], "parallel_tool_calls": False}
    assert c.post("/v1/chat/completions", json=ok).status_code == 200
    r = c.post("/v1/chat/completions", json=ok | {"parallel_tool_calls": "no"})
    assert _error(r, 400)["param"] == "parallel_tool_calls"
    for name in ('a b"c', "a.b", "x" * 65, ""):
        bad = {"messages": [user], "tools": [{"type": "function", "function": {"name": name}}]}
        err = _error(c.post("/v1/chat/completions", json=bad), 400)
        assert err["param"] == "tools[0].function.name", name
    result = {"role": "tool", "content": "sunny"}
    err = _error(c.post("/v1/chat/completions", json={"messages": [user, result]}), 400)
    assert err["param"] == "messages[1].tool_call_id"
    # a result answers an earlier call (as OpenAI's)
    err = _error(c.post("/v1/chat/completions", json={"messages": [
        user, result | {"tool_call_id": "call_1"}]}), 400)  # fmt: skip
    assert err["param"] == "messages[1].tool_call_id"
    call = {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
    ok = {"messages": [user, {"role": "assistant", "tool_calls": [call]},
                       result | {"tool_call_id": "call_1"}]}  # fmt: skip
    assert c.post("/v1/chat/completions", json=ok).status_code == 200
    empty = {"messages": [{"role": "user", "content": []}]}
    assert _error(c.post("/v1/chat/completions", json=empty), 400)["param"] == "messages[0].content"


def test_guard_key_and_size(app_client):
    c = app_client
    assert _error(
        c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}), 401
    )
    assert c.get("/health", headers={"Authorization": ""}).status_code == 200
    assert _error(c.post("/v1/completions", json={"prompt": "x" * 2000}), 413)["param"] == "body"


def test_metrics_render():
    stats = {"num_requests_running": 2, "prompt_tokens": 7}
    m = ServerMetrics("m", lambda: stats)
    m.tokens(0.1, 1, first=True)
    m.finished("stop", 1.0)
    text = m.render().decode()
    assert 'paged:num_requests_running{model_name="m"} 2.0' in text
    assert 'paged:prompt_tokens_total{model_name="m"} 7.0' in text
    assert 'paged:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'paged:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
