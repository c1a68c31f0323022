"""Structured outputs through the OpenAI-compatible server on the default model (real JSON; the
session's `server` and `client` of tests/conftest.py):
response_format, vLLM's structured_outputs and guided_* fields, allowed_token_ids, bad_words,
streamed and not, and the 400s of specs that do not parse."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from structured_helpers import SCHEMAS, format_checked

BY_NAME = {c["name"]: c for c in SCHEMAS}


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only: {BY_NAME[name]['prompt']}."}]


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": BY_NAME[name]["schema"]}}


def test_chat_json_schema_batched(client):
    names = ["person", "nested_address", "anyof_objects", "top_array"]

    def one(name: str):
        r = client.chat.completions.create(
            model="", messages=ask(name), max_tokens=100, temperature=0,
            response_format=json_schema(name),
        )  # fmt: skip
        return name, r.choices[0]

    with ThreadPoolExecutor(len(names)) as pool:
        for name, choice in pool.map(one, names):
            assert choice.finish_reason == "stop", name
            format_checked(BY_NAME[name]["schema"], json.loads(choice.message.content))


def test_chat_json_schema_streamed(client):
    stream = client.chat.completions.create(
        model="", messages=ask("person"), max_tokens=60, temperature=0, stream=True,
        response_format=json_schema("person"),
    )  # fmt: skip
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    format_checked(BY_NAME["person"]["schema"], json.loads(text))


def test_completions_fields(client):
    prompt = "Q: Is water wet? Answer with JSON.\nA:"
    r = client.completions.create(
        model="", prompt=prompt, max_tokens=60, temperature=0,
        extra_body={"response_format": json_schema("flag")},
    )  # fmt: skip
    format_checked(BY_NAME["flag"]["schema"], json.loads(r.choices[0].text))
    cases = [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"structured_outputs": {"regex": "(cat|dog)s?"}},
         lambda t: re.fullmatch("(cat|dog)s?", t)),
        ({"guided_grammar": 'root ::= "A" | "B" "!"'}, lambda t: t in ("A", "B!")),
        ({"structured_outputs": {"json": BY_NAME["enum_numbers"]["schema"]}},
         lambda t: json.loads(t)["roll"] in range(1, 7)),
        ({"guided_json": BY_NAME["top_integer"]["schema"]},
         lambda t: 1900 <= json.loads(t) <= 2100),
    ]  # fmt: skip

    def one(body: dict):
        r = client.completions.create(
            model="", prompt=prompt, max_tokens=40, temperature=0, extra_body=body
        )
        return r.choices[0]

    with ThreadPoolExecutor(len(cases)) as pool:  # one batch
        for (body, check), choice in zip(cases, pool.map(one, [b for b, _ in cases])):
            assert choice.finish_reason == "stop", body
            assert check(choice.text), (body, choice.text)


def test_chat_json_object(client):
    r = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": 'Reply with {"ok": true} and nothing else.'}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_allowed_token_ids_and_bad_words(http, client):
    tok = http.post(
        "/tokenize", json={"prompt": " yes no", "add_special_tokens": False}
    )
    allowed = tok.json()["tokens"]
    r = client.completions.create(
        model="", prompt="Say something:", max_tokens=8, temperature=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    assert re.fullmatch(r"( yes| no)+", r.choices[0].text), r.choices[0].text
    prompt = "The capital of France is"
    plain = client.completions.create(model="", prompt=prompt, max_tokens=8, temperature=0)
    assert "Paris" in plain.choices[0].text
    r = client.completions.create(
        model="", prompt=prompt, max_tokens=8, temperature=0, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in r.choices[0].text


def test_unconstrained_neighbours_unchanged(client):
    prompts = ["The history of Rome", "A recipe for bread:"]

    def plain(p: str) -> str:
        r = client.completions.create(model="", prompt=p, max_tokens=16, temperature=0)
        return r.choices[0].text

    alone = [plain(p) for p in prompts]

    def constrained(name: str) -> str:
        r = client.chat.completions.create(
            model="", messages=ask(name), max_tokens=80, temperature=0,
            response_format=json_schema(name),
        )  # fmt: skip
        return r.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        side = [pool.submit(constrained, n) for n in ("person", "city")]
        mixed = list(pool.map(plain, prompts))
        [f.result() for f in side]
    assert mixed == alone


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),  # not enforced
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object", "$defs": [1]}}, "guided_json"),  # xgrammar skips it
    ({"guided_choice": ["yes", "no"], "min_tokens": 5}, "min_tokens"),  # the grammar ends it
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, 2**70]}, "allowed_token_ids"),  # beyond any int the pipe carries
    ({"bad_words": [""]}, "bad_words"),
    # valid, but asks for a byte no token of SmolLM2's vocabulary holds: found while generating
    ({"guided_choice": ["\x16"]}, "guided_choice"),
]  # fmt: skip


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_specs_are_400s_naming_the_field(http, route):
    base = {"max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    base |= chat if "chat" in route else {"prompt": "hi"}
    for body, field in BAD:
        r = http.post(route, json=base | body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field, (body, err)
    # The engine lives on.
    r = http.post(route, json=base | {"guided_choice": ["fine"]}, timeout=60)
    assert r.status_code == 200


def test_a_constraint_no_token_can_meet_is_a_client_error_in_a_stream(http):
    body = {"prompt": "hi", "max_tokens": 4, "guided_regex": "ok\x16", "stream": True}
    r = http.post("/v1/completions", json=body, timeout=60)
    events = [json.loads(ln[6:]) for ln in r.text.splitlines()[:-1] if ln.startswith("data: {")]
    err = events[-1]["error"]  # after "ok": no token produces the byte 0x16
    assert r.status_code == 200 and err["type"] == "invalid_request_error", events
    assert err["param"] == "guided_regex" and "tokenizer cannot produce" in err["message"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")) == "ok"
