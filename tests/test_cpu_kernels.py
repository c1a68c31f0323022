"""The CPU plugin's own kernels against torch references: the C++ paged decode attention,
oneDNN-packed linears, the GGUF block linears with 8-bit activations (blocks read back from
the default model) and the fused bfloat16 elementwise ops."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from paged.model.attention import AttentionMetadata
from paged_cpu.attention import CpuAttentionBackend
from paged_cpu.fused_ops import fused_ops
from paged_cpu.linear import (
    GgufBlockLinear,
    PackedLinear,
    gguf_blocks_available,
    packing_available,
)
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


def test_backend_native_matches_torch_ops():
    """A mixed step (decodes, a prefill chunk over cached context, a fresh prompt) through
    CpuAttentionBackend with and without the C++ kernel: the same output and cache."""
    native_or_skip()
    torch.manual_seed(0)
    hq, hk, d, bs, nblocks = 8, 2, 32, 16, 32
    args = (hq, hk, d, d**-0.5, bs, torch.float32, torch.device("cpu"))
    with_native = CpuAttentionBackend(*args)
    plain = CpuAttentionBackend(*args, native=False)  # --no-cpu-native
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


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_matches_linear():
    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16()
    packed = PackedLinear(w, b)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(packed(x), F.linear(x, w, b), atol=3e-2, rtol=2e-2)


needs_vnni = pytest.mark.skipif(
    not gguf_blocks_available(), reason="no C++ kernels or no AVX-512 VNNI/BF16 here"
)


def block_reference(x, codes, d, m, bias=None):
    """llama.cpp's arithmetic in float64: x quantized per block of 32 to round(x / s), s =
    max|x| / 127; weight = code * d + m per group of K / d.shape[1] (32, or Q6_K's 16)."""
    rows, k = x.shape
    xb = x.double().view(rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = (torch.round(xb.float() * inv.float()).double() * amax / 127).view(rows, k)
    n, groups = d.shape
    w = codes.double().view(n, groups, -1) * d.double()[..., None] + m.double()[..., None]
    y = xq @ w.view(n, k).t()
    return y if bias is None else y + bias.double()


@needs_vnni
@pytest.mark.parametrize("kind, group", [("Q4_1", 32), ("Q8_0", 32), ("Q6_K", 16), ("Q4_1", 16)])
def test_gguf_block_linear_is_llama_cpp_arithmetic(kind, group):
    """Every row count (register tails of 1-3 rows, several row chunks) and an odd number of
    column tiles; a bias; Q8_0's signed codes stored as code + 128 with m = -128 d. Groups of
    16 (two (d, m) pairs a block of 32): Q6_K's 6-bit codes with m = -32 d (8-bit layout),
    and 4-bit codes with a d and m per 16 (the nibble layout's halves)."""
    torch.manual_seed(0)
    n, k = 48, 96
    if kind == "Q4_1":
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d, m = torch.rand(n, k // group) * 0.05, torch.randn(n, k // group) * 0.05
    elif kind == "Q6_K":
        codes = torch.randint(0, 64, (n, k), dtype=torch.uint8)
        d = torch.randn(n, k // group) * 0.01  # d sc: either sign
        m = -32 * d
    else:
        codes = torch.randint(1, 256, (n, k), dtype=torch.uint8)
        d = torch.rand(n, k // group) * 0.01
        m = -128 * d
    bias = torch.randn(n).bfloat16()
    layer = GgufBlockLinear(codes, d, m, bias)
    assert layer.scales.shape[2] == 64 // group  # d and m of each group in a block of 32
    for rows in (1, 2, 3, 4, 5, 64, 67):
        x = torch.randn(rows, k).bfloat16()
        x[0, :32] = 0  # an all-zero block: scale 0
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        ref = block_reference(x, codes, d, m, bias.float())
        torch.testing.assert_close(got.double(), ref, atol=1e-2, rtol=1e-2)
        w = codes.float().view(n, k // group, group) * d[..., None] + m[..., None]
        dense = x.float() @ w.view(n, k).t() + bias.float()  # 8-bit inputs: close, not equal
        assert (got.float() - dense).abs().max() < 0.05 * dense.abs().max()


def test_gguf_blocks_are_the_file_weights(smollm, default_model_path):
    """code * d + m reproduces iter_gguf's dequantization: Q4_1 layers and the Q8_0 embedding
    (the tied output head)."""
    from paged.model.gguf_loader import iter_gguf, iter_gguf_blocks

    cfg = smollm.engine.hf_config
    quant = {name: rest for name, *rest in iter_gguf_blocks(default_model_path, cfg)}
    assert "model.embed_tokens.weight" in quant  # Q8_0
    checked = []
    for name, w in iter_gguf(default_model_path, cfg, progress=False):
        if name in quant and (len(checked) < 4 or "embed" in name):
            codes, d, m = quant[name]
            n, k = codes.shape
            got = codes.reshape(n, k // 32, 32) * d[..., None] + m[..., None]
            torch.testing.assert_close(torch.from_numpy(got.reshape(n, k)), w, atol=1e-6, rtol=0)
            checked.append(name)
            if "model.embed_tokens.weight" in checked and len(checked) >= 4:
                break  # the layers after these are not dequantized
    assert "model.embed_tokens.weight" in checked and len(checked) >= 4


@needs_vnni
def test_default_gguf_in_bf16_computes_from_its_blocks(smollm, default_model_path):
    """In bfloat16 every linear layer of SmolLM2 (and its tied head) runs on the file's blocks,
    and greedy output stays close to the float32 engine, which is token-identical to HF."""
    from paged import LLM, SamplingParams

    llm = LLM(default_model_path, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GgufBlockLinear)]
    assert len(layers) == 4 * llm.engine.hf_config.num_hidden_layers + 1
    assert isinstance(model.lm_head, GgufBlockLinear)
    topics = ["the sea", "bread", "a violin", "winter", "bees", "a clock", "rivers", "chess"]
    chats = [[{"role": "user", "content": f"Write one sentence about {t}."}] for t in topics]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    truth = [o.outputs[0].token_ids for o in smollm.chat(chats, params, use_tqdm=False)]
    prefix = []
    for a, b in zip(ours, truth):
        n = 0
        while n < len(a) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    assert sum(p > 0 for p in prefix) >= 6, prefix  # the first token agrees
    assert sum(prefix) / len(prefix) >= 4, prefix
    assert all(len(set(t)) > 3 for t in ours)  # not a repeated token


@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (19, 72)])
def test_fused_bf16_ops_match_torch_ops(rows, hidden):
    """The C++ norm (with and without the residual add), rotary and SiLU-and-mul give the
    torch ops' bfloat16 results (the norm's float sum may round 1 in 1000 elements apart)."""
    native_or_skip()
    from paged.model import ops
    from paged.model.llama import rope_cache

    fused = fused_ops()
    torch.manual_seed(0)
    x = torch.randn(rows, hidden).bfloat16()
    res = torch.randn(rows, hidden).bfloat16()
    w = (torch.rand(hidden) + 0.5).bfloat16()

    def close(a, b):
        differ = (a != b).float().mean().item()
        assert differ <= 1e-3, differ
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)

    close(fused["rms_norm"](x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    mine = res.clone()
    got, got_res = fused["fused_add_rms_norm"](x, mine, w, 1e-5)
    want, want_res = ops.fused_add_rms_norm(x, res, w, 1e-5)
    assert got_res is mine and torch.equal(got_res, want_res)
    close(got, want)

    class Cfg:
        hidden_size, num_attention_heads, rope_theta = 4 * 64, 4, 10000.0

    cos_sin = rope_cache(Cfg(), 512)
    qkv = torch.randn(rows, 7 * 64).bfloat16()  # q, k, v as views with a row stride
    q, k = qkv[:, : 4 * 64].view(rows, 4, 64), qkv[:, 4 * 64 : 6 * 64].view(rows, 2, 64)
    positions = torch.randint(0, 512, (rows,))
    rope = ops.rotary_prepare(positions, cos_sin, torch.bfloat16)
    want_q, want_k = ops.rotary_embedding(positions, q, k, rope)
    rope = fused["rotary_prepare"](positions, cos_sin, torch.bfloat16)
    got_q, got_k = fused["rotary_embedding"](positions, q, k, rope)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)

    gate_up = torch.randn(rows, 2 * hidden).bfloat16() * 4
    close(fused["silu_and_mul"](gate_up), ops.silu_and_mul(gate_up))
