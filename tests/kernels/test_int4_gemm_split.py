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
    # row blocks of 32 and more: the rows' columns loaded contiguously, split per code
    (40, 48, 384, 128, False, True, 4, (32, 16, 128, 2, 4)),  # two blocks, a ragged one
    (33, 24, 160, 32, False, False, 8, (64, 16, 64, 1, 4)),  # 8-bit, K not whole tiles
    (20, 19, 96, 32, True, True, 8, None),  # 8-bit with mins, the default config
    (1, 40, 256, 128, False, True, 4, None),  # one row (batch-1 decode)
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

    assert default_config(1, 6144, 4096, 4) == (16, 64, 128, 8, 4)  # 96 tiles -> 768 programs
    assert default_config(2, 28672, 4096, 4) == (16, 64, 128, 2, 4)  # 448 tiles -> 896
    assert default_config(16, 28672, 4096, 4) == (16, 128, 128, 8, 4)  # more rows: 128 wide
    assert default_config(8, 4096, 256, 4)[3] == 1  # slices would be < 4 steps
    assert default_config(1, 64, 4096, 8)[:3] == (16, 64, 64)  # 8-bit: 64 columns a step
    # taller blocks: 32 rows (128 outputs), 64 rows (64 outputs); split 4 on small grids
    assert default_config(32, 6144, 4096, 4) == (32, 128, 128, 4, 4)  # 48 tiles
    assert default_config(17, 28672, 4096, 4) == (32, 128, 128, 1, 4)  # 224 tiles
    assert default_config(64, 4096, 14336, 4) == (64, 64, 128, 4, 4)
    assert default_config(33, 28672, 4096, 4) == (64, 64, 128, 2, 4)  # 448 tiles
    assert default_config(64, 4096, 512, 4)[3] == 1  # slices would be < 4 steps


def _weights(n: int, k: int, group_k: int, with_mins: bool, seed: int, bits: int = 4):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_k)
    codes = ref.pack_int4(torch.randint(0, 1 << bits, (n, k), generator=g), bits)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8)
    mins = torch.randn(n, groups, generator=g) * 0.05 if with_mins else None
    return codes, scales, zeros, mins, g


def test_weights_round_to_the_row_dtype_before_the_product(device):
    """Each weight is (code - zero) * scale rounded to the row's dtype before the product, as
    the reference rounds it: with scales bf16 cannot hold, one-hot rows (each output a single
    weight, so no sum to reorder) give the reference's bits. In bfloat16 on a GPU only: the
    interpreter rounds float32 to bfloat16 by truncation."""
    from paged.kernels.int4_gemm_split import int4_gemm_split

    n, k, group_k = 16, 128, 64
    codes, scales, zeros, _, _ = _weights(n, k, group_k, False, 3)
    scales = scales + 1e-5 / 3  # not a bf16 value
    w = [t.to(device) for t in (codes, scales, zeros)]
    for dtype in (torch.float32,) + ((torch.bfloat16,) if device != "cpu" else ()):
        x = torch.zeros(4, k, dtype=dtype)
        for row, col in enumerate((0, 9, 77, 127)):
            x[row, col] = 1.0
        got = int4_gemm_split(x.to(device), *w, group_k, None, None, 4, (16, 16, 128, 2, 4))
        want = ref.int4_linear(x, codes, scales, zeros, group_k)
        assert torch.equal(got.cpu(), want)


def test_an_empty_slice_reads_no_scale_past_the_row(device):
    """SPLIT 3 over 256 columns in slices of 128 leaves the third slice empty: its program must
    not read a scale or zero past the weight's last group (here NaN, where memory past the
    tensor could hold anything)."""
    from paged.kernels.int4_gemm_split import int4_gemm_split

    n, k, group_k = 16, 256, 128
    codes, scales, zeros, _, g = _weights(n, k, group_k, False, 11)
    padded = torch.full((n * 2 + 64,), float("nan"))
    padded[: n * 2] = scales.flatten()
    tail = padded[: n * 2].view(n, 2)  # the scales, NaN right after the last row's
    x = torch.randn(2, k, generator=g)
    dev = [t.to(device) for t in (x, codes, tail, zeros)]
    if device == "cpu":  # keep the NaN tail behind the view on the CPU
        dev[2] = tail
    got = int4_gemm_split(*dev, group_k, None, None, 4, (16, 16, 128, 3, 4))
    want = ref.int4_linear(x, codes, scales, zeros, group_k)
    assert torch.isfinite(got).all()
    _close(got.cpu(), want, 2e-3)


def test_the_tuned_forward_takes_up_to_four_rows(device, monkeypatch, reference_ops):
    """Int4TunedGemm on an AWQ-style QuantLinear (groups of 128) and GGUF ones (4-bit with
    mins, 8-bit; groups of 32): inputs of up to TUNED_MAX_ROWS rows, of any leading shape, go
    through int4_linear with the config, more rows through the layer's own forward (its
    platform's op: here the CPU's torch reference). int4_linear runs the split GEMM for every
    group width."""
    from paged.kernels import int4_gemm
    from paged.kernels.int4_gemm_split import code_bits
    from paged.quantization.base import QuantLinear
    from paged.quantization.gguf import GgufIntMethod
    from paged.quantization.int4 import Int4Method

    configs = []
    real = int4_gemm.int4_gemm_split
    monkeypatch.setattr(int4_gemm, "int4_gemm_split",
                        lambda *a: configs.append(a[-1]) or real(*a))  # fmt: skip
    assert int4_gemm.TUNED_MAX_ROWS == 4
    methods = ((Int4Method("awq", 128), 128), (GgufIntMethod(4), 32),
               (GgufIntMethod(8, with_mins=False), 32))  # fmt: skip
    for method, group_k in methods:
        bits = getattr(method, "bits", 4)
        lin = QuantLinear(256, 24, True, method)
        assert code_bits(lin) == bits
        codes, scales, zeros, mins, g = _weights(24, 256, group_k, hasattr(lin, "mins"), 5, bits)
        with torch.no_grad():
            lin.codes.copy_(codes), lin.scales.copy_(scales), lin.zeros.copy_(zeros)
            lin.bias.normal_(generator=g)
            if mins is not None:
                lin.mins.copy_(mins)
        lin.to(device)
        lin.forward = int4_gemm.Int4TunedGemm(lin, (16, 16, 128, 2, 4))
        configs.clear()
        with torch.no_grad():
            for shape in ((1, 256), (1, 1, 256), (2, 2, 256), (5, 256)):
                x = torch.randn(*shape, generator=g)
                reference = ref.int4_linear if bits == 4 else ref.int8_linear
                want = reference(x, codes, scales, zeros, group_k, lin.bias.cpu(), mins)
                _close(lin(x.to(device)).cpu(), want, 2e-3)
        assert configs == [(16, 16, 128, 2, 4)] * 3
