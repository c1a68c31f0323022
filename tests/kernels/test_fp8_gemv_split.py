"""The fp8 decode GEMV split over K (paged.kernels.fp8_gemv) against the arithmetic it
implements (rows quantized per token, the fp8 product in float32, the scales, the bias) and
against the unsplit tensor-core GEMV (gemv.fp8_gemv_dot): 1-4 rows, ragged N and K, SPLIT
1/2/4; the counters are zero again after every launch."""

import pytest
import torch

from paged.quantization import reference as ref


def _reference(x, q, s, bias, device):
    """quantize_fp8_rows (the kernel, on the device), then the product of the dequantized
    operands in float32 on the host."""
    from paged.kernels.fp8_gemm import quantize_fp8_rows

    xq, xs = (t.cpu() for t in quantize_fp8_rows(x.to(device)))
    y = (xq.float() @ q.float().t()) * xs.float() * s.float().t()
    return y + bias.float() if bias is not None else y


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape
    scale = want.float().abs().max().clamp(min=1.0)
    assert (got.float() - want.float()).abs().max() <= tol * scale


@pytest.mark.parametrize("config", [(16, 32, 1, 4, 1), (16, 32, 2, 4, 2), (32, 64, 4, 4, 2)])
@pytest.mark.parametrize("m, n, k, bias", [(1, 48, 256, False), (2, 37, 200, True),
                                           (3, 64, 96, True), (4, 40, 130, False)])  # fmt: skip
def test_split_fp8_gemv_matches_reference_and_unsplit(device, config, m, n, k, bias):
    from paged.kernels.fp8_gemv import fp8_gemv_split, split_counters
    from paged.kernels.gemv import fp8_gemv_dot

    g = torch.Generator().manual_seed(m * k + n + config[2])
    q, s = ref.quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.1)
    x = torch.randn(m, k, generator=g) * (1 + 10 * torch.rand(m, 1, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    counters = torch.zeros(split_counters(n, config), dtype=torch.int32, device=device)
    args = (x.to(device), q.to(device), s.to(device), b.to(device) if bias else None)
    got = fp8_gemv_split(*args, config, counters)
    assert int(counters.abs().sum()) == 0
    _close(got.cpu(), _reference(x, q, s, b, device), 1e-5)
    unsplit = fp8_gemv_dot(*args, config=(*config[:2], *config[3:]))
    _close(got.cpu(), unsplit.cpu(), 1e-5)
    if config[2] == 1:  # the same tiles in the same order: the unsplit kernel's sums
        assert torch.equal(got, unsplit)
    assert torch.equal(fp8_gemv_split(*args, config, counters), got)  # a replay: same sums
    assert int(counters.abs().sum()) == 0


def test_bfloat16_rows_and_the_linear_op(device):
    """bf16 activations as the model runs them, against fp8_linear's reference arithmetic;
    more output blocks than one, a slice of K shorter than the others, rows longer than one
    step of the absmax (its largest value in the last step)."""
    from paged.kernels.fp8_gemv import AMAX_ELEMENTS, fp8_gemv_split, split_counters

    g = torch.Generator().manual_seed(7)
    n, k, config = 72, AMAX_ELEMENTS + 200, (32, 512, 3, 4, 2)
    q, s = ref.quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    x[0, -3] = 40.0
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    counters = torch.zeros(split_counters(n, config) + 5, dtype=torch.int32, device=device)
    got = fp8_gemv_split(x.to(device), q.to(device), s.to(device), b.to(device), config,
                         counters)  # fmt: skip
    assert got.dtype == torch.bfloat16 and int(counters.abs().sum()) == 0
    _close(got.cpu(), ref.fp8_linear(x, q, s, k, b), 1e-2)


def test_the_installed_forward_takes_up_to_four_rows(device, monkeypatch):
    from paged.kernels import fp8_gemv
    from paged.quantization.base import QuantLinear
    from paged.quantization.fp8 import Fp8Method

    torch.manual_seed(0)
    lin = QuantLinear(64, 40, True, Fp8Method())
    with torch.no_grad():
        for name, t in Fp8Method()._quantize(torch.randn(40, 64) * 0.1).items():
            getattr(lin, name).copy_(t)
        lin.bias.normal_()
    lin.to(device)
    calls = []
    real = fp8_gemv.fp8_gemv_split
    monkeypatch.setattr(fp8_gemv, "fp8_gemv_split", lambda *a: calls.append(1) or real(*a))
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    lin.forward = fp8_gemv.Fp8SplitGemv(lin, (16, 32, 2, 4, 1), counters)
    with torch.no_grad():
        for shape in ((1, 64), (2, 2, 64), (5, 64)):
            x = torch.randn(*shape, device=device)
            want = ref.fp8_linear(x.cpu(), lin.weight.cpu(), lin.weight_scale.cpu(), 64,
                                  lin.bias.cpu())  # fmt: skip
            _close(lin(x).cpu(), want, 1e-5)
    assert calls == [1, 1]  # 1 and 4 rows; 5 rows: the layer's own forward
    assert int(counters.abs().sum()) == 0


def _fp8_weight(n: int, k: int, g: torch.Generator):
    return ref.quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config, m, n, k", [((16, 32, 1, 4, 1), 1, 48, 96),
                                             ((16, 32, 3, 4, 2), 3, 40, 200),
                                             ((32, 128, 4, 4, 2), 4, 40, 1100)])  # fmt: skip
