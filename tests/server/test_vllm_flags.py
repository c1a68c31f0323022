"""vLLM's `serve` flags: each honoured (one live server with most of them: TLS, CORS, a root
path, --model as a flag, the generation config, --max-logprobs) or refused with its reason."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import server_helpers
from tls_cert import self_signed
from tool_model import MODEL_ARGS, make_tool_model

KEY = "flags-key"
ORIGIN = "http://app.example"
GEN_CONFIG = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.05,
              "max_new_tokens": 5, "do_sample": True}  # fmt: skip


def parse(*flags: str):
    """EngineConfig of `paged serve FLAGS` (the parser `paged serve` uses)."""
    from paged.cli.main import build_parser
    from paged.config import EngineConfig

    argv = ["serve", *flags]
    return EngineConfig.from_cli_args(build_parser(argv).parse_args(argv))


# ---- flags honoured or refused (no server) --------------------------------------------------


def test_model_flag_and_parallel_aliases():
    c = parse("--model", "some/model", "-tp", "2", "-pp", "3", "-dp", "4")
    assert (c.model, c.tensor_parallel_size, c.pipeline_parallel_size) == ("some/model", 2, 3)
    assert c.data_parallel_size == 4
    assert parse("some/model").model == "some/model"
    assert parse("some/model", "--model", "some/model").model == "some/model"
    with pytest.raises(ValueError, match="given both"):
        parse("a/b", "--model", "c/d")


def test_accepted_spellings_map_onto_ours():
    c = parse("--structured-outputs-config", '{"backend": "xgrammar"}', "--enable-chunked-prefill",
              "--swap-space", "0", "--max-logprobs", "3")  # fmt: skip
    assert c.structured_outputs_backend == "xgrammar" and c.max_logprobs == 3
    assert parse("--structured-outputs-config", '{"backend": "auto"}').structured_outputs_backend


def test_served_model_names():
    from paged.config import EngineConfig

    assert parse("m", "--served-model-name", "a", "b").served_model_name == ["a", "b"]
    with pytest.raises(ValueError, match="served_model_name: 'a' is given more than once"):
        parse("m", "--served-model-name", "a", "b", "a")
    assert parse("m").served_model_name is None
    assert EngineConfig(model="m", served_model_name="x").served_model_name == ["x"]  # LLM()
    with pytest.raises(ValueError, match="served_model_name"):
        EngineConfig(model="m", served_model_name=["a", ""])


def test_uvicorn_access_log_flag():
    from paged.cli.main import build_parser
    from paged.server.http_options import uvicorn_options

    def options(*flags: str) -> dict:
        argv = ["serve", "m", *flags]
        return uvicorn_options(build_parser(argv).parse_args(argv))

    assert options()["access_log"] is True
    assert options("--disable-uvicorn-access-log")["access_log"] is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--swap-space", "4"], "no CPU swap space"),
        (["--no-enable-chunked-prefill"], "always splits prompts"),
        (["--max-logprobs", "21"], r"max_logprobs: must be in \[0, 20\]"),
        (["--structured-outputs-config", '{"backend": "outlines"}'], "not supported"),
        (["--structured-outputs-config", '{"disable_fallback": true}'], "disable_fallback"),
        (["--structured-outputs-config", '{"backend": "guidance"}'], "llguidance"),
        (["--generation-config", "/no/such/dir"], "not auto, vllm or a folder"),
        (["--override-generation-config", '{"do_sample": true}'], "do_sample: not a sampling"),
        (["--override-generation-config", '{"top_p": 2}'], "top_p: must be in"),
        (["--trust-remote-code"], "never runs code"),
    ],
)
def test_refused_with_the_reason(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


def test_bad_json_names_the_flag(caplog):
    from paged.cli.main import main

    assert main(["serve", "--override-generation-config", "{not json"]) == 2
    assert "invalid configuration: override_generation_config: invalid JSON" in caplog.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "give both"),
        (["--ssl-keyfile", "/nope/k", "--ssl-certfile", "/nope/c"], "no such file"),
        (["--root-path", "api"], "must start with /"),
        (["--log-stats-interval", "0"], "log_stats_interval"),
        (["--otlp-traces-endpoint", "localhost:4317"], None),  # installed here: accepted
    ],
)
def test_server_flags_checked_before_start(flags, message):
    from paged.cli.main import build_parser
    from paged.server.http_options import check_http_args
    from paged.server.request_log import check_log_args

    argv = ["serve", *flags]
    args = build_parser(argv).parse_args(argv)
    if message is None:
        check_http_args(args)
        check_log_args(args)
        return
    with pytest.raises(ValueError, match=message):
        check_http_args(args)
        check_log_args(args)


def test_otlp_without_the_exporter_is_refused(monkeypatch):
    """Without opentelemetry installed, --otlp-traces-endpoint names the extra to install."""
    from paged.server.tracing import RequestTracer

    for mod in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'paged\[otel\]'"):
        RequestTracer("m", "localhost:4317")


# ---- the generation config ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("flags") / "model"
    make_tool_model(str(d))
    (d / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return d


def test_generation_defaults(model_dir, tmp_path):
    from paged.engine.generation_config import generation_defaults

    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.05,
            "max_tokens": 5}  # fmt: skip
    assert generation_defaults("auto", str(model_dir)) == want
    assert generation_defaults("vllm", str(model_dir)) == {}
    assert generation_defaults("vllm", str(model_dir), {"min_p": 0.1}) == {"min_p": 0.1}
    assert generation_defaults("auto", str(model_dir), {"top_k": 3})["top_k"] == 3
    other = tmp_path / "gc"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2}')
    assert generation_defaults(str(other), str(model_dir)) == {"temperature": 0.2}
    assert generation_defaults("auto", str(tmp_path)) == {}  # none: no defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path), str(model_dir))


def test_offline_llm_applies_the_model_defaults(model_dir):
    """LLM.generate without sampling_params samples with the model's defaults (vLLM's
    get_default_sampling_params); --generation-config vllm gives SamplingParams()."""
    from paged import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory="8MiB")
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 7, 1.05)
    assert p.max_tokens == 5
    out = llm.generate([[5, 6, 7]])[0].outputs[0]
    assert len(out.token_ids) <= 5
    plain = LLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                generation_config="vllm")  # fmt: skip
    assert plain.get_default_sampling_params() == SamplingParams()


def test_run_batch_applies_the_model_defaults(model_dir, tmp_path):
    """paged run-batch: a chat line without max_tokens stops at the model's max_new_tokens."""
    from paged.cli.main import main

    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    flags = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--dtype", "float32"]
    assert main(["run-batch", "-i", str(src), "-o", str(dst), str(model_dir), *flags]) == 0
    usage = json.loads(dst.read_text())["response"]["body"]["usage"]
    assert usage["completion_tokens"] == 5  # ignore_eos: exactly the model's max_new_tokens


