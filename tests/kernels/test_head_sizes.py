"""Head sizes that are not powers of two (Phi-3's 96, 80, 112): the Triton kernels mask the
head dim to the next power of two; against the float64 reference, tiny shapes (interpreter)."""

import pytest
import torch
from test_attention import TOL, i32, make_cache, reference, rel_err
from test_fused import close, cos_sin_cache, hf_rotary
from tiny_hf import spread_weights

from paged.kernels import (
    paged_attention_decode,
    paged_attention_varlen,
    reshape_and_cache,
    rotary_embedding,
)

HEAD_DIMS = [80, 96]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen(head_dim, dtype, device):
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens, query_lens = [9, 20], [9, 4]  # a prefill and a chunk over cached context
    kv, table = make_cache(seq_lens, 2, head_dim, 8, dtype, gen, device)
    q = torch.randn(sum(query_lens), 4, head_dim, generator=gen).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    qsl = i32([0, 9, 13], device)
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, i32(seq_lens, device), table, 0.1, 9, 20)
    ref = reference(q, kv[0], kv[1], query_lens, seq_lens, table, 0.1)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode(head_dim, num_splits, device):
    gen = torch.Generator().manual_seed(head_dim + num_splits)
    seq_lens = [5, 30]
    kv, table = make_cache(seq_lens, 2, head_dim, 8, torch.float32, gen, device)
    q = torch.randn(2, 4, head_dim, generator=gen).to(device)
    out = torch.full_like(q, float("nan"))
    seq = i32(seq_lens, device)
    paged_attention_decode(q, kv[0], kv[1], out, seq, table, 0.1, 30, num_splits)
    ref = reference(q, kv[0], kv[1], [1, 1], seq_lens, table, 0.1)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cache_write_stays_in_its_head(head_dim, device):
    """The masked tail of a head must not spill into the next head or slot."""
    gen = torch.Generator().manual_seed(head_dim)
    k = torch.randn(3, 2, head_dim, generator=gen).to(device)
    v = torch.randn(3, 2, head_dim, generator=gen).to(device)
    cache = torch.full((2, 2, 4, 2, head_dim), float("nan"), device=device)
    slots = torch.tensor([5, -1, 2], device=device)
    reshape_and_cache(k, v, cache[0], cache[1], slots)
    flat = cache.view(2, 8, 2, head_dim)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 5], v[0])
    assert torch.equal(flat[0, 2], k[2]) and torch.equal(flat[1, 2], v[2])
    untouched = [s for s in range(8) if s not in (2, 5)]
    assert flat[:, untouched].isnan().all()


@pytest.mark.parametrize("head_dim,rot_dim", [(80, 80), (96, 96), (96, 48)])
def test_rotary(head_dim, rot_dim, device):
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    q = torch.randn(3, 4, head_dim, generator=gen).to(device)
    k = torch.randn(3, 2, head_dim, generator=gen).to(device)
    positions = torch.tensor([0, 7, 31], device=device)
    cache = cos_sin_cache(32, rot_dim).to(device)
    expect_q = hf_rotary(positions, q, cache, head_dim)
    expect_k = hf_rotary(positions, k, cache, head_dim)
    rotary_embedding(positions, q, k, cache, head_dim)
    assert close(q, expect_q, torch.float32) and close(k, expect_k, torch.float32)


def test_unsupported_head_size_is_refused_before_a_kernel(device):
    from paged.kernels.backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="head size 512"):
        TritonAttentionBackend(4, 2, 512, 0.1, 16, torch.float32, torch.device(device))
    for head_dim in (64, 80, 96, 112, 128, 256):  # accepted
        TritonAttentionBackend(4, 2, head_dim, 0.1, 16, torch.float32, torch.device(device))


@pytest.fixture(scope="module")
def odd_head_models(tmp_path_factory) -> dict[int, str]:
    """Tiny random Llamas with head size 80 (an explicit head_dim) and 96 (hidden / heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("odd-heads")
    shapes = {
        80: dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=80),
        96: dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1),
    }
    paths = {}
    for head_dim, shape in shapes.items():
        cfg = LlamaConfig(**shape, intermediate_size=128, num_hidden_layers=2, vocab_size=320,
                          max_position_embeddings=256, bos_token_id=0, eos_token_id=1)  # fmt: skip
        torch.manual_seed(head_dim)
        model = LlamaForCausalLM(cfg)
        spread_weights(model)
        assert model.model.layers[0].self_attn.head_dim == head_dim
        paths[head_dim] = str(root / f"head{head_dim}")
        model.save_pretrained(paths[head_dim], safe_serialization=True)
    return paths


@pytest.mark.parametrize("head_dim,native", [(80, True), (96, True), (96, False)])
def test_cpu_platform_matches_hf(odd_head_models, head_dim, native):
    """The cpu platform (C++ decode kernel, or torch ops) at head sizes 80 and 96: greedy
    output token-identical to HF transformers, through prefix-cache hits and chunked prefill."""
    from test_hf_parity import hf_greedy
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams

    path = odd_head_models[head_dim]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, platform="cpu", dtype="float32", kv_cache_memory="4MiB", block_size=16,
              max_num_batched_tokens=32, cpu_native=native)  # fmt: skip
    g = torch.Generator().manual_seed(head_dim)
    shared = torch.randint(2, 320, (40,), generator=g).tolist()  # > one chunk, shared blocks
    prompts = [shared + [5, 6], shared + [7], torch.randint(2, 320, (9,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:1]]  # cache filled
    outs += llm.generate(prompts[1:], params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)


def test_rocm_tiles_size_the_padded_head():
    """ROCm's LDS-sized tiles count a 96-wide head as the 128 lanes its tiles occupy."""
    from paged_rocm.tiles import choose_tiles

    for lds in (64 * 1024, 160 * 1024):
        assert choose_tiles(96, 2, lds, 64) == choose_tiles(128, 2, lds, 64)
        assert choose_tiles(80, 2, lds, 64) == choose_tiles(128, 2, lds, 64)
