"""The MoE norm fold: at decode, where the router runs on the one-row GEMV, the residual add and
RMSNorm before a mixture of experts fold into the router's GEMV and the experts' gate/up GEMV
(fused_moe_from_logits' `norm`; no norm kernel). Against the unfused arithmetic (the norm, then
the layer): float32 up to the order of the sums, bfloat16 within its rounding (the folded input
is not rounded to bf16); the new residual is x + residual; the inputs are not changed.

The kernels are kept, but the GPU op table does not use them (add_rms_norm_moe stays the
default, the norm kernel and then the layer): measured slower on an H200 (40.7 against 40.0 us,
bench/moe_kernel.py --inline-routing)."""

import pytest
import torch

from paged.kernels.gemv import OneRowGemv
from paged.kernels.moe import GEMV_MAX_PAIRS, fused_moe_from_logits
from paged.model import ops
from paged.model.moe import SparseMoE

# hidden: two gate/up K steps (the second masked), several of the router's; top 8 of 12
EXPERTS, TOP_K, HIDDEN, INTER, EPS = 12, 8, 136, 6, 1e-6
AT = GEMV_MAX_PAIRS // TOP_K  # the most tokens routed inline


def inputs(tokens: int, dtype, device, seed: int = 0):
    """(x, residual, gain): a residual stream much larger than the layer's input, as in a model."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    residual = 4 * torch.randn(tokens, HIDDEN, generator=g)
    gain = torch.rand(HIDDEN, generator=g) + 0.5
    return (t.to(device, dtype) for t in (x, residual, gain))


def experts(dtype, device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = 0.2 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)
    w2 = 0.2 * torch.randn(EXPERTS, HIDDEN, INTER, generator=g)
    return w13.to(device, dtype), w2.to(device, dtype)


def exact_norm(x, residual, gain) -> torch.Tensor:
    """rms_norm(x + residual) * gain in float64, the sum rounded as the model's add rounds it."""
    s = (x + residual).double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * gain.double()


def exact(x, residual, gain, w13, w2, logits) -> torch.Tensor:
    """The layer in float64 on the unrounded normed input, routed as moe_route routes."""
    weights, ids = ops.moe_route(logits, TOP_K, True, None)
    normed = exact_norm(x, residual, gain)
    return ops.fused_moe(normed, w13.double(), w2.double(), weights.double(), ids)


def check_close(got, want, ref) -> None:
    """float32: equal up to the order of the sums; bf16: no further from the float64 layer
    than the unfused path is, within a rounding of the output's scale."""
    scale = ref.abs().max().item()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
        return
    err, err_unfused = ((t.double() - ref).abs().max().item() for t in (got, want))
    assert err <= max(2 * err_unfused, 2**-8 * scale), (err, err_unfused, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the last: the norm, then the GEMMs; 2 tokens (10 s a dtype, interpreted) with the long checks
@pytest.mark.parametrize("tokens", [1, pytest.param(2, marks=pytest.mark.slow), AT + 1])
def test_folded_experts_match_the_norm_then_the_layer(device, dtype, tokens):
    x, residual, gain = inputs(tokens, dtype, device, seed=tokens)
    w13, w2 = experts(dtype, device)
    logits = 2 * torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(9))
    logits = logits.to(device, dtype)
    x0, r0 = x.clone(), residual.clone()
    got = fused_moe_from_logits(x, w13, w2, logits, TOP_K, True, dtype, norm=(residual, gain, EPS))
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    normed, _ = ops.fused_add_rms_norm(x, residual, gain, EPS)
    want = fused_moe_from_logits(normed, w13, w2, logits, TOP_K, True, dtype)
    assert got.shape == want.shape == x.shape and got.dtype == dtype
    check_close(got, want, exact(x, residual, gain, w13, w2, logits))


def moe_layer(dtype, device, gemv: bool) -> SparseMoE:
    """Qwen3-MoE's routing (renormalised, weights in the model dtype); the router on the
    one-row GEMV when `gemv` (as the CUDA plugin's gemv_select installs it)."""
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, True, True)
    w13, w2 = experts(dtype, device)
    g = torch.Generator().manual_seed(2)
    router = (0.3 * torch.randn(EXPERTS, HIDDEN, generator=g)).to(device, dtype)
    moe = moe.to(device, dtype).requires_grad_(False)
    moe.w13.copy_(w13)
    moe.w2.copy_(w2)
    moe.gate.weight.copy_(router)
    if gemv:
        counters = torch.zeros(16, dtype=torch.int32, device=device)
        moe.gate.forward = OneRowGemv(moe.gate, (4, 32, 2, 4), counters)
    return moe


