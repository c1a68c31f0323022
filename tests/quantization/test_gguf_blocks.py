"""A GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K layers kept as 4- and 8-bit blocks
(paged.quantization.gguf, the cuda plugin's block layers), on CPU: greedy output
token-identical to the dense load of the same file in float32, through the torch reference
and through the Triton int4 kernels (interpreted); Q6_K's blocks decoded as gguf-py does."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_blocks_platform import blocks_platform
from quant_ckpt import write_k_gguf, write_q4_gguf

from paged import LLM, SamplingParams
from paged.quantization import QuantLinear
from paged_cpu.linear import gguf_blocks_available

# The C++ kernels load once a process, from $PAGED_CACHE_DIR as it is before tests move it
CPU_BLOCKS = gguf_blocks_available()


# Both loads of a file in float32: the dense one and the one with block layers.
KW = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32)


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return llm.generate(list(range(5, 60, 4)), params, use_tqdm=False)[0].outputs[0].token_ids


def _platform(triton: bool):
    def kernels() -> dict:
        from paged.kernels.ops import triton_fused_ops

        table = triton_fused_ops()
        return {k: table[k] for k in ("int4_linear", "int8_linear")}

    return blocks_platform(kernels if triton else None)


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
    dense = _greedy(LLM(path, **KW))
    platform = _platform(triton)
    engines_on(platform)
    llm = LLM(path, **KW)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    # qkv, o, gate_up, down x 2 (the K-quant file: and its Q6_K output head)
    assert platform.replaced == len(layers) == (9 if kind == "k" else 8)
    got = {(m.method.bits, hasattr(m, "mins"), int(m.zeros.max())) for m in layers}
    if kind == "q4":  # Q4_0 attention: (code - 8) * d; Q4_1 MLP: code * d + m
        assert got == {(4, False, 8), (4, True, 0)}
    elif kind == "q8":  # Q8_0 attention: (code - 128) * d; gate (Q8_0) / up (Q4_1): 8-bit codes
        assert got == {(8, False, 128), (8, True, 0), (4, True, 0)}  # with mins
    else:  # Q4_K: d sc code - dmin mn per sub-block of 32; Q5_K gate/up: 5-bit codes in 8 bits;
        # Q6_K down and head: (code - 32) d sc per 16; layer 1's qkv (Q4_K q/k, Q6_K v): 8-bit
        # codes with mins in groups of 16
        assert got == {(4, True, 0), (8, True, 0), (8, False, 32)}
        sixteens = {n for n, m in llm.engine.runner.model.named_modules()
                    if isinstance(m, QuantLinear) and m.group_k == 16}  # fmt: skip
        assert sixteens == {"layers.1.self_attn.qkv_proj", "layers.1.mlp.down_proj", "lm_head"}
    assert _greedy(llm) == dense


def test_covered_weights_are_never_dequantized(gguf_file, tmp_path, monkeypatch, engines_on):
    """The engine reads a GGUF's blocks before its dense weights: the weights of the layers
    they cover are not dequantized (nor allocated), and a layer the platform declines (here
    every down_proj) is read dense afterwards; the output stays the dense load's."""
    from torch import nn

    import paged.model.gguf_loader as gguf_loader

    kind, path = gguf_file
    if kind != "q4":
        pytest.skip("the loading order, once")
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    dense = _greedy(LLM(path, **KW))

    read: list[str] = []
    original = gguf_loader.iter_gguf

    def recording(*args, **kwargs):
        for name, tensor in original(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(gguf_loader, "iter_gguf", recording)
    platform = blocks_platform()
    make = platform.gguf_block_layer

    def declining_down(config):
        inner = make(config)
        # down_proj alone maps more inputs to fewer outputs
        return lambda mod, *a: None if mod.in_features > mod.out_features else inner(mod, *a)

    platform.gguf_block_layer = declining_down
    engines_on(platform)
    llm = LLM(path, **KW)
    model = llm.engine.runner.model
    quant = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    kept = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")
    assert quant == {f"layers.{i}.{p}" for i in (0, 1) for p in kept}
    downs = [model.get_submodule(f"layers.{i}.mlp.down_proj") for i in (0, 1)]
    assert all(type(m) is nn.Linear and not m.weight.is_meta for m in downs)
    projections = {n.rsplit(".", 2)[-2] for n in read if n.startswith("model.layers.")}
    assert "down_proj" in projections  # read dense after the platform declined it
    assert not projections & {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}
    assert _greedy(llm) == dense


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
        assert n == ((9 if kind == "k" else 8) if blocks else 0)  # k: the Q6_K head too
        got[blocks] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]  # fmt: skip
        del llm
    assert got[True] == got[False]