# ---- one live server with the HTTP flags -----------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(model_dir, tmp_path_factory):
    """(base URL with the root path, client trusting the certificate, log file)."""
    h = server_helpers()
    tmp = tmp_path_factory.mktemp("tls")
    key, cert = self_signed(tmp)
    port, log = h.free_port(), tmp / "server.log"
    args = [
        "--model", str(model_dir), *MODEL_ARGS, "--port", str(port), "--api-key", KEY,
        "--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/api",
        "--allowed-origins", json.dumps([ORIGIN]), "--allow-credentials",
        "--max-logprobs", "2", "--override-generation-config", '{"top_k": 9}',
        "--log-level", "info", "--uvicorn-log-level", "warning", "--log-requests-content",
        "--disable-log-stats", "-tp", "1", "--enable-chunked-prefill", "--swap-space", "0",
        "--structured-outputs-config", '{"backend": "xgrammar"}',
        "--served-model-name", "tiny-qwen", "tiny-alias",  # (after MODEL_ARGS': the last wins)
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "paged.server", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    srv = h.Server(f"https://127.0.0.1:{port}", proc, log)
    trust = ssl.create_default_context(cafile=cert)
    client = httpx.Client(base_url=srv.url, verify=trust, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            h.stop_server(srv)
            pytest.fail(f"not ready in 240 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)
    yield srv, client, log
    client.close()
    assert h.stop_server(srv) == 0


def test_tls_only(tls_server):
    srv, client, _ = tls_server
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-qwen"
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(srv.url.replace("https", "http") + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError):  # an untrusted certificate
        httpx.get(srv.url + "/health", timeout=10)


def test_every_served_name_answers_and_is_reported(tls_server):
    """As vLLM: a response reports the name its request used, the first when it names none."""
    _, client, _ = tls_server
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-qwen", "tiny-alias"]
    assert client.get("/v1/models/tiny-alias").json()["id"] == "tiny-alias"
    body = {"model": "tiny-alias", "prompt": "hi", "max_tokens": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == "tiny-alias"
    r = client.post("/v1/completions", json={**body, "model": None})
    assert r.status_code == 200 and r.json()["model"] == "tiny-qwen"
    r = client.post("/v1/completions", json={**body, "model": "tiny"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_root_path(tls_server):
    """Behind a proxy that strips /api: routes answer at their own paths, the API key guard
    still knows the open ones, and the OpenAPI document names the prefix."""
    _, client, _ = tls_server
    assert client.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
    bare = client.get("/health", headers={"Authorization": ""})
    assert bare.status_code == 200  # open without the key, as without --root-path
    assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401


def test_cors(tls_server):
    _, client, _ = tls_server
    pre = client.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
            "Authorization": "",
        },
    )
    assert pre.status_code == 200  # preflight: no API key needed  # fmt: skip
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert pre.headers["access-control-allow-credentials"] == "true"
    r = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    denied = client.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": ""})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = client.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_max_logprobs(tls_server):
    _, client, _ = tls_server
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    ok = client.post("/v1/completions", json={**body, "logprobs": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2
    r = client.post("/v1/completions", json={**body, "logprobs": 3})
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 5}  # fmt: skip
    assert client.post("/v1/chat/completions", json=chat).status_code == 400


def request_line(log: Path, marker: str) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [ln for ln in log.read_text().splitlines() if marker in ln and "request " in ln]
        if lines:
            return lines[-1]
        time.sleep(0.1)
    raise AssertionError(f"no request log line with {marker!r}:\n{log.read_text()[-3000:]}")


def test_generation_config_defaults_reach_the_engine(tls_server):
    """The model's generation_config.json (with --override-generation-config's top_k) fills
    what a request leaves unset, as the request log's resolved params show; max_new_tokens
    caps an unset max_tokens (chat; /v1/completions' default is 16, as OpenAI's and vLLM's);
    what the request sets is its own."""
    _, client, log = tls_server
    chat = {"messages": [{"role": "user", "content": "defaults please"}]}
    r = client.post("/v1/chat/completions", json=chat).json()
    assert r["usage"]["completion_tokens"] <= 5
    line = request_line(log, "defaults please")
    for part in ("'temperature': 0.6", "'top_p': 0.9", "'top_k': 9", "'max_tokens': 5",
                 "'repetition_penalty': 1.05"):  # fmt: skip
        assert part in line, line
    body = {"prompt": "my own please", "temperature": 0, "top_k": -1, "max_tokens": 8}
    client.post("/v1/completions", json=body)
    line = request_line(log, "my own please")
    assert "'temperature': 0" in line and "'top_k': -1" in line and "'top_p': 0.9" in line
    assert "'max_tokens': 8" in line