def test_the_norm_before_it_folded_in(device, dtype, config, m, n, k):
    """The residual add and RMSNorm inside the split fp8 GEMV: the same as the norm kernel
    then the GEMV (the norm's sums in another order: equal up to a rounding flip), the new
    residual the norm kernel's, the inputs unchanged, and the counters zero again; rows longer
    than one step of the norm's and the absmax's passes (4 rows of 1100)."""
    from paged.kernels import fused_add_rms_norm
    from paged.kernels.fp8_gemv import fp8_gemv_split, split_counters

    g = torch.Generator().manual_seed(m + n + k)
    q, s = _fp8_weight(n, k, g)
    x, res = (torch.randn(m, k, generator=g).to(dtype) for _ in range(2))
    gain = (torch.rand(k, generator=g) + 0.5).to(dtype)
    dx, dres, dgain, dq, ds = (t.to(device) for t in (x, res, gain, q, s))
    counters = torch.zeros(split_counters(n, config), dtype=torch.int32, device=device)
    out, new_res = fp8_gemv_split(dx, dq, ds, None, config, counters, norm=(dres, dgain, 1e-5))
    assert torch.equal(dx.cpu(), x) and torch.equal(dres.cpu(), res)
    normed, want_res = fused_add_rms_norm(dx.clone(), dres.clone(), dgain, 1e-5)
    assert torch.equal(new_res, want_res)  # the norm kernel's add, rounded as it rounds
    want = fp8_gemv_split(normed, dq, ds, None, config, counters)
    _close(out.cpu(), want.cpu(), 2e-2 if dtype == torch.bfloat16 else 1e-3)
    _close(out.cpu(), _reference(normed.cpu().float(), q, s, None, device), 2e-2)
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("config, m, n, k", [((16, 32, 1, 4, 1), 1, 40, 64),
                                             ((16, 32, 2, 4, 2), 2, 48, 150),
                                             ((32, 128, 3, 4, 2), 4, 40, 1100)])  # fmt: skip
def test_silu_and_mul_before_it_folded_in(device, config, m, n, k):
    """silu_and_mul of a gate/up output inside the split fp8 GEMV: bit-equal to the
    silu_and_mul kernel then the GEMV (the same roundings, the same sums)."""
    from paged.kernels import silu_and_mul
    from paged.kernels.fp8_gemv import fp8_gemv_split, split_counters

    g = torch.Generator().manual_seed(n + k)
    q, s = _fp8_weight(n, k, g)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(device)
    counters = torch.zeros(split_counters(n, config), dtype=torch.int32, device=device)
    dq, ds = q.to(device), s.to(device)
    got = fp8_gemv_split(gate_up, dq, ds, b, config, counters, silu_mul=True)
    assert torch.equal(got, fp8_gemv_split(silu_and_mul(gate_up), dq, ds, b, config, counters))
    assert int(counters.abs().sum()) == 0
