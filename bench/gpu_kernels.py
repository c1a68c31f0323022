"""GPU micro-benchmark of paged.kernels against plain-torch references (Llama-3.1-8B shapes).

Run: `python bench/gpu_kernels.py` (needs CUDA; exits cleanly without it). Prints, per kernel and
shape, the median time (triton.testing.do_bench, which flushes L2 between runs), the achieved
bandwidth (bytes of each input read once + each output written once), TFLOP/s for prefill,
the torch reference time, the speed-up and the relative error against that reference.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

H, HKV, D, BS, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336  # Llama-3.1-8B
DT = torch.bfloat16
EPS = 1e-5


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def row(name: str, shape: str, fn: Callable, ref_fn: Callable, nbytes: float, err: float,
        flops: float = 0.0) -> None:  # fmt: skip
    """Eager time (L2 flushed), time inside a CUDA graph (no launch overhead, L2 warm)."""
    from triton.testing import do_bench_cudagraph

    ms, ref_ms = bench(fn), bench(ref_fn)
    graph_ms = do_bench_cudagraph(fn, return_mode="median")
    extra = f"{flops / ms / 1e9:7.1f} TFLOP/s" if flops else " " * 15
    print(f"{name:<20}{shape:<18}{ms * 1e3:9.1f} us {nbytes / ms / 1e6:7.0f} GB/s {extra}"
          f"{graph_ms * 1e3:9.1f} us{ref_ms * 1e3:10.1f} us {ref_ms / ms:6.2f}x  err {err:.1e}",
          flush=True)  # fmt: skip


def rnd(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DT, generator=gen)


def paged_setup(gen: torch.Generator, batch: int, ctx: int):
    """KV cache with randomly permuted blocks for `batch` sequences of `ctx` tokens."""
    per_seq = -(-ctx // BS)
    kv = rnd(gen, 2, batch * per_seq, BS, HKV, D)
    perm = torch.randperm(batch * per_seq, device="cuda", generator=gen).int()
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return kv, perm.view(batch, per_seq), seq


def torch_paged(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: int,
                qlen: int) -> torch.Tensor:  # fmt: skip
    """Reference: gather K/V through the block table, then causal SDPA (equal lengths)."""
    batch = table.shape[0]
    k, v = kv[:, table.long()].flatten(2, 3)[:, :, :ctx].transpose(2, 3)  # [B, HKV, ctx, D]
    qb = q.view(batch, qlen, H, D).transpose(1, 2)
    pos = ctx - qlen + torch.arange(qlen, device="cuda")
    mask = torch.arange(ctx, device="cuda")[None, :] <= pos[:, None]
    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape)


def bench_attention(gen: torch.Generator) -> None:
    from paged.kernels import decode_workspace, paged_attention_decode, paged_attention_varlen
    from paged.kernels.decode import decode_counters

    scale = D**-0.5
    for batch in (1, 32, 256):
        for ctx in (512, 4096):
            kv, table, seq = paged_setup(gen, batch, ctx)
            q, shape = rnd(gen, batch, H, D), f"B={batch} ctx={ctx}"
            out, ws = torch.empty_like(q), decode_workspace(batch, H, D, device="cuda")
            tickets = decode_counters(batch, HKV, "cuda")  # as the backend keeps them
            ref_fn = partial(torch_paged, q, kv, table, ctx, 1)
            ref, nbytes = ref_fn(), 2 * batch * ctx * HKV * D * 2 + 2 * q.numel() * 2
            for splits in (None, 1):
                fn = partial(paged_attention_decode, q, kv[0], kv[1], out, seq, table, scale,
                             ctx, num_splits=splits, workspace=ws,
                             counters=tickets)  # fmt: skip
                fn()
                name = "decode split=" + ("auto" if splits is None else str(splits))
                row(name, shape, fn, ref_fn, nbytes, rel(out, ref))
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            fn = partial(paged_attention_varlen, q, kv[0], kv[1], out, qsl, seq, table, scale,
                         1, ctx)  # fmt: skip
            fn()
            row("varlen (decode)", shape, fn, ref_fn, nbytes, rel(out, ref))
    for batch, qlen, ctx in ((1, 2048, 2048), (4, 512, 512), (1, 2048, 4096)):
        kv, table, seq = paged_setup(gen, batch, ctx)
        q = rnd(gen, batch * qlen, H, D)
        out = torch.empty_like(q)
        qsl = torch.arange(0, batch * qlen + 1, qlen, device="cuda", dtype=torch.int32)
        fn = partial(paged_attention_varlen, q, kv[0], kv[1], out, qsl, seq, table, scale,
                     qlen, ctx)  # fmt: skip
        fn()
        ref_fn = partial(torch_paged, q, kv, table, ctx, qlen)
        nbytes = 2 * q.numel() * 2 + 2 * batch * ctx * HKV * D * 2
        flops = 4 * batch * qlen * (ctx - qlen / 2) * H * D  # causal half of the new block
        row("prefill varlen", f"{batch}x{qlen} ctx={ctx}", fn, ref_fn, nbytes,
            rel(out, ref_fn()), flops)  # fmt: skip


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def hf_add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hf_rms_norm(x + res, w)


def hf_rotary(pos: torch.Tensor, cache: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    cos = cache[pos, : D // 2].repeat(1, 2)[:, None]
    sin = cache[pos, D // 2 :].repeat(1, 2)[:, None]
    tf = t.float()
    return (tf * cos + torch.cat((-tf[..., D // 2 :], tf[..., : D // 2]), -1) * sin).to(t.dtype)


def torch_cache_write(key, val, kv, slots) -> None:
    kv[0].view(-1, HKV, D)[slots] = key
    kv[1].view(-1, HKV, D)[slots] = val


def bench_elementwise(gen: torch.Generator) -> None:
    from paged.kernels import (
        fused_add_rms_norm,
        reshape_and_cache,
        rms_norm,
        rotary_embedding,
        silu_and_mul,
    )

    for tokens in (256, 2048):
        nblocks = 4 * tokens // BS
        kv = rnd(gen, 2, nblocks, BS, HKV, D)
        qkv = rnd(gen, tokens, (H + 2 * HKV) * D)
        key = qkv[:, H * D : (H + HKV) * D].view(tokens, HKV, D)
        val = qkv[:, (H + HKV) * D :].view(tokens, HKV, D)
        slots = torch.randperm(nblocks * BS, device="cuda", generator=gen)[:tokens]
        fn = partial(reshape_and_cache, key, val, kv[0], kv[1], slots)
        fn()
        err = rel(kv.flatten(1, 2)[:, slots], torch.stack((key, val)))
        row("reshape_and_cache", f"T={tokens}", fn, partial(torch_cache_write, key, val, kv, slots),
            4 * key.numel() * 2, err)  # fmt: skip

    tokens = 2048
    x, res, w = rnd(gen, tokens, HIDDEN), rnd(gen, tokens, HIDDEN), rnd(gen, HIDDEN)
    out = torch.empty_like(x)
    fn = partial(rms_norm, x, w, EPS, out)
    fn()
    row("rms_norm", f"{tokens}x{HIDDEN}", fn, partial(hf_rms_norm, x, w), 2 * x.numel() * 2,
        rel(out, hf_rms_norm(x, w)))  # fmt: skip
    x2, r2 = x.clone(), res.clone()
    fused_add_rms_norm(x2, r2, w, EPS)
    err = rel(x2, hf_add_rms_norm(x, res, w))
    row("fused_add_rms_norm", f"{tokens}x{HIDDEN}", partial(fused_add_rms_norm, x2, r2, w, EPS),
        partial(hf_add_rms_norm, x, res, w), 4 * x.numel() * 2, err)  # fmt: skip

    qkv = rnd(gen, tokens, (H + 2 * HKV) * D)
    q = qkv[:, : H * D].view(tokens, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(tokens, HKV, D)
    pos = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    inv = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)
    expect = hf_rotary(pos, cache, q)
    rotary_embedding(pos, q, k, cache, D)
    err = rel(q, expect)
    row("rotary_embedding", f"T={tokens}", partial(rotary_embedding, pos, q, k, cache, D),
        lambda: (hf_rotary(pos, cache, q), hf_rotary(pos, cache, k)),
        2 * (q.numel() + k.numel()) * 2, err)  # fmt: skip

    x = rnd(gen, tokens, 2 * INTER)
    out = torch.empty(tokens, INTER, device="cuda", dtype=DT)
    ref_fn = lambda: F.silu(x[:, :INTER]) * x[:, INTER:]
    silu_and_mul(x, out)
    row("silu_and_mul", f"{tokens}x{INTER}", partial(silu_and_mul, x, out), ref_fn,
        3 * out.numel() * 2, rel(out, ref_fn()))  # fmt: skip


def main() -> None:
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py: no CUDA device, skipping")
        return
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
          f"  {DT}  (H={H} HKV={HKV} D={D} block={BS})")  # fmt: skip
    print(f"{'kernel':<20}{'shape':<18}{'time':>12} {'bandwidth':>12} {'':15}{'in graph':>12}"
          f"{'torch':>13}{'speed-up':>9}")  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = rnd(gen, 8192, 8192)
    for _ in range(200):  # raise the clocks from idle before timing anything
        x @ x
    bench(lambda: x @ x)  # and let do_bench set itself up outside the first row
    bench_attention(gen)
    bench_elementwise(gen)


if __name__ == "__main__":
    main()
