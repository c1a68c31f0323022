"""The OpenAI API through the official client and raw HTTP, against the live server."""

from __future__ import annotations

import json

import httpx

import paged

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]


def test_health_version_models(server, http, client):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": paged.__version__}
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_model_retrieve(server, http, client):
    """GET /v1/models/{id} (OpenAI's models.retrieve): the list's own entry, else a 404."""
    listed = http.get("/v1/models").json()["data"]
    for card in listed:
        r = http.get(f"/v1/models/{card['id']}")
        assert r.status_code == 200 and r.json() == card, r.text
    m = client.models.retrieve(listed[0]["id"])
    assert m.id == listed[0]["id"] and m.object == "model" and m.owned_by == "paged"
    r = http.get("/v1/models/no-such/model")
    assert r.status_code == 404, r.text
    assert r.json() == {"error": {
        "message": "model: the model 'no-such/model' does not exist",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}}  # fmt: skip
    assert http.head(f"/v1/models/{listed[0]['id']}").status_code == 200
    assert httpx.get(f"{server.url}/v1/models/{listed[0]['id']}").status_code == 401


def test_completion_greedy_with_usage(client, http):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=5, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text.strip().startswith("Paris")
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == n_prompt + 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_token_prompts_and_echo(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(
        model=None, prompt=[ids, ids[:3]], max_tokens=2, temperature=0, echo=True
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith(PROMPT)
    assert r.usage.prompt_tokens == len(ids) + 3 and r.usage.completion_tokens == 4


def test_chat_n2_and_seed_reproducible(client):
    def ask(seed):
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=CHAT,
            max_tokens=4,
            temperature=1.0,
            seed=seed,
            n=2,
        )

    a, b = ask(1234), ask(1234)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.role == "assistant"
    assert 2 <= a.usage.completion_tokens <= 8


def test_stream_chat_matches_full_and_reports_usage(client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_raw_sse_ends_with_done(http):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"]


def test_stop_string(client):
    kw = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text.strip()[2:5]  # somewhere inside the greedy continuation
    r = client.completions.create(**kw, stop=[stop])
    c = r.choices[0]
    assert c.finish_reason == "stop" and stop not in c.text
    assert text.startswith(c.text) and c.model_extra["stop_reason"] == stop


def test_extra_sampling_fields_accepted(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,
        max_completion_tokens=3,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="someone",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 3,
            "ignore_eos": True,
            "stop_token_ids": [2],
            "logit_bias": {"42": -5},
        },
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_tokenize_detokenize(http):
    t = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {
        "prompt": "hello world"
    }
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > t["count"]


def test_completion_logprobs(client):
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 3
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and chosen <= 0
        assert abs(chosen - max(top.values())) < 1e-4  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_streamed(client):
    kw = dict(model=None, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
              top_logprobs=3)  # fmt: skip
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(full) == 4 and all(len(e.top_logprobs) == 3 for e in full)
    assert full[0].bytes == list(full[0].token.encode())
    chunks = client.chat.completions.create(**kw, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in full]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in full]


def test_vllm_compatible_details(client, http):
    """Where vLLM's own server tests found paged answering differently."""
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=2, temperature=0,
                                  logprobs=0)  # fmt: skip
    lp = r.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]  # the sampled one
    body = {"prompt": PROMPT, "max_tokens": 1, "stream_options": {"include_usage": True}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "model": ""})
    assert r.status_code == 200, r.text
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == card["id"] and card["parent"] is None
    for seed, status in ((2**63 - 1, 200), (-(2**63), 200), (2**63, 400)):
        body = {"prompt": PROMPT, "max_tokens": 2, "seed": seed, "n": 2}
        assert http.post("/v1/completions", json=body).status_code == status, seed
    r = http.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 1})
    msg = r.json()["error"]["message"]
    assert "out of vocabulary" in msg and "49152" in msg, msg
