"""Every client mistake is an OpenAI-shaped 4xx naming the field; never a 500."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

CHAT = [{"role": "user", "content": "hi"}]


def err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert "/" not in e["message"] or "Bearer" in e["message"], e  # no paths echoed
    return e


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [], "max_tokens": 1}, "prompt"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"max_tokens": 1}, "prompt"),
    ],
)
def test_completion_bad_field(http, body, param):
    e = err(http.post("/v1/completions", json=body), 400)
    assert e["param"] == param and e["message"].startswith(param), e


def test_chat_bad_fields(http):
    e = err(http.post("/v1/chat/completions", json={"messages": []}), 400)
    assert e["param"] == "messages"
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    e = err(http.post("/v1/chat/completions", json=bad_role), 400)
    assert e["param"] == "messages[0].role"
    e = err(http.post("/v1/chat/completions", json={"messages": CHAT, "presence_penalty": 5}), 400)
    assert e["param"] == "presence_penalty"


@pytest.mark.parametrize(
    "route, body, param",
    [  # no token can continue: found by the engine's first step
        ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes"], "allowed_token_ids": [0]},
         "guided_choice"),
        ("/v1/chat/completions",
         {"messages": CHAT, "structured_outputs": {"grammar": "root ::= root"}},
         "structured_outputs.grammar"),
    ],
)  # fmt: skip
def test_engine_refusal_is_the_same_4xx_streamed(http, route, body, param):
    """A request the engine refuses is a 400 naming the field as sent, with or without
    stream: never a 200 whose stream holds the error (the OpenAI SDK takes that for success)."""
    body = body | {"max_tokens": 2}
    e = err(http.post(route, json=body), 400)
    assert e["param"] == param and e["message"].startswith(f"{param}: no token"), e
    r = http.post(route, json=body | {"stream": True})
    assert r.headers["content-type"] == "application/json", r.text
    assert err(r, 400) == e


def test_engine_refusal_raises_in_the_sdk_stream(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=None, prompt="hi", max_tokens=2, stream=True,
                                  extra_body={"guided_regex": "\x16"})  # fmt: skip
    assert e.value.body["param"] == "guided_regex", e.value.body


def test_malformed_json_and_content(http):
    r = http.post(
        "/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"}
    )
    assert err(r, 400)["param"] == "body"
    r = http.post(
        "/v1/completions", content=b"\xff\xfe{}", headers={"content-type": "application/json"}
    )
    err(r, 400)
    nan = b'{"prompt": "hi", "temperature": NaN}'
    r = http.post("/v1/completions", content=nan, headers={"content-type": "application/json"})
    assert err(r, 400)["param"] == "temperature"


def test_context_overflow_reports_counts(http):
    n = http.post("/tokenize", json={"prompt": "hello there"}).json()["count"]
    e = err(http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2047}), 400)
    assert e["param"] == "max_tokens" and e["code"] == "context_length_exceeded"
    assert "2048" in e["message"] and str(n + 2047) in e["message"] and str(n) in e["message"]
    e = err(http.post("/v1/completions", json={"prompt": [5] * 2048}), 400)
    assert e["param"] == "prompt" and "2048" in e["message"]
    long_chat = {"messages": [{"role": "user", "content": "hi " * 3000}]}
    e = err(http.post("/v1/chat/completions", json=long_chat), 400)
    assert e["param"] == "messages" and e["code"] == "context_length_exceeded"


def test_auth(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-123"}):
        e = err(httpx.get(url + "/v1/models", headers=headers), 401)
        assert e["code"] == "invalid_api_key"
    err(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 401)
    assert httpx.get(url + "/health").status_code == 200  # open
    assert httpx.get(url + "/metrics").status_code == 200  # open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_model_404(http, client):
    e = err(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert e["param"] == "model" and e["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT)


def test_body_too_large_413(http):
    big = {"prompt": "a" * (9 << 20)}
    assert err(http.post("/v1/completions", json=big), 413)["param"] == "body"

    def chunks():  # no content-length: counted as it arrives
        for _ in range(10):
            yield b" " * (1 << 20)

    err(http.post("/v1/completions", content=chunks()), 413)


def test_unknown_route_and_method(http):
    err(http.get("/v1/nothing"), 404)
    err(http.get("/v1/completions"), 405)


def test_head_wherever_get(http):
    for path in ("/health", "/v1/models", "/version", "/"):
        r = http.head(path)
        assert r.status_code == 200 and r.content == b"", path
        assert int(r.headers["content-length"]) == len(http.get(path).content), path
    assert http.head("/v1/completions").status_code == 405
    paths = http.get("/openapi.json").json()["paths"]  # HEAD twins left out of the schema
    assert set(paths["/health"]) == {"get"} and set(paths["/v1/responses/{response_id}"]) == {
        "get", "delete"}  # fmt: skip


def test_server_still_serves(client):
    r = client.completions.create(model=None, prompt="hi", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_openapi_tells_the_real_errors(http):
    """No route advertises FastAPI's 422 (invalid bodies get 400, a non-JSON body 415), each
    declares its real errors in the server's shape, and /metrics is text/plain."""
    doc = http.get("/openapi.json").json()
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in doc["components"][
        "schemas"]  # fmt: skip
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post":
                assert {"400", "401", "413", "415", "503"} <= set(op["responses"]), path
                if not path.startswith("/v1/messages"):  # Anthropic's shape there
                    assert op["responses"]["400"]["content"]["application/json"]["schema"] == ref
    anthropic = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]
    assert anthropic["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
    detail = doc["components"]["schemas"]["ErrorDetail"]["properties"]
    assert set(detail) == {"message", "type", "param", "code"}
    assert "404" in doc["paths"]["/v1/models/{model}"]["get"]["responses"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")
    # what the schema says is what a bad body gets
    err(http.post("/v1/chat/completions", json={"messages": "no"}), 400)
    r = http.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "body", r.text
