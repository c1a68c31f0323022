"""Per-layer sliding window and logit softcap in the Triton kernels (interpreter, tiny
shapes) against a float64 reference with HF's semantics: query i sees keys j with
i - window < j <= i; scores become cap * tanh(scores / cap) before the softmax."""

import pytest
import torch
from test_attention import TOL, i32, make_cache, rel_err

from paged.kernels import paged_attention_decode, paged_attention_varlen


def reference(q, kv, query_lens, seq_lens, table, scale, window=None, softcap=None):
    q, kv, table = q.cpu(), kv.cpu(), table.cpu()
    block_size, kv_heads, d = kv.shape[2], kv.shape[3], kv.shape[4]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = table[b, : -(-sl // block_size)].long()
        k, v = (kv[i][blocks].reshape(-1, kv_heads, d)[:sl].double() for i in (0, 1))
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start : start + ql].double(), k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        q_pos = (sl - ql + torch.arange(ql))[:, None]
        keys = torch.arange(sl)[None, :]
        hidden = keys > q_pos
        if window is not None:
            hidden |= keys <= q_pos - window
        s = s.masked_fill(hidden, float("-inf"))
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += ql
    return out


CASES = [(20, None), (None, 5.0), (7, 2.0), (1, None)]


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen(window, softcap, dtype, device):
    gen = torch.Generator().manual_seed(3)
    # A whole prefill, a chunk over a long cached context (whole tiles fall out of the
    # window) and a short one; BLOCK_N 16 so the skipped and the partial tiles both occur.
    seq_lens, query_lens = [70, 90, 6], [70, 9, 3]
    kv, table = make_cache(seq_lens, 2, 32, 8, dtype, gen, device)
    q = torch.randn(sum(query_lens), 4, 32, generator=gen).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    qsl = i32([0, 70, 79, 82], device)
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, i32(seq_lens, device), table, 0.3, 70, 90,
                           block_m=16, block_n=16, window=window, softcap=softcap)  # fmt: skip
    ref = reference(q, kv, query_lens, seq_lens, table, 0.3, window, softcap)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]
    plain = reference(q, kv, query_lens, seq_lens, table, 0.3)
    assert rel_err(out, plain) > 10 * TOL[dtype]  # the option changed the result


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(window, softcap, num_splits, device):
    gen = torch.Generator().manual_seed(num_splits)
    seq_lens = [5, 100, 21]
    kv, table = make_cache(seq_lens, 2, 32, 8, torch.float32, gen, device)
    q = torch.randn(3, 4, 32, generator=gen).to(device)
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, kv[0], kv[1], out, i32(seq_lens, device), table, 0.3, 100,
                           num_splits, block_n=16, window=window, softcap=softcap)  # fmt: skip
    ref = reference(q, kv, [1, 1, 1], seq_lens, table, 0.3, window, softcap)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.float32]


def test_backend_refuses_what_it_cannot_run():
    """A backend without window/softcap support refuses at start-up, naming itself."""
    from paged.model.attention import AttentionBackend, layer_options

    backend = AttentionBackend(4, 2, 32, 32**-0.5, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="'base' does not support window=8"):
        layer_options(backend, window=8)
    with pytest.raises(ValueError, match="'base' does not support softcap=50.0"):
        layer_options(backend, softcap=50.0)
    opts, q_mult = layer_options(backend, scale=0.25)  # folded into q instead
    assert opts == {} and q_mult == pytest.approx(0.25 / 32**-0.5)


def release_out_of_window(kv, table, seq_lens, query_lens, window):
    """The cache and table as the KV manager leaves them: blocks wholly before the window of a
    sequence's first query point to a released block, here filled with NaN (reading one would
    poison the output)."""
    bs = kv.shape[2]
    poisoned = torch.full_like(kv[:, :1], float("nan"))
    kv = torch.cat([kv, poisoned], 1)
    table = table.clone()
    for b, (sl, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table[b, : max(sl - ql - window + 1, 0) // bs] = kv.shape[1] - 1
    return kv, table


@pytest.mark.parametrize("window,block_n", [(20, 16), (7, 16), (7, 64)])
def test_released_blocks_are_never_read(window, block_n, device):
    """block_n 64 > window: the causal-diagonal tile starts below the window."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, query_lens = [70, 90, 6], [70, 9, 3]
    kv, table = make_cache(seq_lens, 2, 32, 8, torch.float32, gen, device)
    q = torch.randn(sum(query_lens), 4, 32, generator=gen).to(device)
    ref = reference(q, kv, query_lens, seq_lens, table, 0.3, window)
    kv_r, table_r = release_out_of_window(kv, table, seq_lens, query_lens, window)
    assert (table_r == kv_r.shape[1] - 1).any()
    out = torch.full_like(q, float("nan"))
    qsl = i32([0, 70, 79, 82], device)
    paged_attention_varlen(q, kv_r[0], kv_r[1], out, qsl, i32(seq_lens, device), table_r, 0.3,
                           70, 90, block_m=16, block_n=block_n, window=window)  # fmt: skip
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.float32]

    seq_lens = [5, 100, 21]
    kv, table = make_cache(seq_lens, 2, 32, 8, torch.float32, gen, device)
    q = torch.randn(3, 4, 32, generator=gen).to(device)
    ref = reference(q, kv, [1, 1, 1], seq_lens, table, 0.3, window)
    kv_r, table_r = release_out_of_window(kv, table, seq_lens, [1, 1, 1], window)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(q, kv_r[0], kv_r[1], out, i32(seq_lens, device), table_r, 0.3,
                               100, splits, block_n=block_n, window=window)  # fmt: skip
        assert not out.isnan().any()
        assert rel_err(out, ref) < TOL[torch.float32]


def test_engine_releases_window_blocks_on_triton(tmp_path, engines_on, interpreter_only):
    """The engine on the Triton backend (interpreted), every layer windowed: blocks out of the
    window are released (null block, here NaN, in the table) while chunked prefill and decode
    run; greedy tokens equal HF's."""
    from test_hf_parity import hf_greedy
    from test_long_prompt import TritonOnCpu
    from test_models_gemma_phi import make_model
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams

    path = make_model("mistral", str(tmp_path / "mistral"))  # window 8
    engines_on(TritonOnCpu())
    prompts = [list(range(5, 45)), list(range(100, 130))]
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=32,
              max_model_len=128)  # fmt: skip
    try:
        assert llm.engine.runner.backend.name == "triton" and llm.engine.kv.window == 8
        for cache in llm.engine.runner.kv_caches:  # [2, blocks, ...]: a read of it shows
            cache[:, llm.engine.kv.null_block] = float("nan")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        kv = llm.engine.kv
        assert kv.num_window_released > 0
        kv.check_invariants([])
    finally:
        llm.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == [hf_greedy(hf, p, 6) for p in prompts]
