"""vLLM's sampling fields on /v1/completions: n and best_of, echo with logprobs, prompt_logprobs,
truncate_prompt_tokens, continuous usage, and the ones refused with a 400 naming them; chat's
template options, echo and add_special_tokens (and /tokenize rendering messages as chat)."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "The capital of France is"
BASE = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_n_samples_equal_seeded_single_requests(http):
    many = ok(http.post("/v1/completions", json=BASE | {"n": 3, "seed": 42}))["choices"]
    singles = [
        ok(http.post("/v1/completions", json=BASE | {"seed": 42 + i}))["choices"][0]["text"]
        for i in range(3)
    ]
    assert [c["index"] for c in many] == [0, 1, 2]
    assert [c["text"] for c in many] == singles


def test_best_of_returns_the_most_likely_and_refuses_streaming(http):
    body = BASE | {"n": 2, "best_of": 4, "seed": 5}
    got = ok(http.post("/v1/completions", json=body))
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in got["choices"])
    every = ok(http.post("/v1/completions", json=BASE | {"n": 4, "seed": 5, "logprobs": 0}))

    def total(c: dict) -> float:
        return sum(c["logprobs"]["token_logprobs"])

    best = sorted(every["choices"], key=lambda c: -total(c))[:2]
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in best]
    for bad in ({"stream": True}, {"best_of": 1}):
        r = http.post("/v1/completions", json=body | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_echo_with_logprobs_and_prompt_logprobs(http):
    ids = ok(http.post("/tokenize", json={"prompt": PROMPT}))["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    c = ok(http.post("/v1/completions", json=body | {"prompt_logprobs": 1}))["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry, value in zip(ids[1:], plp[1:], lp["token_logprobs"][1 : len(ids)]):
        assert entry[str(tid)]["logprob"] == pytest.approx(value)
        assert entry[str(tid)]["rank"] >= 1
        assert any(e["rank"] == 1 for e in entry.values())
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # Streamed: the echoed prompt with its logprobs first, then the same completion.
    r = http.post("/v1/completions", json=body | {"stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]


def test_truncate_prompt_tokens(http):
    ids = ok(http.post("/tokenize", json={"prompt": PROMPT}))["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True}
    got = ok(http.post("/v1/completions", json=body))
    assert got["usage"]["prompt_tokens"] == 3
    tail = ok(http.post("/detokenize", json={"tokens": ids[-3:]}))["prompt"]
    assert got["choices"][0]["text"].startswith(tail)
    for k in (0, 10**6):
        r = http.post("/v1/completions", json=body | {"truncate_prompt_tokens": k})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(http, route):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = BASE | {"n": 2, "seed": 1, "stream": True, "stream_options": opts}
    if route.endswith("chat/completions"):
        body = body | {"messages": [{"role": "user", "content": body.pop("prompt")}]}
    r = http.post(route, json=body)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    used = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert all(ch["usage"]["prompt_tokens"] > 0 for ch in chunks)
    assert used == sorted(used) and used[-1] == 12


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"suffix": "and so on"}, "suffix"),
        ({"use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"use_beam_search": True, "temperature": 0.5}, "temperature"),
        ({"use_beam_search": True, "temperature": 0, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "temperature": 0, "n": 11}, "n"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_refused_fields_name_themselves(http, extra, param):
    r = http.post("/v1/completions", json=BASE | extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_template_options(http):
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Bl"}]
    body = {"messages": conv, "max_tokens": 2, "temperature": 0, "add_generation_prompt": False}

    def prompt_tokens(extra: dict) -> int:
        return ok(http.post("/v1/chat/completions", json=body | extra))["usage"]["prompt_tokens"]

    closed = prompt_tokens({})
    assert prompt_tokens({"continue_final_message": True}) < closed  # no end-of-turn after "Bl"
    assert prompt_tokens({"chat_template_kwargs": {"enable_thinking": False}}) == closed
    for extra, param in (
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ):
        r = http.post("/v1/chat/completions", json=body | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_beam_search_matches_the_offline_api(http, smollm):
    from paged import BeamSearchParams

    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True,
            "temperature": 0, "length_penalty": 0.5, "stream": False}  # fmt: skip
    got = ok(http.post("/v1/completions", json=body))["choices"]
    ids = ok(http.post("/tokenize", json={"prompt": PROMPT}))["tokens"]
    want = smollm.beam_search([ids], BeamSearchParams(2, 4, length_penalty=0.5))[0].sequences
    tok = smollm.get_tokenizer()
    assert [c["text"] for c in got] == [tok.decode(s.tokens[len(ids) :]) for s in want]
    chat_body = {k: v for k, v in body.items() if k != "prompt"}
    chat_body["messages"] = [{"role": "user", "content": PROMPT}]
    chat = ok(http.post("/v1/chat/completions", json=chat_body))
    assert len(chat["choices"]) == 2 and chat["choices"][1]["message"]["content"]


def test_n_samples_compute_the_prompt_once_in_metrics(http):
    import uuid

    def counter(name: str) -> float:
        line = next(ln for ln in http.get("/metrics").text.splitlines()
                    if ln.startswith(f"paged:{name}_total{{"))  # fmt: skip
        return float(line.rsplit(" ", 1)[1])

    prompt = f"{uuid.uuid4().hex} is a word nobody has cached yet, so"  # no prefix-cache hit
    before = counter("prompt_tokens_computed"), counter("prompt_tokens")
    got = ok(http.post("/v1/completions", json=BASE | {"prompt": prompt, "n": 4, "seed": 3}))
    n = got["usage"]["prompt_tokens"]
    assert counter("prompt_tokens") - before[1] == n
    assert counter("prompt_tokens_computed") - before[0] == n  # once, not 4 times


CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3,
        "temperature": 0}  # fmt: skip


def test_chat_prompt_logprobs_equal_the_completions_ones(http):
    """The rendered chat prompt's prompt_logprobs equal /v1/completions' for the same ids."""
    got = ok(http.post("/v1/chat/completions", json=CHAT | {"prompt_logprobs": 2}))
    ids = ok(http.post("/tokenize", json={"messages": CHAT["messages"]}))["tokens"]
    plp = got["prompt_logprobs"]
    assert len(plp) == len(ids) == got["usage"]["prompt_tokens"] and plp[0] is None
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    ref = ok(http.post("/v1/completions", json=body))["choices"][0]["prompt_logprobs"]
    for mine, theirs, tid in zip(plp[1:], ref[1:], ids[1:]):
        assert mine[str(tid)]["logprob"] == pytest.approx(theirs[str(tid)]["logprob"], abs=1e-4)
        assert mine[str(tid)]["rank"] == theirs[str(tid)]["rank"]
    assert "prompt_logprobs" not in ok(http.post("/v1/chat/completions", json=CHAT))
    r = http.post("/v1/chat/completions", json=CHAT | {"prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_chat_truncate_prompt_tokens(http):
    got = ok(http.post("/v1/chat/completions", json=CHAT | {"truncate_prompt_tokens": 4}))
    assert got["usage"]["prompt_tokens"] == 4
    for k in (0, 10**6):
        r = http.post("/v1/chat/completions", json=CHAT | {"truncate_prompt_tokens": k})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_minus_one_keeps_the_context_length(http, route):
    """-1 (vLLM's, as on /v1/embeddings): the last max_model_len tokens. A prompt that fits
    is unchanged; a longer one fills the context, leaving no room for the output: a 400
    naming the prompt's field (never a 500)."""
    chat = route.endswith("chat/completions")

    def body(text: str) -> dict:
        b = {"max_tokens": 1, "temperature": 0}
        return b | ({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})

    whole = ok(http.post(route, json=body(PROMPT)))["usage"]["prompt_tokens"]
    got = ok(http.post(route, json=body(PROMPT) | {"truncate_prompt_tokens": -1}))
    assert got["usage"]["prompt_tokens"] == whole
    r = http.post(route, json=body(" hello" * 2100) | {"truncate_prompt_tokens": -1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == ("messages" if chat else "prompt") and "2048 tokens" in err["message"]
    r = http.post(route, json=body(PROMPT) | {"truncate_prompt_tokens": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_tokenize_renders_messages_as_chat(http):
    """/tokenize's messages take chat's template options and give the ids chat prompts with."""
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Bl"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    ids = ok(http.post("/tokenize", json={"messages": conv} | opts))["tokens"]
    closed = ok(http.post("/tokenize", json={"messages": conv, "add_generation_prompt": False}))
    assert len(ids) < closed["count"]  # no end-of-turn after "Bl"
    body = {"messages": conv, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0} | opts
    got = ok(http.post("/v1/chat/completions", json=body))
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert all(str(t) in lp for t, lp in zip(ids[1:], got["prompt_logprobs"][1:]))
    for extra, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # generation prompt on
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),  # as chat: never a request's
    ):
        r = http.post("/tokenize", json={"messages": conv} | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/chat/completions", json=body | {"chat_template": "{{ messages }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    for extra in ({"continue_final_message": True}, {"chat_template_kwargs": {}}):
        r = http.post("/tokenize", json={"prompt": PROMPT} | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text


def test_chat_echo(http):
    """vLLM's chat echo: the last (assistant) message's content before the reply's; streamed
    as the first content delta, after the role's. Another role's message is not echoed."""
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Bl"}]
    body = {"messages": conv, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    plain = ok(http.post("/v1/chat/completions", json=body))["choices"][0]["message"]["content"]
    got = ok(http.post("/v1/chat/completions", json=body | {"echo": True}))
    assert got["choices"][0]["message"]["content"] == "Bl" + plain
    r = http.post("/v1/chat/completions", json=body | {"echo": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Bl"}
    assert "".join(d.get("content") or "" for d in deltas) == "Bl" + plain
    user_last = {"messages": conv[:1], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    want = ok(http.post("/v1/chat/completions", json=user_last))["choices"][0]["message"]
    echoed = ok(http.post("/v1/chat/completions", json=user_last | {"echo": True}))
    assert echoed["choices"][0]["message"]["content"] == want["content"]
    beam = user_last | {"echo": True, "use_beam_search": True, "n": 2}
    r = http.post("/v1/chat/completions", json=beam)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> str:
    """A 2-layer random Llama with the default model's tokenizer and chat template, set to
    add a BOS token (<|endoftext|>) as Llama's tokenizers do."""
    from tiny_hf import llama_with_tokenizer

    from paged.model.loader import load_tokenizer, resolve_model

    path = str(tmp_path_factory.mktemp("bos") / "tiny-llama")
    tok = load_tokenizer(resolve_model(None))
    tok.bos_token, tok.add_bos_token = "<|endoftext|>", True
    return llama_with_tokenizer(path, tok)


def test_add_special_tokens(bos_model, launch):
    """vLLM's add_special_tokens: completions default true (the tokenizer's BOS), chat default
    false (the template's tokens only); the other way when asked, the prompts /tokenize gives."""
    srv = launch([bos_model, "--max-model-len", "256", "--kv-cache-memory", "16MiB"])

    def post(route: str, body: dict) -> dict:
        return ok(httpx.post(srv.url + route, json=body, timeout=60))

    def prompted_with(route: str, body: dict, ids: list[int]) -> bool:
        """Whether the route's prompt was `ids` (its prompt_logprobs name each token)."""
        got = post(route, body | {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        plp = got.get("prompt_logprobs") or got["choices"][0]["prompt_logprobs"]
        return got["usage"]["prompt_tokens"] == len(plp) == len(ids) and all(
            str(t) in lp for t, lp in zip(ids[1:], plp[1:])
        )

    with_bos = post("/tokenize", {"prompt": PROMPT})["tokens"]
    without = post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    assert with_bos == [0, *without]  # <|endoftext|> is token 0
    assert prompted_with("/v1/completions", {"prompt": PROMPT}, with_bos)
    assert prompted_with("/v1/completions", {"prompt": PROMPT, "add_special_tokens": False},
                         without)  # fmt: skip
    msgs = [{"role": "user", "content": "Name a colour."}]
    template = post("/tokenize", {"messages": msgs})["tokens"]
    assert template[0] != 0
    assert post("/tokenize", {"messages": msgs, "add_special_tokens": True})["tokens"] == [
        0, *template]  # fmt: skip
    assert prompted_with("/v1/chat/completions", {"messages": msgs}, template)
    assert prompted_with("/v1/chat/completions", {"messages": msgs, "add_special_tokens": True},
                         [0, *template])  # fmt: skip
