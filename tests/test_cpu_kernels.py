"""The CPU plugin's own kernels against torch references: the C++ paged decode attention,
oneDNN-packed linears, and the GGUF 4-bit linears (codes read back from the default model)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from paged.model.attention import AttentionMetadata
from paged_cpu.attention import CpuAttentionBackend
from paged_cpu.linear import Int4DualLinear, PackedLinear, packing_available
from paged_cpu.native import kernels


def native_or_skip():
    k = kernels()
    if k is None:
        assert not os.environ.get("CI"), "the C++ kernels must build in CI (g++ and ninja)"
        pytest.skip("no C++ compiler here")
    return k


def reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """Per request: softmax(q K^T) V over its context, float32, K/V gathered per token."""
    h, _, bs, d = k_cache.shape
    group = q.shape[1] // h
    out = torch.empty(q.shape, dtype=torch.float32)
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[r, pos // bs].long()
        kr = k_cache[:, blocks, pos % bs].float()  # [h, n, d]
        vr = v_cache[:, blocks, pos % bs].float()
        qr = q[r].float().view(h, group, d)
        p = (qr @ kr.transpose(1, 2) * scale).softmax(-1)
        out[r] = (p @ vr).reshape(h * group, d)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 64), (9, 3, 64), (4, 2, 128), (6, 1, 32)])
def test_native_paged_decode(dtype, heads):
    """Register kernels (head_dim 64/128, groups 1-4) and the generic loop (the rest)."""
    native = native_or_skip()
    g = torch.Generator().manual_seed(0)
    hq, hk, d = heads
    bs, nblocks = 16, 40
    lens = torch.tensor([1, 15, 16, 17, 33, 100], dtype=torch.int32)  # block boundaries
    reqs = len(lens)
    k_cache = torch.randn(hk, nblocks, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(hk, nblocks, bs, d, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(reqs, 8, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        tables[r, :nb] = perm[used : used + nb].int()
        used += nb
    # The new token of each request is written first, at its last position.
    slots = torch.tensor(
        [int(tables[r, (n - 1) // bs]) * bs + (n - 1) % bs for r, n in enumerate(lens.tolist())]
    )
    q = torch.randn(reqs, hq, d, generator=g).to(dtype)
    k = torch.randn(reqs, hk, d, generator=g).to(dtype)
    v = torch.randn(reqs, hk, d, generator=g).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(hk, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    want_v.view(hk, -1, d).index_copy_(1, slots, v.transpose(0, 1))
    out = torch.zeros_like(q)
    native.paged_decode(q, k, v, k_cache, v_cache, slots, tables, lens, out, reqs, d**-0.5)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    ref = reference_decode(q, want_k, want_v, tables, lens, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_backend_native_matches_torch_ops(monkeypatch):
    """A mixed step (decodes, a prefill chunk over cached context, a fresh prompt) through
    CpuAttentionBackend with and without the C++ kernel: the same output and cache."""
    native_or_skip()
    torch.manual_seed(0)
    hq, hk, d, bs, nblocks = 8, 2, 32, 16, 32
    args = (hq, hk, d, d**-0.5, bs, torch.float32, torch.device("cpu"))
    with_native = CpuAttentionBackend(*args)
    monkeypatch.setattr("paged_cpu.native.kernels", lambda: None)
    plain = CpuAttentionBackend(*args)
    assert with_native.native is not None and plain.native is None
    cache = torch.randn(with_native.kv_cache_shape(nblocks))
    # requests: 2 decodes (contexts 20, 33), a 7-token chunk after 16 cached, a 5-token prompt
    q_lens, seq_lens = [1, 1, 7, 5], [20, 33, 23, 5]
    tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 6, 0], [7, 0, 0]], dtype=torch.int32)
    slots = []
    for ql, sl, row in zip(q_lens, seq_lens, tables.tolist()):
        slots += [row[p // bs] * bs + p % bs for p in range(sl - ql, sl)]
    t = sum(q_lens)
    meta = AttentionMetadata(
        num_reqs=4,
        num_decodes=2,
        num_tokens=t,
        query_start_loc=torch.tensor([0, 1, 2, 9, 14], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
        max_query_len=7,
        max_seq_len=33,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    outs, caches = [], []
    for backend in (with_native, plain):
        c = cache.clone()
        outs.append(backend.forward(q, k, v, c, backend.plan(meta)))
        caches.append(c)
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")
def test_packed_linear_matches_linear():
    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16()
    packed = PackedLinear(w, b)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(packed(x), F.linear(x, w, b), atol=3e-2, rtol=2e-2)


def test_int4_linear_is_the_gguf_weight():
    """code * d + m is the weight, on both the 4-bit path (few rows) and the dense one."""
    torch.manual_seed(0)
    n, k = 48, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d, m = torch.rand(n, k // 32) * 0.05, torch.randn(n, k // 32) * 0.05
    w = (codes.view(n, k // 32, 32).float() * d[..., None] + m[..., None]).view(n, k)
    dense = torch.nn.Linear(k, n, bias=False)
    dense.weight.data = w.bfloat16()
    layer = Int4DualLinear(dense, codes, d, m)
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, k).bfloat16()
        ref = x.float() @ w.t()
        torch.testing.assert_close(layer(x).float(), ref, atol=5e-2, rtol=2e-2)


def test_default_gguf_keeps_its_4bit_codes(default_model_path):
    """Every Q4_1 linear of SmolLM2 reads its codes; they reproduce the dequantized file."""
    from paged import LLM

    default_model = default_model_path
    llm = LLM(default_model, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int4DualLinear)]
    assert len(layers) == 4 * llm.engine.hf_config.num_hidden_layers
    from paged.model.gguf_loader import iter_gguf, iter_gguf_q4

    cfg = llm.engine.hf_config
    quant = {name: rest for name, *rest in iter_gguf_q4(default_model, cfg)}
    checked = 0
    for name, w in iter_gguf(default_model, cfg, progress=False):
        if name in quant and checked < 4:
            codes, d, m = quant[name]
            n, k = codes.shape
            got = codes.reshape(n, k // 32, 32) * d[..., None] + m[..., None]
            torch.testing.assert_close(torch.from_numpy(got.reshape(n, k)), w, atol=1e-6, rtol=0)
            checked += 1
    assert checked == 4
