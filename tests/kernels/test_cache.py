"""reshape_and_cache: scatter into the paged layout, skipping padding slots."""

import pytest
import torch

from paged.kernels import reshape_and_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 3, 16)])
def test_reshape_and_cache(dtype, slot_dtype, heads, kv_heads, head_dim, device):
    gen = torch.Generator().manual_seed(hash((str(dtype), str(slot_dtype), kv_heads)) % 2**31)
    num_blocks, block_size, tokens = 9, 16, 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(device, dtype)  # key/value are strided slices of a fused projection
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 5, 36]] = -1  # padding tokens
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    expect = kv.clone()
    live = slots >= 0
    expect[0].view(-1, kv_heads, head_dim)[slots[live]] = key.cpu()[live]
    expect[1].view(-1, kv_heads, head_dim)[slots[live]] = value.cpu()[live]
    kv = kv.to(device)
    reshape_and_cache(key, value, kv[0], kv[1], slots.to(device, slot_dtype))
    assert torch.equal(kv.cpu(), expect)


def test_empty_batch_is_a_no_op(device):
    kv = torch.zeros(2, 2, 16, 1, 16, device=device)
    empty = torch.empty(0, 1, 16, device=device)
    reshape_and_cache(empty, empty, kv[0], kv[1], torch.empty(0, dtype=torch.int64, device=device))
    assert not kv.any()
