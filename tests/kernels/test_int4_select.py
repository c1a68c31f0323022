"""The CUDA plugin's measured choice of the split-K int4 GEMM's config for few rows
(paged_cuda.int4_select): the candidate configs, and which linears it times, by shape. The
choice itself is gemv_select.choose (tests/kernels/test_fp8_select.py); on a GPU the timings
are real: `paged bench latency --quantization awq` logs each shape's choice."""

from __future__ import annotations

import pytest
import torch
import triton
from torch import nn

int4_select = pytest.importorskip("paged_cuda.int4_select")

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("n, k", [*LLAMA_8B, (1536, 576), (576, 1536), (128256, 4096)])
@pytest.mark.parametrize("sms", [132, 84])
@pytest.mark.parametrize("bits", [4, 8])
def test_candidates_fill_the_gpu_with_whole_slices(n, k, sms, bits):
    from paged.kernels.int4_gemm_split import default_config

    got = int4_select.candidates(n, k, sms, bits)
    assert len(got) == len(set(got)) <= 16 and default_config(1, n, k, bits) not in got
    for block_m, block_n, block_k, split, warps in got:
        per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # whole BLOCK_K steps
        assert sms <= triton.cdiv(n, block_n) * split <= 16 * sms and warps == 4
        assert per * (split - 1) < k  # no empty slice
        assert block_m == 16 and block_k * bits // 32 in (16, 32)  # K steps of 16 / 32 words
    if (n, k) in LLAMA_8B:
        assert got
    if n == 4096:  # o_proj, down: K split, the outputs alone fill the GPU too few times
        assert all(c[3] > 1 for c in got)


def test_choose_keeps_the_group_in_the_key():
    """Shapes are keyed (n, k, group, mins, bits): two groupings of one weight shape are timed
    and chosen apart."""
    shapes = {(4096, 4096, 128, False, 4): ["awq"], (4096, 4096, 32, True, 4): ["gguf"]}
    got = int4_select.choose(shapes, lambda n, k, group, mins, bits:
                             int4_select.candidates(n, k, 132, bits),
                             lambda mods: 10e-6,
                             lambda mods, c: 4e-6 if mods == ["awq"] else 11e-6)  # fmt: skip
    assert list(got) == [(4096, 4096, 128, False, 4)]


def test_only_int4_linears_on_the_gpu_are_timed(monkeypatch):
    """AWQ/GPTQ and GGUF 4-/8-bit QuantLinears by (n, k, group, mins, bits); not fp8 ones,
    dense linears, linears already given a forward, or (here, on CPU) any: not on a GPU."""
    from paged.quantization.base import QuantLinear
    from paged.quantization.fp8 import Fp8Method
    from paged.quantization.gguf import GgufIntMethod
    from paged.quantization.int4 import Int4Method

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = QuantLinear(256, 32, False, Int4Method("awq", 128))
            self.b = QuantLinear(256, 32, True, Int4Method("gptq", 128))
            self.c = QuantLinear(256, 32, False, Int4Method("gptq", 64))
            self.g = QuantLinear(256, 32, False, GgufIntMethod(4))
            self.g8 = QuantLinear(256, 32, False, GgufIntMethod(8, with_mins=False))
            self.fp8 = QuantLinear(256, 32, False, Fp8Method())
            self.dense = nn.Linear(256, 32)
            self.done = QuantLinear(256, 32, False, Int4Method("awq", 128))
            self.done.forward = lambda x: x

    model = Model()
    assert int4_select.int4_linears(model) == {}  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    got = int4_select.int4_linears(model)
    assert got == {(32, 256, 128, False, 4): [model.a, model.b],
                   (32, 256, 64, False, 4): [model.c], (32, 256, 32, True, 4): [model.g],
                   (32, 256, 32, False, 8): [model.g8]}  # fmt: skip
