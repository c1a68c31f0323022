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


def test_a_failing_engine_step_fails_its_lines_only(tiny_llama, tmp_path, capsys, monkeypatch):
    """A line whose engine step raises (the test-only fault hook) is answered 500 naming the
    engine, one whose handler raises (an internal error) 500 too; the other lines, before and
    after them, still run and the command exits 0."""
    from paged.cli.main import build_parser
    from paged.cli.run_batch import run
    from paged.engine.faults import Faults
    from paged.server import app

    async def boom(*_: object) -> None:
        raise RuntimeError("a bug in the chat handler")

    monkeypatch.setattr(app, "create_chat_completion", boom)
    poison = 77
    lines = [_line(f"c{i}", COMP, {"prompt": [5 + i, 6, 7], "max_tokens": 3, "ignore_eos": True})
             for i in range(3)]  # fmt: skip
    lines.insert(1, _line("bad", COMP, {"prompt": [poison, 6], "max_tokens": 3}))
    lines.insert(3, _line("bug", CHAT, {"messages": [{"role": "user", "content": "hi"}]}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    argv = ["run-batch", "-i", str(src), "-o", str(dst), tiny_llama, "--max-model-len", "64",
            "--kv-cache-memory", "8MiB", "--max-num-seqs", "1"]  # fmt: skip
    assert run(build_parser(argv).parse_args(argv), Faults(fail_token=poison)) == 0
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    assert [out[f"c{i}"]["response"]["status_code"] for i in range(3)] == [200] * 3
    bad = out["bad"]
    assert bad["response"]["status_code"] == 500 and bad["error"]["code"] == "server_error"
    assert "engine" in bad["error"]["message"] and "injected" not in bad["error"]["message"]
    bug = out["bug"]
    assert bug["response"]["status_code"] == 500 and bug["error"]["code"] == "server_error"
    assert bug["error"]["message"] == "internal server error (RuntimeError)"
    assert "5 requests: 3 succeeded, 2 failed" in capsys.readouterr().err


def test_an_app_exception_answers_500_not_a_traceback():
    """send_all against an app that raises with no handler of its own (a bare 500)."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from paged.cli.run_batch import parse_line, send_all

    async def ok(_: object) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def boom(_: object) -> JSONResponse:
        raise RuntimeError("bug")

    web = Starlette(routes=[Route(COMP, ok, methods=["POST"]), Route(CHAT, boom, methods=["POST"])])
    items = [parse_line(0, _line("a", COMP, {})), parse_line(1, _line("b", CHAT, {}))]
    asyncio.run(send_all(web, items, 2))
    assert (items[0].status, items[0].answer) == (200, {"ok": True})
    assert items[1].status == 500 and items[1].answer["error"]["type"] == "api_error"


def test_a_dead_engine_ends_the_run_with_5xx_lines_and_exit_1(tiny_llama, tmp_path, monkeypatch):
    """The engine's process killed mid-run: the lines in flight and those not yet sent answer
    503, the results are still written, and the command exits 1 (no hang)."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    from paged.cli import run_batch
    from paged.cli.main import build_parser
    from paged.engine.faults import Faults

    sending = threading.Event()  # the engine is ready and the lines are going to it
    send_all = run_batch.send_all
    monkeypatch.setattr(run_batch, "send_all", lambda *a: sending.set() or send_all(*a))
    lines = [_line(f"c{i}", COMP, {"prompt": [5 + i, 6], "max_tokens": 40, "ignore_eos": True})
             for i in range(6)]  # fmt: skip
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    argv = ["run-batch", "-i", str(src), "-o", str(dst), tiny_llama, "--max-model-len", "64",
            "--kv-cache-memory", "8MiB", "--max-num-seqs", "2",
            "--max-concurrency", "2"]  # fmt: skip
    got: dict = {}
    args = build_parser(argv).parse_args(argv)
    t = threading.Thread(target=lambda: got.update(rc=run_batch.run(args, Faults(step_delay=0.05))))
    t.start()
    assert sending.wait(60)
    time.sleep(0.5)  # the first two lines in flight (each 40 steps of 50 ms)
    core = next(p for p in multiprocessing.active_children() if p.name == "paged-core")
    os.kill(core.pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and got["rc"] == 1
    codes = [json.loads(ln)["response"]["status_code"] for ln in dst.read_text().splitlines()]
    assert len(codes) == 6 and 503 in codes and set(codes) <= {200, 503}, codes


def test_files_that_cannot_be_used_fail_before_the_engine_runs(cli, tmp_path, caplog):
    """A missing input, an input not UTF-8, an output that cannot be written: one line naming
    the file (and the line), exit 2, no model loaded (there is none at that path)."""
    src, bad, dst = tmp_path / "in.jsonl", tmp_path / "bad.jsonl", tmp_path / "out.jsonl"
    src.write_text(_line("c", COMP, {"prompt": "x"}) + "\n")
    bad.write_bytes(src.read_bytes() * 2 + b'{"prompt": "caf\xe9"}\n')
    model = tmp_path / "no-model-here"
    for i, o, want in [
        (tmp_path / "nope.jsonl", dst, f"--input-file: cannot read {tmp_path}/nope.jsonl: No such"),
        (bad, dst, f"--input-file: {bad} line 3 is not UTF-8 (byte 0xe9"),
        (src, tmp_path / "no" / "out.jsonl", f"--output-file: cannot write {tmp_path}/no/out.js"),
    ]:  # fmt: skip
        caplog.clear()
        rc, _, err = cli("run-batch", "-i", i, "-o", o, model)
        msgs = [r.getMessage() for r in caplog.records] + err.splitlines()
        assert rc == 2 and any(m.startswith(want) for m in msgs), (want, msgs)
        assert "requests:" not in err
