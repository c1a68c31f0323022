"""The decode GEMV (paged.kernels.gemv) against torch: plain weights, fp8 weights with the
activation quantized inside the kernel (equal to quantizing first, as fp8_gemm does), already
quantized activations, block scales, bias, ragged edges and configs that split N and K."""

import pytest
import torch

from paged.quantization import reference as ref


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().clamp(min=1.0)
    assert (got.float() - want.float()).abs().max() <= tol * scale


CONFIGS = [None, (4, 32, 2), (16, 64, 4)]  # the default, and blocks smaller than the shapes


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (3, 37, 200), (4, 72, 96)])
def test_plain_weights_match_linear(device, config, dtype, m, n, k):
    from paged.kernels.gemv import gemv

    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float()).to(dtype)
    got = gemv(x.to(device), w.to(device), bias=bias.to(device), config=config)
    _close(got.cpu(), want, 2e-3 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m, n, k, group_k", [(1, 48, 64, None), (2, 40, 200, None),
                                              (4, 64, 256, 64), (1, 24, 256, 128)])  # fmt: skip
def test_fp8_quantized_inside_equals_quantized_first(device, config, m, n, k, group_k):
    from paged.kernels.gemv import gemv

    g = torch.Generator().manual_seed(m + n * k)
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(m, k, generator=g) * torch.tensor([1.0, 1e-3, 30.0, 2.0])[:m, None]
    bias = torch.randn(n, generator=g)
    if group_k is None:
        q, s = ref.quantize_fp8_rows(w)
        group_k = k
    else:
        s = torch.rand(n, -(-k // group_k), generator=g) * 0.01 + 0.001
        q = (w / ref.expand_groups(s, group_k, k)).clamp(-448, 448).to(ref.FP8)
    want = ref.fp8_linear(x, q, s, group_k, bias)
    dq, ds, db = q.to(device), s.to(device), bias.to(device)
    fused = gemv(x.to(device), dq, ds, group_k, db, quantize_x=True, config=config).cpu()
    _close(fused, want, 2e-3)
    xq, xs = ref.quantize_fp8_rows(x)
    first = gemv(xq.to(device), dq, ds, group_k, db, x_scale=xs.to(device),
                 out_dtype=torch.float32, config=config).cpu()  # fmt: skip
    torch.testing.assert_close(fused, first, rtol=1e-5, atol=1e-5)


def test_block_scales_need_a_power_of_two_group(device):
    from paged.kernels.gemv import gemv

    q = torch.zeros(8, 96, dtype=ref.FP8, device=device)
    with pytest.raises(ValueError, match="power of 2"):
        gemv(torch.ones(1, 96, device=device), q, torch.ones(8, 2, device=device), 48)


def test_no_rows(device):
    from paged.kernels.gemv import gemv

    assert gemv(torch.zeros(0, 32, device=device), torch.ones(8, 32, device=device)).shape == (0, 8)


@pytest.mark.parametrize("config", [(64, 256, 4, 2), (16, 32, 4, 1)])
@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (2, 40, 96), (5, 80, 200), (16, 16, 96)])
def test_fp8_tensor_core_gemv_matches_reference(device, config, m, n, k):
    from paged.kernels.gemv import fp8_gemv_dot

    g = torch.Generator().manual_seed(m * k + n)
    q, s = ref.quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.1)
    x = torch.randn(m, k, generator=g) * (1 + 10 * torch.rand(m, 1, generator=g))
    bias = torch.randn(n, generator=g)
    want = ref.fp8_linear(x, q, s, k, bias)
    got = fp8_gemv_dot(x.to(device), q.to(device), s.to(device), bias.to(device), config)
    _close(got.cpu(), want, 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(4, 32, 1, 2), (8, 32, 3, 4), (16, 64, 4, 4)])
@pytest.mark.parametrize("m, n, k, bias", [(1, 48, 256, False), (2, 37, 200, True)])
def test_split_k_gemv_matches_linear(device, dtype, config, m, n, k, bias):
    """K split over programs (ragged N and K), the last program of each block adding the
    partials; the counters are zero again after each launch, so a second launch (a graph
    replay) gives the same result."""
    from paged.kernels.gemv import gemv_split_k, split_k_counters

    g = torch.Generator().manual_seed(n + k + config[2])
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
    counters = torch.zeros(split_k_counters(n, m, config), dtype=torch.int32, device=device)
    args = (x.to(device), w.to(device), b.to(device) if bias else None, config, counters)
    first = gemv_split_k(*args)
    _close(first.cpu(), want.to(dtype), 2e-3 if dtype == torch.float32 else 3e-2)
    assert int(counters.abs().sum()) == 0
    assert torch.equal(gemv_split_k(*args), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(4, 32, 1, 2), (8, 32, 3, 4), (16, 64, 4, 4)])
