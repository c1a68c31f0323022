"""A GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K layers kept as 4- and 8-bit blocks
(paged.quantization.gguf, what the cuda plugin's prepare_model does), on CPU: greedy output
token-identical to the dense load of the same file in float32, through the torch reference
and through the Triton int4 kernels (interpreted)."""

from __future__ import annotations

import pytest
from quant_ckpt import write_k_gguf, write_q4_gguf

from paged import LLM, SamplingParams
from paged.quantization import QuantLinear
from paged_cpu.linear import gguf_blocks_available

# The C++ kernels load once a process, from $PAGED_CACHE_DIR as it is before tests move it
CPU_BLOCKS = gguf_blocks_available()


def _platform(triton: bool):
    from paged_cpu.platform import CpuPlatform

    class GgufBlocksOnCpu(CpuPlatform):
        name = "gguf-blocks-on-cpu"

        def prepare_model(self, model, config, source=None) -> None:
            from paged.quantization.gguf import use_gguf_blocks

            self.replaced = use_gguf_blocks(model, source, model.config)

        def ops(self):
            if not triton:
                return super().ops()
            from paged.kernels.ops import triton_fused_ops

            table = triton_fused_ops()
            return {k: table[k] for k in ("int4_linear", "int8_linear")}

    return GgufBlocksOnCpu()


@pytest.fixture(scope="module", params=["q4", "q8", "k"])
def gguf_file(request, tiny_models, tmp_path_factory) -> tuple[str, str]:
    out = str(tmp_path_factory.mktemp("gguf") / "t.gguf")
    if request.param == "k":
        return "k", write_k_gguf(out)
    return request.param, write_q4_gguf(tiny_models["llama"], out, q8=request.param == "q8")


@pytest.mark.parametrize("triton", [False, True])
def test_gguf_block_layers_stay_quantized(gguf_file, tmp_path, monkeypatch, engines_on, triton):
    import os

    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU platform's Triton ops run interpreted (TRITON_INTERPRET=1)")
    kind, path = gguf_file
    if triton and kind == "k":  # (44 s interpreted at hidden 256)
        pytest.skip("K-quants change only the load: the q4 / q8 files run these kernels")
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    kw = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32)
    prompt = list(range(5, 60, 4))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    dense = LLM(path, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    platform = _platform(triton)
    engines_on(platform)
    llm = LLM(path, **kw)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert platform.replaced == len(layers) == 8  # qkv, o, gate_up, down x 2
    got = {(m.method.bits, hasattr(m, "mins"), int(m.zeros.max())) for m in layers}
    if kind == "q4":  # Q4_0 attention: (code - 8) * d; Q4_1 MLP: code * d + m
        assert got == {(4, False, 8), (4, True, 0)}
    elif kind == "q8":  # Q8_0 attention: (code - 128) * d; gate (Q8_0) / up (Q4_1): 8-bit codes
        assert got == {(8, False, 128), (8, True, 0), (4, True, 0)}  # with mins
    else:  # Q4_K: d sc code - dmin mn per sub-block of 32; Q5_K gate/up: 5-bit codes in 8 bits
        assert got == {(4, True, 0), (8, True, 0)}
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == dense


def test_on_the_gpu_blocks_match_the_dense_load(gguf_file):
    """The cuda platform's own path (what `paged serve x.gguf` runs on a GPU): its blocks kept
    4- / 8-bit through the Triton kernels, the split-K GEMV where start-up timing takes it,
    against --no-cuda-gguf-blocks. Runs where a GPU is (TRITON_INTERPRET=0)."""
    import os

    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and TRITON_INTERPRET=0")
    kind, path = gguf_file
    kw = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    prompts = [list(range(5, 60, 4)), list(range(7, 300, 3))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = {}
    for blocks in (False, True):
        llm = LLM(path, cuda_gguf_blocks=blocks, **kw)
        n = sum(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
        assert n == (8 if blocks else 0)
        got[blocks] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]  # fmt: skip
        del llm
    assert got[True] == got[False]


def test_cpu_computes_k_quants_from_their_blocks(gguf_file, tmp_path, monkeypatch):
    """The CPU plugin's own path (--cpu-gguf-blocks: bf16, 8-bit activations) on the Q4_K /
    Q5_K file: every projection computes from the file's blocks (float32 sub-block scales),
    and the prompt's log-probabilities move from the float32 load's about as much as the
    dense bf16 load's do."""
    from paged_cpu.linear import GgufBlockLinear

    kind, path = gguf_file
    if kind != "k" or not CPU_BLOCKS:
        pytest.skip("the K-quant file, with the C++ kernels and AVX-512 VNNI/BF16")
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    prompt = list(range(5, 60, 4))
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    kw = dict(kv_cache_memory="16MiB", max_num_batched_tokens=32)
    runs = {"float32": {"dtype": "float32"}, "blocks": {"dtype": "bfloat16"},
            "bf16": {"dtype": "bfloat16", "cpu_gguf_blocks": False}}  # fmt: skip
    logprobs = {}
    for run, extra in runs.items():
        llm = LLM(path, **kw, **extra)
        n = sum(isinstance(m, GgufBlockLinear) for m in llm.engine.runner.model.modules())
        assert n == (8 if run == "blocks" else 0)  # qkv, o, gate_up, down x 2
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        logprobs[run] = [e[t].logprob for t, e in zip(prompt[1:], out[0].prompt_logprobs[1:])]
        llm.engine.shutdown()

    def drift(run: str) -> float:
        return sum(abs(a - b) for a, b in zip(logprobs[run], logprobs["float32"])) / len(prompt)

    assert drift("blocks") <= 3 * drift("bf16") + 0.02, (drift("blocks"), drift("bf16"))
