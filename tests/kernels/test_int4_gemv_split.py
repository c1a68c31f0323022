"""The int4 decode GEMV split over K (paged.kernels.int4_gemv) against the reference
arithmetic (paged.quantization.reference.int4_linear: weights dequantized and rounded to the
row's dtype) and against the unsplit int4 GEMV: AWQ/GPTQ-style groups of 128 and 64, GGUF's
groups of 32 with mins (tiles wider than a group), ragged N and K, SPLIT 1/2/3; the counters
are zero again after every launch, and a second launch gives the same bits."""

import pytest
import torch

from paged.quantization import reference as ref


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().clamp(min=1.0)
    assert (got.float() - want.float()).abs().max() <= tol * scale


def _weights(n: int, k: int, group_k: int, with_mins: bool, seed: int, bits: int = 4):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_k)
    codes = ref.pack_int4(torch.randint(0, 1 << bits, (n, k), generator=g), bits)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8)
    mins = torch.randn(n, groups, generator=g) * 0.05 if with_mins else None
    return codes, scales, zeros, mins, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(16, 64, 1, 4), (8, 128, 2, 4), (32, 32, 3, 4)])
@pytest.mark.parametrize("m, n, k, group_k, with_mins, bias, bits", [
    (1, 40, 256, 128, False, True, 4),  # AWQ / GPTQ groups, a ragged last output block
    (3, 32, 256, 128, False, False, 4),  # whole tiles everywhere (no masked load) but SPLIT 3
    (1, 24, 320, 64, False, False, 4),  # K not a whole number of tiles
    (3, 37, 192, 32, True, True, 4),  # GGUF Q4_1: groups of 32 with mins, tiles wider than one
    (1, 24, 160, 32, False, True, 8),  # GGUF Q8_0: 8-bit codes, (code - 128) * d
    (4, 19, 96, 32, True, False, 8),  # 8-bit codes with mins (a layer stacking Q8_0 and Q4_1)
])  # fmt: skip
def test_split_int4_gemv_matches_reference_and_unsplit(device, dtype, config, m, n, k, group_k,
                                                       with_mins, bias, bits):  # fmt: skip
    from paged.kernels.int4_gemm import int4_linear
    from paged.kernels.int4_gemv import int4_gemv_split, split_counters

    codes, scales, zeros, mins, g = _weights(n, k, group_k, with_mins, n + k + config[2], bits)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    reference = ref.int4_linear if bits == 4 else ref.int8_linear
    want = reference(x, codes, scales, zeros, group_k, b, mins)
    dev = [t.to(device) if t is not None else None for t in (x, codes, scales, zeros, b, mins)]
    xd, cd, sd, zd, bd, md = dev
    counters = torch.zeros(split_counters(n, config, m) + 3, dtype=torch.int32, device=device)
    got = int4_gemv_split(xd, cd, sd, zd, group_k, bd, md, config, counters, bits)
    assert int(counters.abs().sum()) == 0
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    _close(got.cpu(), want, tol)
    unsplit = int4_linear(xd, cd, sd, zd, group_k, bd, md, bits)
    _close(got.cpu(), unsplit.cpu(), 1e-5 if dtype == torch.float32 else 1e-2)
    again = int4_gemv_split(xd, cd, sd, zd, group_k, bd, md, config, counters, bits)
    assert torch.equal(again, got) and int(counters.abs().sum()) == 0


