"""CLI test fixtures: a tiny random Llama with its own tiny tokenizer, and a live server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_hf import TINY

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today? I am fine, thank you.",
    "paged attention keeps the key value cache in fixed size blocks",
]


def save_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE trained offline on a few sentences; <s>=0, </s>=1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= vocab_size
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer random Llama (vocab 320) with a tokenizer and chat template, saved locally."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("cli") / "tiny-llama")
    cfg = LlamaConfig(**TINY, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, cfg.vocab_size)
    return path


def paged_cmd() -> list[str]:
    """The installed console script, else the module."""
    script = Path(sys.executable).with_name("paged")
    return [str(script)] if script.exists() else [sys.executable, "-m", "paged.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_url(tiny_llama, tmp_path_factory):
    """`paged serve` on the tiny model in a subprocess; yields its /v1 base URL."""
    import httpx

    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    cmd = [
        *paged_cmd(),
        "serve",
        tiny_llama,
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"paged serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"paged serve not ready in 120 s:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def paged_exe() -> list[str]:
    return paged_cmd()


@pytest.fixture
def cli(capsys):
    """Run `paged ARGS...` in this process; returns (exit code, stdout, stderr)."""
    from paged.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run
