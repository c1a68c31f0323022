"""A decode fp8 linear's input quantized once with the op before it (paged.kernels.fp8_act),
and the split fp8 GEMV reading those rows (`fp8_gemv_split(x_scale=...)`, Fp8SplitGemv's
`rows`): the same quantized rows as the op's kernel then quantize_fp8_rows, the same
products as the GEMV quantizing inside; SiLU-and-mul with partial absmaxes likewise."""

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
@pytest.mark.parametrize("m, k", [(1, 96), (3, 200), (4, 1100)])
def test_the_rows_are_the_op_then_quantize_fp8_rows(device, dtype, m, k):
    """Bit-equal to the op's own kernel (fused_add_rms_norm, silu_and_mul) then
    quantize_fp8_rows: values and scales; the new residual the norm kernel's, inputs kept."""
    from paged.kernels import fused_add_rms_norm, silu_and_mul
    from paged.kernels.fp8_act import quantize_input
    from paged.kernels.fp8_gemm import quantize_fp8_rows

    x, res, gain, gate_up = (t.to(device) for t in _inputs(m, k, dtype, m * k))
    x0, res0 = x.clone(), res.clone()
    normed, want_res = fused_add_rms_norm(x.clone(), res.clone(), gain, 1e-5)
    cases = [(x, None, False, x), (x, (res, gain, 1e-5), False, normed),
             (gate_up, None, True, silu_and_mul(gate_up))]  # fmt: skip
    for inp, norm, silu, op_out in cases:
        q, s, new_res = quantize_input(inp, norm, silu)
        want_q, want_s = quantize_fp8_rows(op_out)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (m,)
        assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s.view(m))
        assert (new_res is None) == (norm is None)
        if norm is not None:
            assert torch.equal(new_res, want_res)
    assert torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m, n, k", [(1, 48, 96), (2, 37, 200), (4, 40, 1100)])
def test_the_gemv_on_quantized_rows_is_the_gemv_quantizing_inside(device, config, m, n, k):
    """The same quantized values, the same sums in the same order: bit-equal outputs (bias
    too), in the input's dtype; the counters zero again."""
    from paged.kernels.fp8_act import quantize_input
    from paged.kernels.fp8_gemv import fp8_gemv_split, split_counters

    g = torch.Generator().manual_seed(n + k)
    wq, ws = (t.to(device) for t in ref.quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.1))
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(device)
    x = _inputs(m, k, torch.bfloat16, n)[0].to(device)
    counters = torch.zeros(split_counters(n, config), dtype=torch.int32, device=device)
    q, s, _ = quantize_input(x)
    got = fp8_gemv_split(q, wq, ws, b, config, counters, x_scale=s, out_dtype=x.dtype)
    assert got.dtype == torch.bfloat16 and int(counters.abs().sum()) == 0
    assert torch.equal(got, fp8_gemv_split(x, wq, ws, b, config, counters))
    want = (q.float().cpu() @ wq.float().cpu().t()) * s.cpu()[:, None] * ws.cpu().t() + b.cpu()
    assert (got.cpu().float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("m, k", [(1, 96), (3, 1100)])
def test_silu_mul_absmax_and_the_gemv_taking_the_max(device, m, k):
    """The activation bit-equal to silu_and_mul's, each block's absmax of it; the GEMV on it
    with the max of those partials bit-equal to the GEMV computing the absmax itself."""
    from paged.kernels import silu_and_mul
    from paged.kernels.fp8_act import silu_mul_absmax
    from paged.kernels.fp8_gemv import fp8_gemv_split, split_counters

    gate_up = _inputs(m, k, torch.bfloat16, k)[3].to(device)
    act, amax = silu_mul_absmax(gate_up, block=64)
    want = silu_and_mul(gate_up)
    assert torch.equal(act, want) and amax.shape == (m, -(-k // 64))
    padded = torch.nn.functional.pad(want.float().abs(), (0, amax.shape[1] * 64 - k))
    assert torch.equal(amax, padded.view(m, -1, 64).amax(-1))
    g = torch.Generator().manual_seed(k)
    wq, ws = (t.to(device) for t in ref.quantize_fp8_rows(torch.randn(40, k, generator=g)))
    config = (16, 64, 3, 4, 2)
    counters = torch.zeros(split_counters(40, config), dtype=torch.int32, device=device)
    got = fp8_gemv_split(act, wq, ws, None, config, counters, x_amax=amax)
    assert torch.equal(got, fp8_gemv_split(want, wq, ws, None, config, counters))
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_the_installed_forward_matches_whoever_makes_the_rows(device, config):
    """Fp8SplitGemv with rows "fp8" and "amax" against "fold" on the three inputs the model
    gives it (plain rows, the norm's, SiLU-and-mul's): the same outputs and residuals."""
    from paged.kernels.fp8_gemv import Fp8SplitGemv, split_counters
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
    fold = Fp8SplitGemv(lin, config, counters, 4)
    x, res, gain, gate_up = (t.to(device) for t in _inputs(m, k, torch.bfloat16, 3))
    with torch.no_grad():
        for rows in ("fp8", "amax"):
            other = Fp8SplitGemv(lin, config, counters, 4, rows)
            assert torch.equal(other(x), fold(x))
            assert torch.equal(other(gate_up, silu_mul=True), fold(gate_up, silu_mul=True))
            (a, ra), (b, rb) = (f(x, norm=(res, gain, 1e-5)) for f in (other, fold))
            assert torch.equal(ra, rb)
            assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()
            assert other(torch.randn(5, k, device=device, dtype=torch.bfloat16)).shape == (5, n)
    assert int(counters.abs().sum()) == 0
