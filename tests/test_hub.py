"""Hub ids through a fake huggingface_hub cache (offline): resolution, revisions, GGUF repos,
the offline-missing error, the download path, and `paged serve org/name` end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from paged.model.loader import ModelLoadError, resolve_model

MAIN, V1 = "a" * 40, "b" * 40  # commit hashes of the two snapshots


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids (<s>=0, </s>=1), enough to serve text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_models, default_model_path) -> Path:
    """A cache as huggingface_hub lays it out: org/tiny (main; branch v1: another model),
    org/bare (config only), org/smol-GGUF (two GGUF files)."""
    root = tmp_path_factory.mktemp("hf-cache")
    repo = root / "models--org--tiny"
    for rev, src in ((MAIN, tiny_models["llama"]), (V1, tiny_models["qwen2"])):
        shutil.copytree(src, repo / "snapshots" / rev)
        save_word_tokenizer(repo / "snapshots" / rev, 320)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    bare = root / "models--org--bare"
    (bare / "snapshots" / MAIN).mkdir(parents=True)
    shutil.copy(Path(tiny_models["llama"], "config.json"), bare / "snapshots" / MAIN)
    (bare / "refs").mkdir()
    (bare / "refs" / "main").write_text(MAIN)
    gguf = root / "models--org--smol-GGUF"
    (gguf / "snapshots" / MAIN).mkdir(parents=True)
    for name in ("smol-Q4_1.gguf", "smol-Q8_0.gguf"):  # links, as the cache's blobs are
        os.symlink(default_model_path, gguf / "snapshots" / MAIN / name)
    (gguf / "refs").mkdir()
    (gguf / "refs" / "main").write_text(MAIN)
    return root


@pytest.fixture
def offline(hub, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_resolves_revisions_from_the_cache(offline):
    src = resolve_model("org/tiny")
    assert (src.kind, src.name) == ("hf", "org/tiny")
    assert src.path == str(offline / "models--org--tiny" / "snapshots" / MAIN)
    for rev in ("v1", V1):  # a branch, a commit
        assert resolve_model("org/tiny", revision=rev).path.endswith(V1)
    elsewhere = offline.parent / "elsewhere"
    shutil.copytree(offline / "models--org--tiny", elsewhere / "models--org--tiny")
    src = resolve_model("org/tiny", download_dir=str(elsewhere))  # --download-dir: its cache
    assert src.path.startswith(str(elsewhere))


def test_offline_and_missing_names_the_id_and_cache(offline):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("org/missing")
    assert "org/missing" in str(e.value) and str(offline) in str(e.value)
    assert "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(ModelLoadError, match="revision nope"):
        resolve_model("org/tiny", revision="nope")
    with pytest.raises(ModelLoadError, match="incomplete"):  # config but no weights
        resolve_model("org/bare")
    assert resolve_model("org/bare", load_format="dummy").path.endswith(MAIN)
    with pytest.raises(ModelLoadError, match="local path"):
        resolve_model(str(offline / "models--org--tiny" / "snapshots" / MAIN), revision="v1")


def test_gguf_repos(offline):
    snap = offline / "models--org--smol-GGUF" / "snapshots" / MAIN
    src = resolve_model("org/smol-GGUF:Q4_1")
    assert (src.kind, src.path, src.name) == (
        "gguf",
        str(snap / "smol-Q4_1.gguf"),
        "org/smol-GGUF:Q4_1",
    )
    assert resolve_model("org/smol-GGUF:smol-Q8_0.gguf").path == str(snap / "smol-Q8_0.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        resolve_model("org/smol-GGUF")
    with pytest.raises(ModelLoadError, match="no GGUF file matching 'Q5_K_M'"):
        resolve_model("org/smol-GGUF:Q5_K_M")
    with pytest.raises(ModelLoadError, match="load_format safetensors"):
        resolve_model("org/smol-GGUF:Q4_1", load_format="safetensors")


def test_online_downloads_only_what_loads(hub, monkeypatch, tmp_path):
    """Not cached and online: the repo's files are listed, then only config, tokenizer and
    safetensors are fetched into --download-dir at the revision asked for."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def list_repo_files(self, repo, revision=None):
        return ["config.json", "model.safetensors", "pytorch_model.bin", "README.md"]

    def snapshot_download(repo, **kw):
        if kw.get("local_files_only"):  # the cache is looked at first: nothing there
            raise LocalEntryNotFoundError("not cached")
        calls.append((repo, kw))
        dest = Path(kw["cache_dir"], "snap")
        shutil.copytree(hub / "models--org--tiny" / "snapshots" / V1, dest)
        return str(dest)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("paged.model.hub.hub_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    src = resolve_model("org/new", revision="v1", download_dir=str(tmp_path))
    assert src.name == "org/new" and src.path == str(tmp_path / "snap")
    [(repo, kw)] = calls
    assert (repo, kw["revision"], kw["cache_dir"]) == ("org/new", "v1", str(tmp_path))
    assert "*.safetensors" in kw["allow_patterns"] and "*.bin" not in kw["allow_patterns"]


def test_trust_remote_code_is_refused():
    from paged.config import EngineConfig

    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineConfig(trust_remote_code=True)


def test_llm_loads_the_revision(offline, tiny_models):
    """LLM("org/tiny", revision="v1") runs v1's weights: token-identical to that directory."""
    from paged import LLM, SamplingParams

    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = [[5, 9, 33, 70]]
    hub_out = LLM("org/tiny", revision="v1", **kw).generate(prompt, params, use_tqdm=False)
    local = str(offline / "models--org--tiny" / "snapshots" / V1)
    ref = LLM(local, **kw).generate(prompt, params, use_tqdm=False)
    assert hub_out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


@pytest.mark.slow  # 16 s, a server start: the offline hub id is resolved above, in process
def test_paged_serve_hub_id_offline(offline, tmp_path):
    """`paged serve org/tiny` in a fresh process, offline, from the fake cache."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_CACHE": str(offline), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "paged.cli.main", "serve", "org/tiny", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB"]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["org/tiny"]
        body = {"model": "org/tiny", "prompt": "w5 w9 w33", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_missing_file_is_not_taken_for_a_hub_id(offline):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("models/missing.gguf")
