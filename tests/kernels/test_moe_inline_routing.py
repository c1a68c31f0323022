"""fused_moe_from_logits: at decode sizes the routing runs inside the two expert GEMVs; the
output must equal moe_route then fused_moe to the bit (the interpreter on CPU: tiny shapes,
12 experts, top 8, so 4 tokens fill GEMV_MAX_PAIRS). The GPU op table does not use this
kernel (34.1 against 27.7 us for moe_route + fused_moe at one token on an H200,
bench/moe_kernel.py --inline-routing); it is kept and tested."""

import pytest
import torch

from paged.kernels.moe import GEMV_MAX_PAIRS, fused_moe, fused_moe_from_logits
from paged.kernels.moe_routing import moe_route

EXPERTS, TOP_K, HIDDEN, INTER = 12, 8, 10, 6  # sizes that are not multiples of the tiles
AT = GEMV_MAX_PAIRS // TOP_K  # the most tokens routed inline


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaN equals NaN)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def experts(dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = 0.2 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)
    return w13.to(dtype), (0.2 * torch.randn(EXPERTS, HIDDEN, INTER, generator=g)).to(dtype)


def both(x, w13, w2, logits, renormalize, weight_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(inline routing, the routing kernel then fused_moe)."""
    got = fused_moe_from_logits(x, w13, w2, logits, TOP_K, renormalize, weight_dtype)
    want = fused_moe(x, w13, w2, *moe_route(logits, TOP_K, renormalize, weight_dtype))
    return got, want


# (model dtype, routing weights' dtype, renormalise): Qwen3-30B-A3B's; bf16 with unnormalised
# float32 weights; float32
CASES = [(torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, None, False),
         (torch.float32, None, True)]  # fmt: skip


@pytest.mark.parametrize("dtype, weight_dtype, renormalize", CASES)
@pytest.mark.parametrize("tokens", [1, 2, AT, AT + 1])  # the last: moe_route, grouped GEMM
def test_inline_routing_is_bit_identical(device, dtype, weight_dtype, renormalize, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(device, dtype)
    logits = (2 * torch.randn(tokens, EXPERTS, generator=g)).to(device, dtype)
    w13, w2 = (w.to(device) for w in experts(dtype))
    got, want = both(x, w13, w2, logits, renormalize, weight_dtype)
    assert got.shape == want.shape == x.shape and got.dtype == dtype
    assert torch.equal(bits(got), bits(want))


def test_ties_lowest_expert_first(device):
    """Equal logits: the lowest ids first (a stable descending sort), inline as in the kernel."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (AT, EXPERTS), generator=g).float()
    logits[0] = 0.5  # every expert ties
    x = torch.randn(AT, HIDDEN, generator=g).to(device, torch.bfloat16)
    logits = logits.to(device, torch.bfloat16)
    w13, w2 = (w.to(device) for w in experts(torch.bfloat16))
    _, ids = moe_route(logits, TOP_K, True, torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(ids, probs.sort(dim=-1, descending=True, stable=True).indices[:, :TOP_K])
    got, want = both(x, w13, w2, logits, True, torch.bfloat16)
    assert torch.equal(bits(got), bits(want))


def test_nan_logits_route_to_real_experts(device):
    """A NaN row and a row with one NaN: experts that exist, the same bits both ways, and the
    other tokens' outputs untouched."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, EXPERTS, generator=g)
    logits[0] = float("nan")
    logits[1, 5] = float("nan")
    logits = logits.to(device)
    x = torch.randn(3, HIDDEN, generator=g).to(device)
    w13, w2 = (w.to(device) for w in experts(torch.float32))
    _, ids = moe_route(logits, TOP_K, True, None)
    assert int(ids.min()) >= 0 and int(ids.max()) < EXPERTS
    got, want = both(x, w13, w2, logits, True, None)
    assert torch.equal(bits(got), bits(want))
    alone = fused_moe_from_logits(x[2:], w13, w2, logits[2:], TOP_K, True, None)
    assert torch.equal(got[2:], alone) and not alone.isnan().any()


def test_no_tokens(device):
    x, logits = torch.zeros(0, HIDDEN, device=device), torch.zeros(0, EXPERTS, device=device)
    w13, w2 = (w.to(device) for w in experts(torch.float32))
    assert fused_moe_from_logits(x, w13, w2, logits, TOP_K, True, None).shape == (0, HIDDEN)
