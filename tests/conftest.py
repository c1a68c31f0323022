"""Shared fixtures: tiny random HF models saved locally, the default GGUF model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_hf import make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: make_tiny(k, str(root / k)) for k in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from paged.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm(default_model_path):
    """The default model in float32 through paged (shared by tests; do not mutate)."""
    from paged import LLM

    return LLM(default_model_path, dtype="float32", max_model_len=1024, kv_cache_memory="64MiB")


@pytest.fixture(scope="session")
def hf_smollm(default_model_path):
    """HF transformers' own GGUF load of the default model, float32."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def oot_plugin_site(tmp_path_factory) -> str:
    """examples/oot-plugin installed as a vendor would ship it (pip --target), once per
    session: the directory to put on PYTHONPATH."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("oot")
    src = tmp / "src"  # build from a copy: setuptools writes build/ and *.egg-info in place
    example = Path(__file__).resolve().parents[1] / "examples" / "oot-plugin"
    shutil.copytree(example, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return str(site)
