"""The batched LoRA Triton kernels (paged.kernels.lora) against the grouped torch path
(paged.model.ops) and a per-token reference, in the interpreter on CPU: tiny shapes."""

import numpy as np
import pytest
import torch

from paged.kernels import lora_expand, lora_shrink
from paged.lora.batch import LoRABatch, buffer_size, pack
from paged.model import ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def batch_for(token_slot: list[int], slots: int, device) -> LoRABatch:
    """Tokens grouped by slot as LoRAManager.prepare lays them out (-1: no adapter), in a
    buffer whose tail holds stale ids (as the static buffer does after a larger step)."""
    host, starts = pack(np.asarray(token_slot, dtype=np.int64), slots)
    buf = torch.full((buffer_size(slots, len(token_slot) + 5),), 7, dtype=torch.long)
    buf[: len(host)] = torch.from_numpy(host)
    batch = LoRABatch.on(buf.to(device), slots)
    batch.starts_host = starts
    return batch


# a mix; none with an adapter; an empty slot between two runs (20 rows: two 16-row blocks);
# 600 tokens: 64-row blocks
SLOTS = [[0, 1, -1, 0, 2, 1, -1], [-1, -1], [2] * 20 + [0] * 3, [i % 4 - 1 for i in range(600)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_slot", SLOTS, ids=["mix", "none", "gap", "long"])
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
