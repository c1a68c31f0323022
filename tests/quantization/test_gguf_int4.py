"""A GGUF's Q4_0 / Q4_1 layers kept as 4-bit blocks (paged.quantization.gguf, what the cuda
plugin's prepare_model does), on CPU: greedy output token-identical to the dense load of the
same file in float32, through the torch reference and through the Triton int4 kernels
(interpreted)."""

from __future__ import annotations

import pytest
from quant_ckpt import write_q4_gguf

from paged import LLM, SamplingParams
from paged.quantization import QuantLinear
from paged_cpu.platform import CpuPlatform


class GgufInt4OnCpu(CpuPlatform):
    name = "gguf-int4-on-cpu"
    triton = False

    def prepare_model(self, model, config, source=None) -> None:
        from paged.quantization.gguf import use_gguf_int4

        self.replaced = use_gguf_int4(model, source, model.config)

    def ops(self):
        if not self.triton:
            return super().ops()
        from paged.kernels.ops import triton_fused_ops

        return {"int4_linear": triton_fused_ops()["int4_linear"]}


@pytest.fixture(scope="module")
def q4_gguf(tiny_models, tmp_path_factory) -> str:
    return write_q4_gguf(tiny_models["llama"], str(tmp_path_factory.mktemp("gguf") / "t.gguf"))


@pytest.mark.parametrize("triton", [False, True])
def test_gguf_q4_layers_stay_4_bit(q4_gguf, tmp_path, monkeypatch, triton):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    kw = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32)
    prompt = list(range(5, 60, 4))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    dense = LLM(q4_gguf, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    platform = GgufInt4OnCpu()
    platform.triton = triton
    for where in ("paged.engine.core", "paged.worker.worker"):
        monkeypatch.setattr(f"{where}.select_platform", lambda name=None: platform)
    llm = LLM(q4_gguf, **kw)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert platform.replaced == len(layers) == 8  # qkv (Q4_0), o, gate_up (Q4_1), down x 2
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == dense