@pytest.fixture
def spies(monkeypatch) -> dict[str, list]:
    """Calls of the folded kernels (whether they got the norm, whether the experts' GEMV
    routed its token itself) and of the norm kernels and the routing kernel."""
    from paged import kernels
    from paged.kernels import gemv, moe, moe_routing

    calls: dict[str, list] = {"router": [], "gate_up": [], "inline": [], "norm": [],
                              "add_norm": [], "route": []}  # fmt: skip
    split_k, gate_up, norm_kernel = gemv.gemv_split_k, moe._gate_up, moe.rms_norm
    add_norm, route = kernels.fused_add_rms_norm, moe_routing.moe_route

    def spy_split_k(*args):
        calls["router"].append(args[5] is not None)
        return split_k(*args)

    def spy_gate_up(*args, norm=None, route=None, **kw):
        calls["gate_up"].append(norm is not None)
        calls["inline"].append(route is not None)
        return gate_up(*args, norm=norm, route=route, **kw)

    def spy_norm(*args):
        calls["norm"].append(1)
        return norm_kernel(*args)

    def spy_add_norm(x, *args):
        calls["add_norm"].append(len(x))
        return add_norm(x, *args)

    def spy_route(logits, *args):
        calls["route"].append(len(logits))
        return route(logits, *args)

    monkeypatch.setattr(gemv, "gemv_split_k", spy_split_k)
    monkeypatch.setattr(moe, "_gate_up", spy_gate_up)
    monkeypatch.setattr(moe, "rms_norm", spy_norm)
    monkeypatch.setattr(kernels, "fused_add_rms_norm", spy_add_norm)  # before the table reads it
    monkeypatch.setattr(moe_routing, "moe_route", spy_route)
    return calls


def check_sum(got: torch.Tensor, want: torch.Tensor) -> None:
    """The new residual: x + residual to the bit, but for the interpreter's float32 -> bf16
    cast, which truncates (one bf16 step)."""
    if got.dtype == torch.float32 or got.device.type != "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_fold_the_norm_at_decode(device, dtype, spies):
    """One row, the router on the GEMV given the norm and the experts' GEMVs given it too (no
    norm kernel): against the norm kernel, then the router and the experts on the same
    kernels (and in float32 the torch default too)."""
    from functools import partial

    from paged.kernels import fused_add_rms_norm

    moe = moe_layer(dtype, device, gemv=True)
    x, residual, gain = inputs(1, dtype, device, seed=3)
    x0, r0 = x.clone(), residual.clone()
    with torch.no_grad():
        norm = (residual, gain, EPS)
        logits, new_residual = moe.gate.forward(x, norm=norm)
        got = moe.from_logits(x, logits, partial(fused_moe_from_logits, norm=norm))
        assert {k: spies[k] for k in ("router", "gate_up", "norm")} == {
            "router": [True], "gate_up": [True], "norm": []}  # folded: no norm  # fmt: skip
        assert torch.equal(x, x0) and torch.equal(residual, r0)
        normed, want_residual = fused_add_rms_norm(x.clone(), residual.clone(), gain, EPS)
        check_sum(new_residual, want_residual)
        want = moe.from_logits(normed, moe.gate(normed), fused_moe_from_logits)
        # the router's logits, folded and not, route as the exact ones do
        exact_logits = exact_norm(x, residual, gain) @ moe.gate.weight.double().t()
        ids = [ops.moe_route(lg, TOP_K, True, None)[1]
               for lg in (exact_logits, logits, moe.gate(normed))]  # fmt: skip
        assert all(torch.equal(i, ids[0]) for i in ids)
        check_close(got, want, exact(x, residual, gain, moe.w13, moe.w2, exact_logits))
        if dtype == torch.float32:
            default, default_residual = ops.add_rms_norm_moe(x, residual, gain, EPS, moe)
            assert torch.equal(default_residual, new_residual)
            check_close(got, default, exact(x, residual, gain, moe.w13, moe.w2, exact_logits))


@pytest.mark.parametrize("gemv, tokens", [(True, 1), (False, 1), (True, 2)])
def test_the_op_table_runs_the_norm_kernel_then_the_layer(device, gemv, tokens, spies):
    """The GPU op table leaves add_rms_norm_moe and fused_moe_from_logits to their defaults
    (the folded and inline-routed decode paths measured slower on an H200): the norm kernel,
    the router unfolded, the routing kernel, then fused_moe's GEMVs without routing; to the
    bit those kernels run one after the other."""
    from paged import kernels
    from paged.kernels.moe_routing import moe_route
    from paged.kernels.ops import triton_fused_ops

    table = triton_fused_ops()
    assert "add_rms_norm_moe" not in table and "fused_moe_from_logits" not in table
    moe = moe_layer(torch.float32, device, gemv=gemv)
    x, residual, gain = inputs(tokens, torch.float32, device, seed=4)
    with ops.using(table), torch.no_grad():
        got = ops.get("add_rms_norm_moe")(x.clone(), residual.clone(), gain, EPS, moe)
        assert spies["router"] == ([False] if gemv and tokens == 1 else [])  # the GEMV: unfolded
        assert spies["add_norm"] == [tokens] and spies["route"] == [tokens]
        assert spies["gate_up"] == spies["inline"] == [False] and spies["norm"] == []
        normed, new_residual = kernels.fused_add_rms_norm(x.clone(), residual.clone(), gain, EPS)
        weights, ids = moe_route(moe.gate(normed), TOP_K, True, torch.float32)
        want = kernels.fused_moe(normed, moe.w13, moe.w2, weights, ids)
    assert torch.equal(got[0], want) and torch.equal(got[1], new_residual)
