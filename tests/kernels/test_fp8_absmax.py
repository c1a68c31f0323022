"""The op before a decode fp8 linear writing the rows' absmax (paged.kernels.fused: the
norm's `amax`, silu_and_mul_absmax) and the split fp8 GEMV taking it
(`fp8_gemv_split(x_amax=...)`, Fp8SplitGemv's rows "amax"): the op's own outputs, the GEMV's
products as when it reads the absmax itself."""

import pytest
import torch

from paged.quantization import reference as ref

CONFIGS = [(16, 32, 1, 4, 1), (16, 32, 3, 4, 2), (32, 128, 4, 4, 2)]


def _inputs(m: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * (1 + 5 * torch.rand(m, 1, generator=g))).to(dtype)
    res = torch.randn(m, k, generator=g).to(dtype)
    gain = (torch.rand(k, generator=g) + 0.5).to(dtype)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype)
    return x, res, gain, gate_up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k", [(1, 96), (4, 1100)])
def test_the_norm_writes_its_rows_absmax(device, dtype, m, k):
    """fused_add_rms_norm(amax=...): the same outputs and residual, bit for bit, and each
    output row's absmax."""
    from paged.kernels import fused_add_rms_norm

    x, res, gain, _ = (t.to(device) for t in _inputs(m, k, dtype, m * k))
    want_x, want_res = fused_add_rms_norm(x.clone(), res.clone(), gain, 1e-5)
    amax = torch.full((m, 1), -1.0, device=device)
    got_x, got_res = fused_add_rms_norm(x, res, gain, 1e-5, amax)
    assert torch.equal(got_x, want_x) and torch.equal(got_res, want_res)
    assert torch.equal(amax, want_x.float().abs().amax(1, keepdim=True))


@pytest.mark.parametrize("m, k", [(1, 96), (3, 2500)])
def test_silu_and_mul_absmax_and_the_gemv_taking_the_max(device, m, k):
    """The activation bit-equal to silu_and_mul's, each block's absmax of it; the GEMV on it
    with the max of those partials bit-equal to the GEMV computing the absmax itself."""
    from paged.kernels import silu_and_mul
    from paged.kernels.fp8_gemv import fp8_gemv_split, split_counters
    from paged.kernels.fused import silu_and_mul_absmax

    gate_up = _inputs(m, k, torch.bfloat16, k)[3].to(device)
    act, amax = silu_and_mul_absmax(gate_up)
    want = silu_and_mul(gate_up)
    block = min(1024, 1 << (k - 1).bit_length())  # silu_and_mul's blocks of columns
    assert torch.equal(act, want) and amax.shape == (m, -(-k // block))
    padded = torch.nn.functional.pad(want.float().abs(), (0, amax.shape[1] * block - k))
    assert torch.equal(amax, padded.view(m, -1, block).amax(-1))
    g = torch.Generator().manual_seed(k)
    wq, ws = (t.to(device) for t in ref.quantize_fp8_rows(torch.randn(40, k, generator=g)))
    config = (16, 64, 3, 4, 2)
    counters = torch.zeros(split_counters(40, config), dtype=torch.int32, device=device)
    got = fp8_gemv_split(act, wq, ws, None, config, counters, x_amax=amax)
    assert torch.equal(got, fp8_gemv_split(want, wq, ws, None, config, counters))
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_the_installed_forward_with_the_ops_absmax_matches_the_fold(device, config):
    """Fp8SplitGemv with rows "amax" against "fold" on the three inputs the model gives it
    (plain rows, the norm's, SiLU-and-mul's): the same outputs (the norm's sums in another
    order: up to a rounding flip) and residuals; the norm kernel's arithmetic exactly."""
    from paged.kernels import fused_add_rms_norm
    from paged.kernels.fp8_gemv import Fp8SplitGemv, fp8_gemv_split, split_counters
    from paged.quantization.base import QuantLinear
    from paged.quantization.fp8 import Fp8Method

    n, k, m = 40, 200, 2
    torch.manual_seed(1)
    lin = QuantLinear(k, n, True, Fp8Method())
    with torch.no_grad():
        for name, t in Fp8Method()._quantize(torch.randn(n, k) * 0.1).items():
            getattr(lin, name).copy_(t)
        lin.bias.normal_()
    lin.to(device)
    counters = torch.zeros(split_counters(n, config), dtype=torch.int32, device=device)
    fold, amax = (Fp8SplitGemv(lin, config, counters, 4, rows) for rows in ("fold", "amax"))
    x, res, gain, gate_up = (t.to(device) for t in _inputs(m, k, torch.bfloat16, 3))
    with torch.no_grad():
        assert torch.equal(amax(x), fold(x))
        assert torch.equal(amax(gate_up, silu_mul=True), fold(gate_up, silu_mul=True))
        b, rb = fold(x, norm=(res, gain, 1e-5))
        a, ra = amax(x.clone(), norm=(res.clone(), gain, 1e-5))
        assert torch.equal(ra, rb)
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
        normed, _ = fused_add_rms_norm(x.clone(), res.clone(), gain, 1e-5)
        assert torch.equal(a, fp8_gemv_split(normed, lin.weight, lin.weight_scale, lin.bias,
                                             config, counters))  # fmt: skip
        assert amax(torch.randn(5, k, device=device, dtype=torch.bfloat16)).shape == (5, n)
    assert int(counters.abs().sum()) == 0
