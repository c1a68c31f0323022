"""Shared fixtures: tiny random HF models saved locally, the default GGUF model."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under xdist (make test: two workers) every worker and every server it starts would take a
# thread per core: oversubscribed cores and spinning OpenMP threads ran the suite about twice
# as slow. Each worker, with what it starts, gets an even share of the cores instead.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (_cores or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402
from server_helpers import server_helpers  # noqa: E402
from tiny_hf import make_tiny  # noqa: E402

if _WORKERS > 1:  # torch may have started before the variable was set
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The browser tests first: the longest module and the last by name, so that under
    `--dist loadfile` the other worker is not left idle while they run alone at the end."""
    ui = Path(__file__).parent / "ui"
    items.sort(key=lambda item: not item.path.is_relative_to(ui))  # stable: else as collected


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: make_tiny(k, str(root / k)) for k in ("llama", "qwen2", "mistral")}


@pytest.fixture
def engines_on(monkeypatch):
    """`engines_on(platform)`: the engines the test builds from then on run on `platform` (the
    engine and its worker each look theirs up through `select_platform`)."""

    def use(platform) -> None:
        for where in ("paged.engine.core", "paged.worker.worker"):
            monkeypatch.setattr(f"{where}.select_platform", lambda name=None: platform)

    return use


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A live `python -m paged.server` on the default model (ENGINE_ARGS of
    tests/server/conftest.py, an API key), once per worker for every module that needs no
    flags of its own."""
    h = server_helpers()
    log = tmp_path_factory.mktemp("server") / "server.log"
    # At most two stored responses: test_responses checks the bound on this server.
    args = [*h.ENGINE_ARGS, "--max-stored-responses", "2"]
    srv = h.start_server(args, log, {"PAGED_API_KEY": h.API_KEY})
    yield srv
    h.stop_server(srv)


@pytest.fixture(scope="session")
def http(server):
    """httpx on `server`, with its API key."""
    import httpx

    headers = {"Authorization": f"Bearer {server_helpers().API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def client(server):
    """The OpenAI SDK on `server`, with its API key."""
    import openai

    key = server_helpers().API_KEY
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


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
def hf_gguf_reference(default_model_path):
    """transformers' view of the default GGUF: AutoConfig, and the weights as from_pretrained
    gets them (its load_gguf_checkpoint loop: gguf's dequantize and llama.cpp name table,
    transformers' q/k un-permutation), minus its slow per-module name-map rebuild (~15 s)."""
    import gguf
    import numpy as np
    import transformers as tf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    d, f = os.path.split(default_model_path)
    config = tf.AutoConfig.from_pretrained(d, gguf_file=f)
    with torch.device("meta"):
        names = [n for n, _ in tf.AutoModelForCausalLM.from_config(config).named_parameters()]
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    to_hf = {f"{table.get_name(n.rsplit('.', 1)[0])}.{n.rsplit('.', 1)[1]}": n for n in names}
    processor = TENSOR_PROCESSORS["llama"](config=config.to_dict())
    weights = {}
    for t in gguf.GGUFReader(default_model_path).tensors:
        w = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=t.name)
        weights[to_hf[t.name]] = torch.from_numpy(np.array(w.weights, dtype=np.float32))
    return config, weights


@pytest.fixture(scope="session")
def hf_smollm(hf_gguf_reference):
    """HF transformers' model of the default GGUF, float32: its class from the file's config,
    holding the weights from_pretrained(gguf_file=...) would load (hf_gguf_reference; the
    same weights, without from_pretrained's slow GGUF path: 12 s there, 1 s here)."""
    from transformers import AutoModelForCausalLM

    config, weights = hf_gguf_reference
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and missing == ["lm_head.weight"], (missing, unexpected)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the file
    return model.eval()


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
