"""The batched LoRA Triton kernels (paged.kernels.lora) against the grouped torch path
(paged.model.ops) and a per-token reference, in the interpreter on CPU: tiny shapes."""

import pytest
import torch

from paged.kernels import lora_expand, lora_shrink
from paged.lora.layers import LoRABatch
from paged.model import ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def batch_for(token_slot: list[int], slots: int, device) -> LoRABatch:
    """Tokens grouped by slot as LoRAManager.prepare lays them out (-1: no adapter), with
    padding after the used part (the static buffer's stale tail)."""
    ts = torch.tensor(token_slot)
    counts = torch.bincount(ts[ts >= 0], minlength=slots)
    starts = torch.zeros(slots + 1, dtype=torch.long)
    starts[1:] = counts.cumsum(0)
    order = torch.argsort(ts, stable=True)[len(ts) - int(starts[-1]) :]
    ids = torch.cat([order, torch.full((5,), 7)])
    return LoRABatch(ids.to(device), starts.to(device), starts.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_slot", [[0, 1, -1, 0, 2, 1, -1], [-1, -1], [2] * 20 + [0] * 3])
# K 1024: the shrink splits K over 4 programs. Slices [32, 16, 16] fall on 16-column blocks
# (one expand launch for all); [24, 8, 8] do not (one launch per slice).
@pytest.mark.parametrize("k, outs", [(40, [24, 8, 8]), (1024, [32, 16, 16]), (40, [48])])
def test_shrink_expand_match_reference(device, dtype, token_slot, k, outs):
    slots, rank = 3, 8
    g = torch.Generator().manual_seed(len(token_slot))
    t = len(token_slot)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    a = (0.3 * torch.randn(slots, len(outs) * rank, k, generator=g) / (k / 40) ** 0.5).to(
        device, dtype
    )
    b = (0.3 * torch.randn(slots, sum(outs), rank, generator=g)).to(device, dtype)
    y0 = torch.randn(t, sum(outs), generator=g).to(device, dtype)
    meta = batch_for(token_slot, slots, device)

    xa = lora_shrink(x, a, meta)
    want_xa = ops.lora_shrink(x, a, meta)
    assert torch.allclose(xa.float(), want_xa.float(), rtol=TOL[dtype], atol=TOL[dtype])
    got, want = y0.clone(), y0.clone()
    lora_expand(got, xa, b, outs, meta)
    ops.lora_expand(want, want_xa, b, outs, meta)
    assert torch.allclose(got.float(), want.float(), rtol=TOL[dtype], atol=2 * TOL[dtype])
    # per token, in float32: y + x A_j^T B_j^T per slice for tokens with a slot, y otherwise
    ref = y0.float().clone()
    bounds = [sum(outs[:j]) for j in range(len(outs) + 1)]
    for i, s in enumerate(token_slot):
        if s < 0:
            continue
        xa_i = x[i].float() @ a[s].float().T
        bs = [b[s, bounds[j] : bounds[j + 1]].float() for j in range(len(outs))]
        ref[i] += torch.cat([xa_i[j * rank : (j + 1) * rank] @ bj.T for j, bj in enumerate(bs)])
    assert torch.allclose(got.float(), ref, rtol=TOL[dtype], atol=4 * TOL[dtype])
    untouched = [i for i, s in enumerate(token_slot) if s < 0]
    assert torch.equal(got[untouched], y0[untouched])
