"""The bad-input matrix of issue 6: every case is an OpenAI-shaped 4xx naming the field, and
the server serves a normal request afterwards."""

from __future__ import annotations

import json

import pytest
from reliability_helpers import check_error

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}

# (route, body, status, param): the param the error must name (its message starts with it).
CASES = [
    # empty input
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [[]]}, 400, "prompt[0]"),
    (CMPL, {"prompt": ["hi", ""]}, 400, "prompt"),
    (CMPL, {"max_tokens": 2}, 400, "prompt"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    # wrong types
    (CMPL, {"prompt": 5}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "n": 1.5}, 400, "n"),
    (CMPL, {"prompt": "hi", "stop": 7}, 400, "stop"),
    (CMPL, {"prompt": "hi", "stream": [1]}, 400, "stream"),
    (CMPL, {"prompt": "hi", "logit_bias": ["5"]}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": [1, "two"]}, 400, "prompt"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSGS, "stream_options": 3}, 400, "stream_options"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    # unknown fields: refused on every route, never silently ignored
    ("/tokenize", {"prompt": "hi", "promt": "x"}, 400, "promt"),
    (CMPL, {"prompt": "hi", "guided_decoding_backend": "xgrammar"}, 400, "guided_decoding_backend"),
    (CMPL, {"prompt": "hi", "guided_json": {"type": "bogus"}}, 400, "guided_json"),
    (CHAT, {"messages": MSGS, "tools": []}, 400, "tools"),
    ("/detokenize", {"tokens": [1], "text": "x"}, 400, "text"),
    # negative, NaN, infinite numbers
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": -0.5}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": -1}, 400, "min_p"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "n": -1}, 400, "n"),
    (CMPL, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": -101}}, 400, "logit_bias"),
    (CHAT, {"messages": MSGS, "top_logprobs": -1, "logprobs": True}, 400, "top_logprobs"),
    (CMPL, b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    (CMPL, b'{"prompt": "hi", "frequency_penalty": Infinity}', 400, "frequency_penalty"),
    (CMPL, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    (CMPL, b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    (CMPL, b'{"prompt": "hi", "logit_bias": {"5": NaN}}', 400, "logit_bias"),
    # max_tokens 0, negative, beyond the context (256); prompt beyond the context
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 256}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 300}, 400, "max_tokens"),
    (CMPL, {"prompt": [5] * 256}, 400, "prompt"),
    (CMPL, {"prompt": "word " * 400}, 400, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    (CHAT, {"messages": MSGS, "min_tokens": 10**9}, 400, "min_tokens"),
    # token ids outside the vocabulary (49152 ids)
    (CMPL, {"prompt": [1, 2, 49152]}, 400, "prompt"),
    (CMPL, {"prompt": [1, -2]}, 400, "prompt"),
    (CMPL, {"prompt": [[1], [10**12]]}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "logit_bias": {"49152": 5}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {str(10**30): 5}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    # absurd sizes
    (CMPL, {"prompt": "hi", "n": 10**6}, 400, "n"),
    (CMPL, {"prompt": "hi", "n": 129}, 400, "n"),
    (CMPL, {"prompt": ["hi"] * 9, "n": 128}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 10**6}, 400, "top_logprobs"),
    (CMPL, {"prompt": "hi", "stop": ["x"] * 65}, 400, "stop"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "top_k": 10**30}, 400, "top_k"),
    # invalid Unicode: raw bytes that are not UTF-8, and lone surrogates through escapes
    (CMPL, b'{"prompt": "\xff\xfe"}', 400, "body"),
    (CMPL, b'\xef\xbb\xbf\xff{"prompt": "hi"}', 400, "body"),
    (CMPL, b'{"prompt": "\\ud800"}', 400, "prompt"),
    (CMPL, b'{"prompt": "hi", "stop": ["\\udfff"]}', 400, "stop[0]"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\udc80"}]}', 400, "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a", "x": ["\\ud800"]}]}', 400, None),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    # malformed JSON
    (CMPL, b'{"prompt": "hi",', 400, "body"),
    (CMPL, b'{"prompt": "hi",}', 400, "body"),
    (CMPL, b"{'prompt': 'hi'}", 400, "body"),
    (CMPL, b"", 400, "body"),
    (CMPL, b"[1, 2]", 400, "body"),
    (CMPL, b"null", 400, "body"),
    # deeply nested JSON
    (CMPL, b"[" * 100_000 + b"]" * 100_000, 400, "body"),
    (CMPL, b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}", 400, "body"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a", "x": ' + b"{" * 3000, 400, "body"),
]


def post(http, route: str, body, headers: dict[str, str] | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(route, content=data, headers={**JSON, **(headers or {})})


@pytest.mark.parametrize("route, body, status, param", CASES, ids=lambda v: repr(v)[:40])
def test_bad_input(tiny_http, route, body, status, param):
    e = check_error(post(tiny_http, route, body), status)
    if param is not None:  # the field, or an element of it (prompt[1], messages[0].role)
        assert e["param"] == param or e["param"].startswith((param + "[", param + ".")), e
        assert e["message"].startswith(e["param"] + ": "), e


def test_unknown_model(tiny_http):
    for route, body in ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": MSGS})):
        e = check_error(post(tiny_http, route, {**body, "model": "gpt-17"}), 404)
        assert e["param"] == "model" and e["code"] == "model_not_found"


def test_wrong_content_type(tiny_http):
    good = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = tiny_http.post(CMPL, content=good, headers={"content-type": ctype})
        e = check_error(r, 415)
        assert e["param"] == "body" and "application/json" in e["message"]
    r = tiny_http.post(CMPL, content=good)  # no content type at all
    check_error(r, 415)


def test_oversized_body(tiny_http):
    big = json.dumps({"prompt": "a" * (9 << 20)}).encode()
    assert check_error(post(tiny_http, CMPL, big), 413)["param"] == "body"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(9):
            yield b" " * (1 << 20)

    check_error(tiny_http.post(CMPL, content=chunks(), headers=JSON), 413)


def test_still_serves_after_bad_input(tiny_http):
    assert tiny_http.get("/health").status_code == 200
    r = post(tiny_http, CMPL, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = post(tiny_http, CHAT, {"messages": MSGS, "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    assert '"error"' not in r.text
