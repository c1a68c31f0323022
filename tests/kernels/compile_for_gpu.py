"""Compile every portable Triton kernel for an NVIDIA Hopper GPU (sm_90) without one: the
kernels' Python wrappers run on `meta` tensors (shapes and dtypes only, so each wrapper picks
the launch options it picks on a GPU), and the launch compiles the kernel for the target
instead of running it. The interpreter, which runs the CPU tests, accepts code the compiler
refuses (a kernel with returns of two types); this catches that class of error in CI.

Run as a script (tests/kernels/test_compile_gpu.py does): TRITON_INTERPRET must be unset.
Prints one line per compiled variant and exits non-zero on the first compiler error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int64: "i64",
         torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
         torch.bool: "i1"}  # fmt: skip
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "enable_fp_fusion")
compiled: set = set()


def compile_only(self: JITFunction, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in: compile for TARGET with the launch's types and constants."""
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    bound = self.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    sig, consts = {}, {}
    for p in self.params:
        v = bound.arguments[p.name]
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if not -(2**31) <= v < 2**31 else "i32"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{self.fn.__name__}: argument {p.name} of type {type(v)}")
    key = (self.fn.__name__, tuple(sig.items()), repr(sorted(consts.items())), repr(opts))
    if key not in compiled:
        triton.compile(ASTSource(self, sig, consts), target=TARGET, options=opts)
        compiled.add(key)
        print(f"compiled {self.fn.__name__} {sorted((k, v) for k, v in consts.items())}")


JITFunction.run = compile_only
META = torch.device("meta")