def test_cpu_computes_k_quants_from_their_blocks(gguf_file, tmp_path, monkeypatch):
    """The CPU plugin's own path (--cpu-gguf-blocks: bf16, 8-bit activations) on the Q4_K /
    Q5_K / Q6_K file: every projection and the Q6_K head compute from the file's blocks
    (float32 sub-block scales; groups of 16 where a Q6_K piece is), and the prompt's
    log-probabilities move from the float32 load's about as much as the dense bf16 load's
    do."""
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
        model = llm.engine.runner.model
        blocks = {n: m for n, m in model.named_modules() if isinstance(m, GgufBlockLinear)}
        assert len(blocks) == (9 if run == "blocks" else 0)  # qkv, o, gate_up, down x 2, head
        if run == "blocks":  # two (d, m) pairs a block of 32: the Q6_K pieces' groups of 16
            halves = {n for n, m in blocks.items() if m.scales.shape[2] == 4}
            assert halves == {"layers.1.self_attn.qkv_proj", "layers.1.mlp.down_proj", "lm_head"}
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        logprobs[run] = [e[t].logprob for t, e in zip(prompt[1:], out[0].prompt_logprobs[1:])]
        llm.engine.shutdown()

    def drift(run: str) -> float:
        return sum(abs(a - b) for a, b in zip(logprobs[run], logprobs["float32"])) / len(prompt)

    assert drift("blocks") <= 3 * drift("bf16") + 0.02, (drift("blocks"), drift("bf16"))


def _q6_k_weights(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(code - 32) * d per group of 16: gguf-py's float32 arithmetic on the decoded blocks."""
    n = codes.shape[0]
    return ((codes.reshape(n, -1, 16).astype(np.float32) - 32) * d[..., None]).reshape(n, -1)


def test_q6_k_blocks_are_gguf_py_dequantization():
    """Random Q6_K super-blocks (any ql / qh / int8 scale bytes, a sane fp16 d): codes 0..63,
    d = d sc per 16 and m = -32 d, bit for bit gguf-py's weights; one flipped qh bit moves
    one weight's high bits, the same one in both; un-permuted q/k rows stay the dense ones."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from paged.model.gguf_loader import _unpermuted, q6_k_blocks, unpermute

    rng = np.random.default_rng(0)
    n, k = 16, 512
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    d = rng.uniform(1e-5, 1e-2, (n, k // 256, 1)) * rng.choice([-1, 1], (n, k // 256, 1))
    raw[..., 208:] = d.astype(np.float16).view(np.uint8)
    raw[3, 1, 192 + 10] = 100  # a scale not 0 where the check below flips a bit
    codes, scale, low = q6_k_blocks(raw)
    codes = codes.reshape(n, k)
    assert codes.min() == 0 and codes.max() == 63 and scale.shape == low.shape == (n, k // 16)
    assert np.array_equal(low, -32 * scale)
    want = dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q6_K)
    assert np.array_equal(_q6_k_weights(codes, scale).view(np.uint32), want.view(np.uint32))
    heads = {"k_proj": 4}  # a permuted k_proj's rows, blocks and dense alike
    rows = _unpermuted("model.layers.0.self_attn.k_proj.weight", True, heads, codes, scale)
    assert np.array_equal(_q6_k_weights(*rows), unpermute(want, 4))

    bad = raw.copy()
    bad[3, 1, 128 + 32 + 5] ^= 0b0100  # super-block 1's second half: qh byte 5, bit pair 1
    at = [[3, 256 + 128 + 32 + 5]]  # its weight 128 + 32 + 5 (sub-block 10)
    moved = dequantize(bad.reshape(n, -1), GGMLQuantizationType.Q6_K) != want
    assert np.argwhere(moved).tolist() == at
    flipped = q6_k_blocks(bad)[0].reshape(n, k)
    assert np.argwhere(flipped != codes).tolist() == at
    assert flipped[3, at[0][1]] ^ codes[3, at[0][1]] == 0x10  # the code's bit 4: from qh


def test_k_file_blocks_are_its_dense_weights(tmp_path):
    """iter_gguf_blocks on the K-quant file: the Q6_K tensors (attn_v, ffn_down, the head) in
    groups of 16 and bit for bit iter_gguf's weights as (code - 32) * d; the Q4_K / Q5_K ones
    (q/k rows un-permuted) in groups of 32, code * d + m within a rounding."""
    import torch

    from paged.model.gguf_loader import gguf_config, iter_gguf, iter_gguf_blocks

    path = write_k_gguf(str(tmp_path / "k.gguf"))
    config = gguf_config(path)
    dense = dict(iter_gguf(path, config, progress=False))
    groups = {}
    for name, codes, d, m in iter_gguf_blocks(path, config):
        n, k = codes.shape
        groups[name] = group = k // d.shape[1]
        want = dense[name].numpy()
        if group == 16:
            assert np.array_equal(m, -32 * d)
            assert np.array_equal(_q6_k_weights(codes, d).view(np.uint32), want.view(np.uint32))
        w = codes.reshape(n, -1, group) * d[..., None] + m[..., None]
        torch.testing.assert_close(torch.from_numpy(w.reshape(n, k)), dense[name], rtol=0,
                                   atol=1e-6)  # fmt: skip
    sixteens = {name for name, group in groups.items() if group == 16}
    assert sixteens == {"model.layers.1.self_attn.v_proj.weight",
                        "model.layers.1.mlp.down_proj.weight", "lm_head.weight"}  # fmt: skip
    assert len(groups) == 15 and set(groups.values()) == {16, 32}
