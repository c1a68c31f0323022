"""The fp8 and int4 Triton GEMMs against the torch reference (paged.quantization.reference)
with the same scales, in the interpreter: tiny shapes, per-channel and block scales, GEMV and
GEMM row counts, bias, ragged edges."""

import pytest
import torch

from paged.quantization import reference as ref

TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().clamp(min=1.0)
    assert (got.float() - want.float()).abs().max() <= tol * scale


@pytest.mark.parametrize("k", [70, 16390])  # rows read once, rows longer than one block
def test_quantize_rows_matches_reference(device, k):
    from paged.kernels.fp8_gemm import quantize_fp8_rows

    x = torch.randn(5, k) * torch.tensor([1.0, 1e-3, 30.0, 0.0, 2.0])[:, None]
    x[0, :8] = torch.tensor([448.0, -448.0, 2.0**-9, 3 * 2.0**-10, 17.0, -0.0, 1e-30, 5.5])
    q, s = quantize_fp8_rows(x.to(device))
    rq, rs = ref.quantize_fp8_rows(x)
    assert torch.allclose(s.cpu(), rs, rtol=1e-6)
    assert torch.equal(q.cpu().float(), rq.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, group_k", [(1, 48, 64, None), (7, 40, 96, None),
                                              (33, 64, 256, 128), (3, 24, 200, 64)])  # fmt: skip
def test_fp8_linear_matches_reference(device, dtype, m, n, k, group_k):
    from paged.kernels.fp8_gemm import fp8_linear

    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    if group_k is None:  # per output channel
        q, s = ref.quantize_fp8_rows(w)
        group_k = k
    else:  # block scales over groups of input columns
        groups = -(-k // group_k)
        s = torch.rand(n, groups, generator=g) * 0.01 + 0.001
        q = (w / ref.expand_groups(s, group_k, k)).clamp(-448, 448).to(ref.FP8)
    want = ref.fp8_linear(x, q, s, group_k, bias)
    got = fp8_linear(x.to(device), q.to(device), s.to(device), group_k, bias.to(device))
    _close(got.cpu(), want, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, group_k, with_mins, bits", [
    (1, 40, 256, 128, False, 4), (3, 64, 128, 32, True, 4),  # GGUF Q4_1's groups of 32
    (6, 24, 256, 128, False, 4), (20, 72, 128, 64, False, 4), (9, 32, 96, 32, True, 4),
    (40, 24, 256, 128, False, 4),  # from DEQUANT_MIN_ROWS: the weight dequantized + F.linear
    (33, 40, 128, 32, True, 4),  # GGUF Q4_1 from DEQUANT_MIN_ROWS
    (1, 40, 128, 32, False, 8), (2, 24, 96, 32, True, 8),  # 8-bit codes (GGUF Q8_0)
    (6, 24, 64, 32, True, 8), (33, 40, 160, 32, False, 8), (32, 40, 160, 32, False, 8),
])  # fmt: skip
def test_int4_linear_matches_reference(device, dtype, m, n, k, group_k, with_mins, bits):
    from paged.kernels.int4_gemm import int4_linear

    g = torch.Generator().manual_seed(m + n + k)
    top = 1 << bits
    codes = ref.pack_int4(torch.randint(0, top, (n, k), generator=g), bits)
    scales = torch.rand(n, k // group_k, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, top, (n, k // group_k), generator=g).to(torch.uint8)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    mins = torch.randn(n, k // group_k, generator=g) * 0.05 if with_mins else None
    reference = ref.int4_linear if bits == 4 else ref.int8_linear
    want = reference(x, codes, scales, zeros, group_k, bias, mins)
    args = (codes, scales, zeros)
    got = int4_linear(x.to(device), *(a.to(device) for a in args), group_k, bias.to(device),
                      None if mins is None else mins.to(device), bits)  # fmt: skip
    _close(got.cpu(), want, TOL[dtype])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_mins", [False, True])
def test_dequantize_gives_the_reference_weights(device, bits, with_mins):
    """The many-row path's weight (int4_gemm.dequantize): the reference's float32 values
    exactly, ragged tiles (N not a multiple of 32, K not of 128)."""
    from paged.kernels.int4_gemm import dequantize

    n, k, group_k = 37, 160, 32
    g = torch.Generator().manual_seed(bits)
    codes = ref.pack_int4(torch.randint(0, 1 << bits, (n, k), generator=g), bits)
    scales = torch.rand(n, k // group_k, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group_k), generator=g).to(torch.uint8)
    mins = torch.randn(n, k // group_k, generator=g) if with_mins else None
    want = ref.dequantize_int4(codes, scales, zeros, group_k, mins, bits)
    dev = [None if t is None else t.to(device) for t in (codes, scales, zeros, mins)]
    got = dequantize(*dev[:3], group_k, dev[3], bits, torch.float32)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("bits", [4, 8])
def test_int4_pack_roundtrip(bits):
    v = torch.randint(0, 1 << bits, (5, 64))
    packed = ref.pack_int4(v, bits)
    assert packed.shape == (5, 64 * bits // 32)
    assert torch.equal(ref.unpack_int4(packed, bits).long(), v)
    if bits == 8:  # column k is byte k % 4 of word k // 4 (little-endian bytes)
        assert torch.equal(packed.view(torch.uint8).view(5, 64).long(), v)


def test_empty_batch(device):
    from paged.kernels.fp8_gemm import fp8_linear
    from paged.kernels.int4_gemm import int4_linear

    x = torch.zeros(0, 64, device=device)
    w, s = ref.quantize_fp8_rows(torch.randn(16, 64))
    assert fp8_linear(x, w.to(device), s.to(device), 64).shape == (0, 16)
    codes = torch.zeros(16, 8, dtype=torch.int32, device=device)
    sc, z = torch.ones(16, 1, device=device), torch.zeros(16, 1, dtype=torch.uint8, device=device)
    assert int4_linear(x, codes, sc, z, 64).shape == (0, 16)
