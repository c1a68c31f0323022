"""paged run-batch: an OpenAI batch file, run offline through the server's request handling,
on a tiny random Llama."""

from __future__ import annotations

import json

from tiny_hf import TINY


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def test_run_batch(cli, tiny_llama, tmp_path):
    hello = [{"role": "user", "content": "hello world"}]
    chat = {"messages": hello, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    comp = {"prompt": ["the quick brown", "jumps over"], "max_tokens": 4, "n": 2,
            "seed": 1, "ignore_eos": True, "echo": True}  # fmt: skip
    lines = [
        _line("chat-1", CHAT, chat),
        "{this is not json",
        _line("comp-1", COMP, comp),
        _line("bad-temp", COMP, {"prompt": "x", "temperature": "hot"}),
        _line("too-long", COMP, {"prompt": [3] * 300, "max_tokens": 2}),
        "",
        # fields the server honours are honoured here too, not ignored
        _line("choice", COMP, {"prompt": "pick", "structured_outputs": {"choice": ["yes", "no"]}}),
        _line("logprobs", CHAT, {**chat, "logprobs": True, "top_logprobs": 2}),
        _line("unknown", CHAT, {**chat, "frobnicate": 1}),
        _line("stream", CHAT, {**chat, "stream": True}),
        _line("model", CHAT, {**chat, "model": "not-this-one"}),
        _line("embed", "/v1/embeddings", {"input": "hi"}),
        _line("get", COMP, {"prompt": "x"}).replace('"POST"', '"GET"'),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    flags = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--served-model-name", "tiny"]
    rc, _, err = cli("run-batch", "-i", src, "-o", dst, tiny_llama, *flags)
    assert rc == 0, err
    assert "12 requests: 5 succeeded, 7 failed" in err
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    assert list(out) == ["chat-1", None, "comp-1", "bad-temp", "too-long", "choice", "logprobs",
                         "unknown", "stream", "model", "embed", "get"]  # fmt: skip

    c = out["chat-1"]["response"]
    assert out["chat-1"]["error"] is None and c["status_code"] == 200
    body = c["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5

    p = out["comp-1"]["response"]["body"]
    assert p["object"] == "text_completion"
    assert [ch["index"] for ch in p["choices"]] == [0, 1, 2, 3]
    assert p["choices"][0]["text"].startswith("the quick brown")  # echo
    assert p["usage"]["completion_tokens"] == 16

    assert out["choice"]["response"]["body"]["choices"][0]["text"] in ("yes", "no")
    emb = out["embed"]["response"]["body"]
    assert emb["object"] == "list" and len(emb["data"][0]["embedding"]) == TINY["hidden_size"]
    top = out["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(top) == 5 and all(len(t["top_logprobs"]) == 2 for t in top)

    def refused(cid: str) -> tuple[int, str]:
        o = out[cid]
        assert o["error"]["message"] == o["response"]["body"]["error"]["message"]
        return o["response"]["status_code"], o["error"]["message"]

    assert refused(None)[0] == 400 and "not valid JSON" in refused(None)[1]
    assert refused("bad-temp")[0] == 400 and "temperature" in refused("bad-temp")[1]
    assert refused("too-long")[0] == 400 and "prompt" in refused("too-long")[1]
    assert refused("unknown")[0] == 400 and "frobnicate" in refused("unknown")[1]
    assert refused("stream") == (400, "stream: a batch line cannot stream; leave stream unset")
    assert refused("model")[0] == 404 and "model" in refused("model")[1]
    assert refused("get")[0] == 400 and refused("get")[1].startswith("method:")
