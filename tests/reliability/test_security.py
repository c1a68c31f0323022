"""Security knobs: the API key on every route, /metrics behind it on request, loopback by
default, the body limit, sandboxed chat templates, no code from model directories, and no
paths or stack traces in errors."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from reliability_helpers import API_KEY, AUTH, TINY_ARGS, check_error, start_server, stop_server

KEY = "s3cret-security-key"
ESCAPES = [  # classic Jinja sandbox escapes; each tries to create the marker file
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ (messages | attr('__class__')).__subclasses__() }}",
    "{{ 'x'.format.__self__ }}{{ messages[0].content.__class__ }}",
    "{{ messages[0].update({'content': 'mutated'}) }}{{ messages[0].content }}",
]
LEAKS = ("<class", "<function", "<module", "<built-in", "__", "mutated")


def evil_model(tiny_model: str, root: Path, marker: Path, model_type: str = "llama") -> str:
    """A copy of the tiny model whose config and tokenizer point at custom code (auto_map)
    that would create `marker` if it ever ran."""
    d = root / f"evil-{model_type}"
    shutil.copytree(tiny_model, d)
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('code ran')\n"
    for mod in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (d / f"{mod}.py").write_text(code + "class Evil: pass\n")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.Evil",
                       "AutoModelForCausalLM": "modeling_evil.Evil"}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.Evil", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return str(d)


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sec") / "pwned"


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory, marker):
    root = tmp_path_factory.mktemp("sec-server")
    model = evil_model(tiny_model, root, marker)
    template = root / "template.jinja"
    template.write_text(ESCAPES[0].replace("MARKER", str(marker)))
    args = [model, *TINY_ARGS, "--api-key", KEY, "--metrics-require-key",
            "--chat-template", str(template), "--max-request-body", "64KiB"]  # fmt: skip
    s = start_server(args, root / "server.log")
    yield s
    stop_server(s)


def test_api_key_guards_every_route(srv, tiny_server):
    ok = {"Authorization": f"Bearer {KEY}"}
    spec = httpx.get(srv.url + "/openapi.json", headers=ok).json()
    routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
    assert {p for _, p in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    bad_headers = [{}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY},
                   {"Authorization": f"Bearer {KEY[:-1]}"}, {"X-Api-Key": KEY[:-1]}]  # fmt: skip
    for method, path in routes:
        if path in ("/health", "/ping", "/version", "/metrics"):
            continue
        for h in bad_headers:
            r = httpx.request(method, srv.url + path, headers=h, json={})
            if path.startswith("/v1/messages"):  # Anthropic's error shape there
                assert r.status_code == 401, (method, path, h)
                assert r.json()["error"]["type"] == "authentication_error", (method, path, h)
                continue
            assert check_error(r, 401)["code"] == "invalid_api_key", (method, path, h)
    for path in ("/openapi.json", "/docs"):
        check_error(httpx.get(srv.url + path), 401)
    for path in ("/health", "/ping", "/version"):  # open, for probes
        assert httpx.get(srv.url + path).status_code == 200
    check_error(httpx.get(srv.url + "/metrics"), 401)  # --metrics-require-key
    assert httpx.get(srv.url + "/metrics", headers=ok).status_code == 200
    # PAGED_API_KEY (the tiny server's) guards /v1 the same; /metrics open by default
    check_error(httpx.get(tiny_server.url + "/v1/models"), 401)
    assert httpx.get(tiny_server.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(tiny_server.url + "/metrics").status_code == 200
    assert API_KEY not in httpx.get(tiny_server.url + "/metrics").text


def test_key_compare_is_constant_time():
    from paged.server.app import Guard

    src = inspect.getsource(Guard)
    assert "secrets.compare_digest(" in src and "== self.expect" not in src


def test_default_bind_is_loopback(srv):
    from paged.server.api import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).host == "127.0.0.1"
    port = int(srv.url.rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1 only, no IPv6 any-address


def test_body_limit(srv):
    ok = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(srv.url + "/v1/completions", headers=ok, json={"prompt": "a" * 70_000})
    assert check_error(r, 413)["param"] == "body"
    r = httpx.post(srv.url + "/tokenize", headers=ok, json={"prompt": "a " * 1000})
    assert r.status_code == 200


def test_malicious_chat_template_flag_is_sandboxed(srv, marker):
    ok = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(srv.url + "/v1/chat/completions", headers=ok, json=body)
    e = check_error(r, 400)  # the sandbox refuses; the server keeps serving
    assert e["param"] == "messages" and "unsafe" in e["message"], e
    assert not marker.exists()
    r = httpx.post(srv.url + "/v1/completions", headers=ok, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("template", ESCAPES)
def test_chat_template_sandbox(tiny_model, tmp_path, template):
    from paged.model.loader import load_tokenizer, resolve_model
    from paged.server.errors import APIError
    from paged.server.protocol import ChatMessage
    from paged.server.serving import Serving

    marker = tmp_path / "pwned"
    tok = load_tokenizer(resolve_model(tiny_model))
    engine = SimpleNamespace(tokenizer=tok, info={"max_model_len": 256})
    sv = Serving(engine, "tiny", template.replace("MARKER", str(marker)))  # type: ignore[arg-type]
    try:
        text, _ = asyncio.run(sv.render_chat([ChatMessage(role="user", content="hi")]))
    except APIError as e:
        assert e.status == 400 and e.param == "messages"
    else:
        assert not any(s in text for s in LEAKS), text[:300]
    assert not marker.exists()


def test_request_cannot_bring_its_own_template(tiny_http):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = tiny_http.post("/v1/chat/completions", json=base).json()["usage"]["prompt_tokens"]
    evil = "{{ 'word ' * 50 }}"  # a template, as the request's own or smuggled in the kwargs
    for field in ({"chat_template": evil}, {"chat_template_kwargs": {"chat_template": evil}}):
        r = tiny_http.post("/v1/chat/completions", json=base | field)
        assert check_error(r, 400)["param"] == next(iter(field))  # refused, never applied
    r = tiny_http.post("/v1/chat/completions", json=base)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == plain


def test_no_remote_code_from_model_dirs(srv, tiny_model, tmp_path, marker):
    from paged.model.loader import ModelLoadError, load_config, load_tokenizer, resolve_model

    assert srv.proc.poll() is None  # the server started on a dir with auto_map ...
    assert not marker.exists()  # ... and ran none of its code
    own = tmp_path / "pwned"
    src = resolve_model(evil_model(tiny_model, tmp_path, own, model_type="evil"))
    with pytest.raises(ModelLoadError, match="evil"):
        load_config(src)  # a custom model type needs its code: refused
    load_tokenizer(src)  # a known tokenizer class: the auto_map is ignored
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    shutil.copy(Path(tiny_model, "config.json"), pickles)
    (pickles / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle"):
        resolve_model(str(pickles))
    assert not own.exists()


def test_errors_never_leak_paths_or_traces(srv):
    ok = {"Authorization": f"Bearer {KEY}"}
    url = srv.url
    responses = [
        httpx.get(url + "/v1/nothing", headers=ok),
        httpx.get(url + "/v1/completions", headers=ok),
        httpx.post(url + "/v1/completions", headers=ok, json={"prompt": [10**9]}),
        httpx.post(
            url + "/v1/completions",
            headers=ok | {"content-type": "application/json"},
            content=b"{",
            params={"x": "/etc"},
        ),  # fmt: skip
        httpx.post(
            url + "/v1/completions",
            headers=ok | {"content-type": "text/x-path"},
            content=b"/etc/passwd",
        ),  # fmt: skip
        httpx.post(url + "/v1/chat/completions", headers=ok, json={"messages": [{"role": "x"}]}),
        httpx.post(url + "/v1/completions", headers=ok, json={"prompt": "hi", "model": "m"}),
    ]
    for r in responses:
        check_error(r, (400, 404, 405, 415))  # check_error asserts no path and no traceback