def t(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def attention() -> None:
    from paged.kernels import (
        decode_workspace,
        paged_attention_decode,
        paged_attention_varlen,
        reshape_and_cache,
    )

    heads, kv_heads, bs, blocks, seqs = 8, 2, 16, 8, 3
    variants = [
        (128, dtype, layer)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
        for layer in ({}, {"window": 32, "softcap": 50.0})
    ]
    variants.append((96, torch.bfloat16, {}))  # a head size that is not a power of two
    for head_dim, cache_dtype, layer in variants:
        fp8 = cache_dtype != torch.bfloat16
        scales = {"k_scale": t(kv_heads, dtype=torch.float32),
                  "v_scale": t(kv_heads, dtype=torch.float32)} if fp8 else {}  # fmt: skip
        cache = t(2, blocks, bs, kv_heads, head_dim, dtype=cache_dtype)
        kv = t(10, kv_heads, head_dim)
        reshape_and_cache(kv, kv, cache[0], cache[1], t(10, dtype=torch.int64), **scales)
        seq_lens, table = t(seqs, dtype=torch.int32), t(seqs, 4, dtype=torch.int32)
        q = t(seqs, heads, head_dim)
        new = t(seqs, 3 * kv_heads, head_dim)[:, :kv_heads]  # a strided view, as k/v are
        fused = {"key": new, "value": new, "slot_mapping": t(seqs, dtype=torch.int64)}
        rope = (t(seqs, dtype=torch.int64), t(256, head_dim, dtype=torch.float32))
        for splits, write, rot in ((1, False, False), (4, False, False), (1, True, False),
                                   (4, True, False), (1, True, True), (4, True, True)):  # fmt: skip
            if rot and head_dim & (head_dim - 1):  # the rotary inside: powers of two only
                continue
            ws = decode_workspace(seqs, heads, head_dim, 4, META) if splits > 1 else None
            counters = t(seqs * kv_heads, dtype=torch.int32) if splits > 1 else None
            paged_attention_decode(q, cache[0], cache[1], torch.empty_like(q), seq_lens, table,
                                   0.1, 64, splits, ws, counters=counters, **layer, **scales,
                                   **(fused if write else {}),
                                   **({"rotary": rope} if rot else {}))  # fmt: skip
        q = t(20, heads, head_dim)
        paged_attention_varlen(q, cache[0], cache[1], torch.empty_like(q),
                               t(seqs + 1, dtype=torch.int32), seq_lens, table, 0.1, 12, 64,
                               **layer, **scales)  # fmt: skip


def fused() -> None:
    from paged.kernels import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

    x, w = t(4, 256), t(256)
    rms_norm(x, w, 1e-6)
    fused_add_rms_norm(x, t(4, 256), w, 1e-6)
    qkv = t(4, 12 * 64)
    rotary_embedding(t(4, dtype=torch.int64), qkv[:, : 8 * 64].view(4, 8, 64),
                     qkv[:, 8 * 64 : 10 * 64].view(4, 2, 64), t(128, 64, dtype=torch.float32),
                     64)  # fmt: skip
    rotary_embedding(t(4, dtype=torch.int64), qkv[:, : 8 * 64].view(4, 8, 64),
                     qkv[:, 8 * 64 : 10 * 64].view(4, 2, 64), t(128, 64, dtype=torch.float32),
                     64, norm=(t(64), t(64), 1e-6))  # Qwen3's q/k norm fused  # fmt: skip
    rotary_embedding(t(4, dtype=torch.int64), qkv[:, : 8 * 64].view(4, 8, 64),
                     qkv[:, 8 * 64 : 10 * 64].view(4, 2, 64), t(128, 64, dtype=torch.float32),
                     64, norm=(t(64), t(64), 1e-6), gemma_norm=True)  # Gemma 3's  # fmt: skip
    silu_and_mul(t(4, 512))
    from paged.kernels.gemma import gelu_and_mul, gemma_add_rms_norm, gemma_rms_norm

    gemma_rms_norm(qkv[:, : 8 * 64].view(4, 8, 64), t(64), 1e-6)  # Gemma 3's q/k norms
    gemma_add_rms_norm(x, t(4, 256), w, 1e-6)
    for approximate in ("tanh", "none"):
        gelu_and_mul(t(4, 512), approximate)
    from paged.kernels import apply_token_bitmask

    logits = t(6, 1000, dtype=torch.float32)
    apply_token_bitmask(logits, t(4, 32, dtype=torch.int32), None)
    apply_token_bitmask(logits, t(4, 32, dtype=torch.int32), t(4, dtype=torch.int64))


def quantized_linears() -> None:
    from paged.kernels.fp8_gemm import fp8_linear
    from paged.kernels.gemv import gemv
    from paged.kernels.int4_gemm import int4_linear

    n, k = 256, 512
    gemv(t(1, k), t(n, k))  # a plain (bf16) decode GEMV
    from paged.kernels.gemv import gemv_split_k

    for config in ((8, 256, 1, 4), (4, 128, 4, 4)):  # one-row linears (paged_cuda.gemv_select)
        gemv_split_k(t(1, k), t(n, k), t(n), config, t(n, dtype=torch.int32))
        # with the residual add and RMSNorm before it (add_rms_norm_linear)
        gemv_split_k(t(1, k), t(n, k), None, config, t(n, dtype=torch.int32),
                     norm=(t(1, k), t(k), 1e-6))  # fmt: skip
        # with SiLU-and-mul before it (silu_and_mul_linear: a down projection)
        gemv_split_k(t(1, 2 * k), t(n, k), None, config, t(n, dtype=torch.int32),
                     silu_mul=True)  # fmt: skip
    w8 = t(n, k, dtype=torch.float8_e4m3fn)
    for norm, silu in ((None, False), ((t(1, k), t(k), 1e-6), False), (None, True)):
        # weight-only fp8 one-row linears (paged_cuda.fp8_weight_only)
        gemv_split_k(t(1, 2 * k if silu else k), w8, None, (4, 1024, 2, 4),
                     t(n, dtype=torch.int32), norm, silu, t(n, 1, dtype=torch.float32))  # fmt: skip
    from paged.kernels.fp8_gemv import fp8_gemv_split

    for rows, config in ((1, (64, 256, 1, 4, 4)), (1, (64, 128, 4, 4, 2)),
                         (3, (128, 128, 2, 4, 3))):  # fmt: skip
        # the fp8 decode GEMV split over K (paged_cuda.fp8_select), with a bias
        fp8_gemv_split(t(rows, k), w8, t(n, 1, dtype=torch.float32), t(n), config,
                       t(n, dtype=torch.int32))  # fmt: skip
    from paged.kernels.int4_gemm_split import int4_gemm_split

    for rows, group, config, bits in ((1, 128, (16, 64, 128, 8, 4), 4),
                                      (3, 128, (16, 128, 256, 1, 4), 4),
                                      (20, 32, (32, 64, 128, 2, 4), 4),
                                      (1, 32, (16, 64, 64, 4, 4), 8),
                                      (40, 32, (32, 16, 64, 1, 4), 8)):  # fmt: skip
        # the int4 GEMM split over K (paged_cuda.int4_select's configs); GGUF's groups of 32
        # with mins: tiles spanning groups; 8-bit codes (GGUF Q8_0); row blocks of 32 and more
        # (the rows' columns loaded contiguously)
        groups = k // group
        int4_gemm_split(t(rows, k), t(n, k * bits // 32, dtype=torch.int32),
                        t(n, groups, dtype=torch.float32), t(n, groups, dtype=torch.uint8), group,
                        t(n), t(n, groups, dtype=torch.float32) if group == 32 else None, bits,
                        config)  # fmt: skip
    # ragged (masked loads): 200 outputs in blocks of 64
    int4_gemm_split(t(1, k), t(200, k // 8, dtype=torch.int32), t(200, 4, dtype=torch.float32),
                    t(200, 4, dtype=torch.uint8), 128, None, None, 4, (16, 64, 128, 2, 4))
    for rows in (1, 8, 64, 160):  # fp8: the GEMV (decode), the GEMM; int4: split GEMM, dequantized
        x = t(rows, k)
        fp8_linear(x, w8, t(n, 1, dtype=torch.float32), k)  # per channel
        fp8_linear(x, w8, t(n, k // 128, dtype=torch.float32), 128, t(n))  # blocks, bias
        groups = k // 128
        int4_linear(x, t(n, k // 8, dtype=torch.int32), t(n, groups, dtype=torch.float32),
                    t(n, groups, dtype=torch.uint8), 128)  # fmt: skip
        int4_linear(x, t(n, k // 8, dtype=torch.int32), t(n, k // 32, dtype=torch.float32),
                    t(n, k // 32, dtype=torch.uint8), 32, t(n),
                    t(n, k // 32, dtype=torch.float32))  # GGUF Q4_1: mins  # fmt: skip
        int4_linear(x, t(n, k // 4, dtype=torch.int32), t(n, k // 32, dtype=torch.float32),
                    t(n, k // 32, dtype=torch.uint8), 32, None, None, 8)  # GGUF Q8_0


def moe_and_lora() -> None:
    from paged.kernels import fused_moe
    from paged.kernels.moe_routing import moe_route

    experts, hidden, inter, top_k = 8, 256, 128, 2
    moe_route(t(4, 128), 8, True, torch.bfloat16)  # Qwen3-MoE's routing
    moe_route(t(4, 8), 2, False, None)  # Mixtral's
    for tokens in (1, 64):  # per-pair GEMVs and the blocked GEMM
        fused_moe(t(tokens, hidden), t(experts, 2 * inter, hidden), t(experts, hidden, inter),
                  t(tokens, top_k, dtype=torch.float32),
                  t(tokens, top_k, dtype=torch.int64))  # fmt: skip
    from paged.kernels.moe import fused_moe_from_logits

    for e, k, renormalize, dtype in ((128, 8, True, torch.bfloat16), (8, 2, False, None)):
        # decode, routed inside the GEMVs: Qwen3-MoE's routing; float32 weights, unnormalised
        fused_moe_from_logits(t(1, hidden), t(e, 2 * inter, hidden), t(e, hidden, inter),
                              t(1, e), k, renormalize, dtype)  # fmt: skip
    # Qwen3-MoE's decode with the residual add and RMSNorm before it folded in (add_rms_norm_moe)
    fused_moe_from_logits(t(1, hidden), t(128, 2 * inter, hidden), t(128, hidden, inter),
                          t(1, 128), 8, True, torch.bfloat16,
                          norm=(t(1, hidden), t(hidden), 1e-6))  # fmt: skip
    import numpy as np

    from paged.kernels import lora_expand, lora_shrink
    from paged.lora.batch import LoRABatch, buffer_size, pack

    slots, rank, k, outs = 3, 16, 512, [256, 64, 64]
    for token_slot in ([0, 1, -1, 2], [i % 4 - 1 for i in range(100)]):
        host, starts = pack(np.asarray(token_slot, dtype=np.int64), slots)
        batch = LoRABatch.on(t(buffer_size(slots, len(token_slot)), dtype=torch.int64), slots)
        batch.starts_host = starts
        x = t(len(token_slot), k)
        xa = lora_shrink(x, t(slots, len(outs) * rank, k), batch)
        lora_expand(t(len(token_slot), sum(outs)), xa, t(slots, sum(outs), rank), outs, batch)


def decode_with_pdl() -> None:
    """A decode step's kernels as the CUDA platform launches them on Hopper (paged.kernels.pdl):
    one variant of each with programmatic dependent launch compiled in."""
    from paged.kernels import (
        decode_workspace,
        fused_add_rms_norm,
        paged_attention_decode,
        pdl,
        reshape_and_cache,
        rms_norm,
        rotary_embedding,
        silu_and_mul,
    )
    from paged.kernels.fp8_gemm import fp8_linear
    from paged.kernels.gemma import gelu_and_mul, gemma_rms_norm
    from paged.kernels.gemv import gemv, gemv_split_k
    from paged.kernels.moe import fused_moe_from_logits
    from paged.kernels.moe_routing import moe_route

    pdl.enable(True)
    heads, kv_heads, hd, hidden, n = 8, 2, 128, 256, 256
    cache = t(2, 8, 16, kv_heads, hd)
    kv = t(1, kv_heads, hd)
    reshape_and_cache(kv, kv, cache[0], cache[1], t(1, dtype=torch.int64))
    q, lens, table = t(1, heads, hd), t(1, dtype=torch.int32), t(1, 4, dtype=torch.int32)
    for splits in (1, 4):  # the backend's decode step: the cache write fused in
        for rotary in (None, (t(1, dtype=torch.int64), t(128, hd, dtype=torch.float32))):
            paged_attention_decode(q, cache[0], cache[1], torch.empty_like(q), lens, table, 0.1,
                                   64, splits, decode_workspace(1, heads, hd, 4, META),
                                   counters=t(kv_heads, dtype=torch.int32), key=kv, value=kv,
                                   slot_mapping=t(1, dtype=torch.int64),
                                   rotary=rotary)  # fmt: skip
    x, w = t(1, hidden), t(hidden)
    rms_norm(x, w, 1e-6)
    fused_add_rms_norm(x, t(1, hidden), w, 1e-6)
    qkv = t(1, 12 * 64)
    rotary_embedding(t(1, dtype=torch.int64), qkv[:, : 8 * 64].view(1, 8, 64),
                     qkv[:, 8 * 64 : 10 * 64].view(1, 2, 64), t(128, 64, dtype=torch.float32),
                     64, norm=(t(64), t(64), 1e-6))  # fmt: skip
    silu_and_mul(t(1, 512))
    gemma_rms_norm(x, w, 1e-6)
    gelu_and_mul(t(1, 512), "tanh")
    gemv(x, t(n, hidden))
    gemv_split_k(x, t(n, hidden), None, (4, 128, 2, 4), t(n, dtype=torch.int32),
                 norm=(t(1, hidden), w, 1e-6))  # fmt: skip
    gemv_split_k(t(1, 2 * hidden), t(n, hidden), None, (4, 128, 2, 4), t(n, dtype=torch.int32),
                 silu_mul=True)  # fmt: skip
    fp8_linear(x, t(n, hidden, dtype=torch.float8_e4m3fn), t(n, 1, dtype=torch.float32), hidden)
    from paged.kernels.fp8_gemv import fp8_gemv_split

    fp8_gemv_split(x, t(n, hidden, dtype=torch.float8_e4m3fn), t(n, 1, dtype=torch.float32), None,
                   (64, 128, 2, 4, 2), t(n, dtype=torch.int32))  # fmt: skip
    # with the residual add and RMSNorm, or SiLU-and-mul, folded in (fp8_select)
    fp8_gemv_split(x, t(n, hidden, dtype=torch.float8_e4m3fn), t(n, 1, dtype=torch.float32), None,
                   (64, 128, 2, 4, 2), t(n, dtype=torch.int32), norm=(t(1, hidden), w, 1e-6))
    fp8_gemv_split(t(1, 2 * hidden), t(n, hidden, dtype=torch.float8_e4m3fn),
                   t(n, 1, dtype=torch.float32), None, (64, 128, 1, 4, 2),
                   t(n, dtype=torch.int32), silu_mul=True)  # fmt: skip
    from paged.kernels.int4_gemm_split import int4_gemm_split

    int4_gemm_split(x, t(n, hidden // 8, dtype=torch.int32), t(n, 2, dtype=torch.float32),
                    t(n, 2, dtype=torch.uint8), 128, None, None, 4, (16, 64, 128, 2, 4))
    moe_route(t(1, 128), 8, True, torch.bfloat16)
    fused_moe_from_logits(x, t(128, 2 * 128, hidden), t(128, hidden, 128), t(1, 128), 8, True,
                          torch.bfloat16, norm=(t(1, hidden), w, 1e-6))  # fmt: skip
    pdl.enable(False)


def main() -> int:
    for part in (attention, fused, quantized_linears, moe_and_lora, decode_with_pdl):
        part()
    print(f"{len(compiled)} kernel variants compiled for {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
