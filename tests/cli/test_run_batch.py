"""paged run-batch: the OpenAI batch format, offline, on a tiny random Llama."""

from __future__ import annotations

import json

import pytest

from paged.cli.batch_body import BodyError, completion_prompts, sampling_params


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch(cli, tiny_llama, tmp_path):
    chat = {
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    comp = {
        "prompt": ["the quick brown", [5, 6, 7]],
        "max_completion_tokens": 4,
        "n": 2,
        "seed": 1,
        "ignore_eos": True,
        "echo": True,
    }
    lines = [
        _line("chat-1", "/v1/chat/completions", chat),
        "{this is not json",
        _line("comp-1", "/v1/completions", comp),
        _line("bad-temp", "/v1/completions", {"prompt": "x", "temperature": "hot"}),
        _line("too-long", "/v1/completions", {"prompt": [3] * 300, "max_tokens": 2}),
        "",
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc, _, err = cli(
        "run-batch",
        "-i",
        src,
        "-o",
        dst,
        tiny_llama,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "8MiB",
        "--served-model-name",
        "tiny",
    )
    assert rc == 0, err
    assert "5 requests: 2 succeeded, 3 failed" in err
    out = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat-1", None, "comp-1", "bad-temp", "too-long"]

    c = out[0]["response"]
    assert out[0]["error"] is None and c["status_code"] == 200
    body = c["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5

    p = out[2]["response"]["body"]
    assert p["object"] == "text_completion"
    assert [ch["index"] for ch in p["choices"]] == [0, 1, 2, 3]
    assert p["choices"][0]["text"].startswith("the quick brown")  # echo
    assert p["usage"]["completion_tokens"] == 16
    assert p["usage"]["prompt_tokens"] > 3  # both prompts: the text one and 3 ids

    assert "not valid JSON" in out[1]["error"]["message"]
    assert out[1]["response"]["status_code"] == 400
    assert out[3]["error"]["message"].startswith("temperature:")
    assert "prompt" in out[4]["error"]["message"]  # longer than the context: 400, no crash
    assert out[4]["response"]["status_code"] == 400


def test_body_mapping():
    p = sampling_params(
        {
            "max_completion_tokens": 7,
            "max_tokens": 3,
            "top_p": 0.5,
            "stop": "x",
            "seed": 4,
            "logit_bias": {"5": 1},
        },
        default_max_tokens=16,
    )
    assert (p.max_tokens, p.top_p, p.stop, p.seed, p.logit_bias) == (7, 0.5, ["x"], 4, {5: 1.0})
    assert sampling_params({}, default_max_tokens=16).max_tokens == 16
    with pytest.raises(BodyError, match="^n:"):
        sampling_params({"n": 1.5}, None)
    with pytest.raises(BodyError, match="^max_tokens:"):
        sampling_params({"max_tokens": 0}, None)
    assert completion_prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert completion_prompts({"prompt": ["a", [1]]}) == ["a", [1]]
    with pytest.raises(BodyError, match="^prompt:"):
        completion_prompts({"prompt": []})
