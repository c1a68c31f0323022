"""LoRA through the OpenAI server: the `model` field picks the adapter, /v1/models lists
them, /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time; more
adapters than slots still complete; no KV block is left held."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

N = 8
PROMPTS = {"alpha": [7, 21, 99, 4, 250, 31], "beta": [15, 2, 88, 140, 9], None: [61, 3, 77, 200]}


SPECIAL = {"<s>": 0, "</s>": 1}


def with_tokenizer(model: str, out: Path) -> str:
    """A copy of the tiny model with a word-level tokenizer: token i is "t{i}" (the server
    needs one; prompts are sent as ids and read back through the logprobs' token strings)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model, out)
    vocab = {**SPECIAL, **{f"t{i}": i for i in range(2, 320)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(lora_model, adapters, tmp_path_factory):
    lora_model = with_tokenizer(lora_model, tmp_path_factory.mktemp("lora_srv") / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    args = [sys.executable, "-m", "paged.server", lora_model, "--port", str(port),
            "--log-level", "warning", "--served-model-name", "base", "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--enable-lora", "--max-loras", "1",
            "--max-lora-rank", "8", "--lora-modules",
            json.dumps({"name": "alpha", "path": adapters["alpha"]})]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server was not ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


def body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip


def load_body(name: str, adapters: dict[str, str]) -> dict:
    return {"lora_name": name, "lora_path": adapters[name]}


def complete(http, model: str, prompt: list[int]) -> httpx.Response:
    return http.post("/v1/completions", json=body(model, prompt))


def token_ids(resp: httpx.Response) -> list[int]:
    """The completion's token ids, from the logprobs' token strings ("t{id}")."""
    assert resp.status_code == 200, resp.text
    toks = resp.json()["choices"][0]["logprobs"]["tokens"]
    return [SPECIAL[t] if t in SPECIAL else int(t.removeprefix("t")) for t in toks]


def test_models_lists_adapters(http):
    data = http.get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"base", "alpha"}
    assert by_id["alpha"]["parent"] == "base" and by_id["base"]["parent"] is None
    for name, card in by_id.items():  # GET /v1/models/{id}: the same entry, adapters too
        assert http.get(f"/v1/models/{name}").json() == card, name
    assert http.get("/v1/models/gamma").json()["error"]["code"] == "model_not_found"


def test_model_field_selects_adapter(http, hf_models, hf_greedy):
    for name in ("alpha", None):
        r = complete(http, name or "base", PROMPTS[name])
        assert r.json()["model"] == (name or "base")  # the adapter's name, as vLLM
        assert token_ids(r) == hf_greedy(hf_models[name], PROMPTS[name], N), name


def test_unknown_model_is_404(http):
    r = complete(http, "gamma", [1, 2, 3])
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and "gamma" in r.json()["error"]["message"]


def test_load_use_unload(http, adapters, hf_models, hf_greedy, tmp_path):
    r = http.post("/v1/load_lora_adapter", json=load_body("beta", adapters))
    assert r.status_code == 200, r.text
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"base", "alpha", "beta"}
    assert token_ids(complete(http, "beta", PROMPTS["beta"])) == hf_greedy(
        hf_models["beta"], PROMPTS["beta"], N
    )
    # refused: a name in use, a path that is no adapter, an unsupported adapter, bad fields
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": "/x"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    missing = {"lora_name": "m", "lora_path": str(tmp_path / "none")}
    r = http.post("/v1/load_lora_adapter", json=missing)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    dora = tmp_path / "dora"
    dora.mkdir()
    src = json.loads((Path(adapters["alpha"]) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**src, "use_dora": True}))
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(dora)})
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.text
    # unload: the name is gone from the models and from requests
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert r.status_code == 200, r.text
    assert complete(http, "beta", [1, 2]).status_code == 404
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_more_adapters_than_slots_complete(server, http, adapters, hf_models, hf_greedy):
    """One slot, three models at once (alpha, beta, base): they take turns, all match HF."""
    r = http.post("/v1/load_lora_adapter", json=load_body("beta", adapters))
    assert r.status_code == 200, r.text

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            names = ["alpha", "beta", None, "beta", "alpha"]
            bodies = [body(n or "base", PROMPTS[n]) for n in names]
            resps = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
            return list(zip(names, resps))

    for name, resp in asyncio.run(run()):
        assert token_ids(resp) == hf_greedy(hf_models[name], PROMPTS[name], N), name
    # every KV block is back (running requests hold none) and the engine is healthy
    metrics = http.get("/metrics").text
    usage = re.search(r"^paged:kv_cache_usage_perc\{[^}]*\} (\S+)$", metrics, re.M)
    assert usage is not None and float(usage.group(1)) == 0.0
    assert http.get("/health").status_code == 200


def reshaped(src: str, out: Path, key: str, grow: int) -> str:
    """A copy of the adapter at `src` whose tensors named `...{key}` have `grow` more columns
    (lora_A: more input features) or rows (lora_B: more output features)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    (out / "adapter_config.json").write_text((Path(src) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(src) / "adapter_model.safetensors"))
    for k, t in tensors.items():
        if k.endswith(key):
            pad = (0, grow) if ".lora_A." in k else (0, 0, 0, grow)
            tensors[k] = torch.nn.functional.pad(t, pad)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return str(out)


def test_an_adapter_for_another_model(http, adapters, tmp_path):
    """Another hidden size is refused on load (naming lora_path); another intermediate size
    only shows against the model's projections, on the first request: a 400 naming model."""
    wide = reshaped(adapters["alpha"], tmp_path / "wide", "q_proj.lora_A.weight", 8)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": wide})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "hidden size" in r.json()["error"]["message"]
    assert "wide" not in {m["id"] for m in http.get("/v1/models").json()["data"]}
    mlp = reshaped(adapters["alpha"], tmp_path / "mlp", "down_proj.lora_A.weight", 8)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": mlp})
    assert r.status_code == 200, r.text
    r = complete(http, "mlp", [1, 2, 3])
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "down_proj" in r.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert http.get("/health").status_code == 200
