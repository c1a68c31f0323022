"""The split-K int4 GEMM on the tensor cores (paged.kernels.int4_gemm_split) against the
reference arithmetic (weights dequantized and rounded to the rows' dtype, then multiplied):
row counts below, at and across one row block, AWQ/GPTQ groups of 128 and 64, GGUF's groups
of 32 with mins (tiles wider than a group), 8-bit codes, ragged N and K, SPLIT 1/2/3; the
counters are zero again after every launch, and a second launch gives the same bits."""

import pytest
import torch

from paged.quantization import reference as ref


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().clamp(min=1.0)
    assert (got.float() - want.float()).abs().max() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, group_k, with_mins, bias, bits, config", [
    (5, 64, 256, 128, False, True, 4, (16, 64, 128, 2, 4)),  # AWQ groups, whole weight tiles
    (17, 40, 384, 128, False, False, 4, (16, 32, 128, 3, 4)),  # two row blocks, ragged N, SPLIT 3
    (3, 24, 320, 64, False, True, 4, (16, 16, 128, 1, 4)),  # K not whole tiles, tile > group
    (9, 37, 192, 32, True, True, 4, (32, 32, 128, 2, 4)),  # GGUF Q4_1: groups of 32, mins
    (6, 24, 160, 32, False, False, 8, (16, 16, 64, 2, 4)),  # GGUF Q8_0: 8-bit codes
    (20, 19, 96, 32, True, True, 8, None),  # 8-bit with mins, the default config
])  # fmt: skip
def test_split_int4_gemm_matches_reference(device, dtype, m, n, k, group_k, with_mins, bias,
                                           bits, config):  # fmt: skip
    from paged.kernels.int4_gemm_split import counters_for, int4_gemm_split

    g = torch.Generator().manual_seed(m + n + k)
    groups = -(-k // group_k)
    codes = ref.pack_int4(torch.randint(0, 1 << bits, (n, k), generator=g), bits)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8)
    mins = torch.randn(n, groups, generator=g) * 0.05 if with_mins else None
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    reference = ref.int4_linear if bits == 4 else ref.int8_linear
    want = reference(x, codes, scales, zeros, group_k, b, mins)
    xd, cd, sd, zd, bd, md = (t.to(device) if t is not None else None
                              for t in (x, codes, scales, zeros, b, mins))  # fmt: skip
    got = int4_gemm_split(xd, cd, sd, zd, group_k, bd, md, bits, config)
    counters = counters_for(xd.device)
    assert int(counters.abs().sum()) == 0
    _close(got.cpu(), want, 2e-3 if dtype == torch.float32 else 3e-2)
    again = int4_gemm_split(xd, cd, sd, zd, group_k, bd, md, bits, config)
    assert torch.equal(again, got) and int(counters.abs().sum()) == 0


def test_default_config_splits_small_grids_only():
    from paged.kernels.int4_gemm_split import default_config

    assert default_config(8, 4096, 4096, 4, 128) == (16, 64, 128, 4, 4)  # 64 tiles -> 256
    assert default_config(256, 28672, 4096, 4, 128)[3] == 1  # 1792 tiles: no split
    assert default_config(40, 4096, 256, 4, 128)[3] == 1  # slices would be < 4 steps
    assert default_config(20, 64, 4096, 8, 32)[:3] == (32, 64, 64)