def test_weights_round_to_the_row_dtype_before_the_product(device):
    """Each weight is (code - zero) * scale rounded to the row's dtype before the product, as
    the unsplit kernel and the reference round it: with scales bf16 cannot hold, one-hot rows
    (each output a single weight, so no sum to reorder) give the unsplit kernel's bits in
    bf16 and the reference's in float32."""
    from paged.kernels.int4_gemm import int4_linear
    from paged.kernels.int4_gemv import int4_gemv_split

    n, k, group_k = 16, 128, 64
    codes, scales, zeros, _, _ = _weights(n, k, group_k, False, 3)
    scales = scales + 1e-5 / 3  # not a bf16 value
    w = [t.to(device) for t in (codes, scales, zeros)]
    counters = torch.zeros(4, dtype=torch.int32, device=device)
    for dtype in (torch.bfloat16, torch.float32):
        for col in (0, 9, 77, 127):
            x = torch.zeros(1, k, dtype=dtype, device=device)
            x[0, col] = 1.0
            got = int4_gemv_split(x, *w, group_k, None, None, (8, 32, 2, 4), counters)
            assert torch.equal(got, int4_linear(x, *w, group_k))
            if dtype == torch.float32:
                assert torch.equal(got.cpu(), ref.int4_linear(x.cpu(), codes, scales, zeros,
                                                              group_k))  # fmt: skip


def test_the_installed_forward_takes_up_to_four_rows(device, monkeypatch):
    """Int4SplitGemv on an AWQ-style QuantLinear and GGUF ones (4-bit with mins, 8-bit): inputs
    of up to four rows, of any leading shape, go through the split kernel, more rows through
    the layer's own forward."""
    from paged.kernels import int4_gemv
    from paged.quantization.base import QuantLinear
    from paged.quantization.gguf import GgufIntMethod
    from paged.quantization.int4 import Int4Method

    calls = []
    real = int4_gemv.int4_gemv_split
    monkeypatch.setattr(int4_gemv, "int4_gemv_split", lambda *a: calls.append(1) or real(*a))
    counters = torch.zeros(12, dtype=torch.int32, device=device)  # 3 output blocks x 4 rows
    methods = (Int4Method("awq", 32), GgufIntMethod(4), GgufIntMethod(8, with_mins=False))
    for method in methods:
        group_k, bits = 32, getattr(method, "bits", 4)
        lin = QuantLinear(64, 24, True, method)
        assert int4_gemv.code_bits(lin) == bits
        codes, scales, zeros, mins, g = _weights(24, 64, group_k, hasattr(lin, "mins"), 5, bits)
        with torch.no_grad():
            lin.codes.copy_(codes), lin.scales.copy_(scales), lin.zeros.copy_(zeros)
            lin.bias.normal_(generator=g)
            if mins is not None:
                lin.mins.copy_(mins)
        lin.to(device)
        lin.forward = int4_gemv.Int4SplitGemv(lin, (8, 64, 2, 4), counters)
        calls.clear()
        with torch.no_grad():
            for shape in ((1, 64), (1, 1, 64), (2, 2, 64), (5, 64)):
                x = torch.randn(*shape, generator=g)
                reference = ref.int4_linear if bits == 4 else ref.int8_linear
                want = reference(x, codes, scales, zeros, group_k, lin.bias.cpu(), mins)
                _close(lin(x.to(device)).cpu(), want, 2e-3)
        assert calls == [1, 1, 1]  # five rows: the layer's own forward
    assert int(counters.abs().sum()) == 0


def test_an_empty_slice_reads_no_scale_past_the_row(device):
    """SPLIT 3 over 256 columns in slices of 128 leaves the third slice empty: its program must
    not read a scale or zero past the weight's last group (here NaN, where memory past the
    tensor could hold anything)."""
    from paged.kernels.int4_gemv import int4_gemv_split

    n, k, group_k = 16, 256, 128
    codes, scales, zeros, _, g = _weights(n, k, group_k, False, 11)
    padded = torch.full((n * 2 + 64,), float("nan"))
    padded[: n * 2] = scales.flatten()
    tail = padded[: n * 2].view(n, 2)  # the scales, NaN right after the last row's
    x = torch.randn(1, k, generator=g)
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    dev = [t.to(device) for t in (x, codes, tail, zeros)]
    if device == "cpu":  # keep the NaN tail behind the view on the CPU
        dev[2] = tail
    got = int4_gemv_split(dev[0], dev[1], dev[2], dev[3], group_k, None, None, (16, 64, 3, 4),
                          counters)  # fmt: skip
    want = ref.int4_linear(x, codes, scales, zeros, group_k)
    assert torch.isfinite(got).all()
    _close(got.cpu(), want, 2e-3)