@pytest.mark.parametrize("m, n, k, bias", [(1, 48, 256, False), (2, 37, 200, True)])
def test_split_k_gemv_with_the_norm_before_it(device, dtype, config, m, n, k, bias):
    """The residual add and RMSNorm folded into the GEMV: equal to fused_add_rms_norm then the
    linear (float32: up to the sums' order; bf16: the norm's output is not rounded to bf16
    before the product, so within bf16's error), the new residual x + residual, the inputs
    unchanged, the counters zero again and a second launch identical."""
    from paged.kernels.gemv import gemv_split_k, split_k_counters
    from paged.model.ops import fused_add_rms_norm

    g = torch.Generator().manual_seed(n + k + config[2])
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    res = (torch.randn(m, k, generator=g) * 3).to(dtype)
    gain = (torch.rand(k, generator=g) + 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    normed, want_res = fused_add_rms_norm(x.float(), res.float(), gain.float(), 1e-5)
    want = torch.nn.functional.linear(normed, w.float(), b.float() if bias else None)
    counters = torch.zeros(split_k_counters(n, m, config), dtype=torch.int32, device=device)
    dx, dres = x.to(device), res.to(device)
    args = (dx, w.to(device), b.to(device) if bias else None, config, counters)
    norm = (dres, gain.to(device), 1e-5)
    out, new_res = gemv_split_k(*args, norm=norm)
    _close(out.cpu(), want.to(dtype), 2e-5 if dtype == torch.float32 else 3e-2)
    if dtype == torch.float32:
        assert torch.equal(new_res.cpu(), want_res)
    else:  # one bf16 step: the interpreter's float32 -> bf16 cast truncates
        _close(new_res.cpu(), want_res.to(dtype), 2**-7)
    assert torch.equal(dx.cpu(), x) and torch.equal(dres.cpu(), res)
    assert int(counters.abs().sum()) == 0
    again = gemv_split_k(*args, norm=norm)
    assert torch.equal(again[0], out) and torch.equal(again[1], new_res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(4, 32, 1, 2), (8, 32, 3, 4)])
@pytest.mark.parametrize("m, n, k, bias", [(1, 48, 256, False), (2, 37, 200, True)])
def test_split_k_gemv_with_silu_and_mul_before_it(device, dtype, config, m, n, k, bias):
    """SiLU-and-mul folded into the GEMV (a dense MLP's down projection): the same bits as the
    silu_and_mul kernel, then the GEMV on its output; near the torch reference; the counters
    zero again."""
    from paged.kernels import silu_and_mul
    from paged.kernels.gemv import gemv_split_k, split_k_counters
    from paged.model import ops

    g = torch.Generator().manual_seed(n + k + config[2])
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    counters = torch.zeros(split_k_counters(n, m, config), dtype=torch.int32, device=device)
    dw, db, dx = w.to(device), b.to(device) if bias else None, gate_up.to(device)
    got = gemv_split_k(dx, dw, db, config, counters, silu_mul=True)
    assert int(counters.abs().sum()) == 0
    assert torch.equal(got, gemv_split_k(silu_and_mul(dx), dw, db, config, counters))
    want = torch.nn.functional.linear(ops.silu_and_mul(gate_up.float()), w.float(),
                                      b.float() if bias else None)  # fmt: skip
    _close(got.cpu(), want.to(dtype), 2e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("op", ["none", "norm", "silu"])
@pytest.mark.parametrize("config", [(4, 32, 1, 2), (8, 64, 3, 4)])
@pytest.mark.parametrize("m, n, k, bias", [(1, 48, 256, False), (2, 37, 200, True)])
def test_split_k_gemv_with_fp8_weights_only(device, op, config, m, n, k, bias):
    """Weight-only fp8 (`scale`): the sums of the fp8 weight's values times the unquantized
    input, scaled per row, then the bias: the same bits as the GEMV on the weight's float32
    values scaled after it (float32), near the dequantized linear; with the norm or SiLU-and-mul
    folded in as for 16-bit weights."""
    from paged.kernels.gemv import gemv_split_k, split_k_counters
    from paged.model import ops

    g = torch.Generator().manual_seed(n + k + config[2])
    q, s = ref.quantize_fp8_rows(torch.randn(n, k, generator=g) * 0.1)
    x = torch.randn(m, 2 * k if op == "silu" else k, generator=g)
    res, gain = torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5
    b = torch.randn(n, generator=g) if bias else None
    counters = torch.zeros(split_k_counters(n, m, config), dtype=torch.int32, device=device)
    norm = (res.to(device), gain.to(device), 1e-5) if op == "norm" else None
    dx, db = x.to(device), b.to(device) if bias else None

    def run(w, scale):
        out = gemv_split_k(dx, w.to(device), None if scale is None else db, config, counters,
                           norm, op == "silu", scale)  # fmt: skip
        return (out[0] if norm else out).cpu()

    got = run(q, s.to(device))
    assert got.dtype == torch.float32 and int(counters.abs().sum()) == 0
    unscaled = run(q.float(), None)
    assert torch.equal(got, unscaled * s.view(1, n) + (b if bias else 0))
    if op == "norm":
        inp = ops.fused_add_rms_norm(x, res, gain, 1e-5)[0]
    else:
        inp = ops.silu_and_mul(x) if op == "silu" else x
    want = torch.nn.functional.linear(inp, q.float() * s, b)
    _close(got, want, 2e-5)
