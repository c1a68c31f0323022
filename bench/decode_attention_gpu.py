"""A decode step's attention work per layer, as the engine launches it, in a CUDA graph over
32 layers' caches (Llama-3.1-8B: 32 query heads, 8 KV heads, head 128, bf16):

- ``rope+write+attn``: the rotary kernel, the cache write, then the decode kernel;
- ``write+attn``: the cache write, then the decode kernel (q and k already rotated);
- ``attn(write)``: the decode kernel writing the step's K/V itself (where the tree has it);
- ``attn(rope,write)``: that, rotating q and the newest key inside too (where it has it).

    python bench/decode_attention_gpu.py [--batch 1,8] [--ctx 160,1000] [--splits 1,2,16]

Run it in two trees to compare their kernels (it uses whatever each tree's decode kernel
takes). Prints microseconds per layer, PDL off and on.
"""

from __future__ import annotations

import argparse
import inspect

import torch

H, HKV, D, BS, LAYERS = 32, 8, 128, 16, 32


def variants(batch: int, ctx: int, splits: int) -> dict:
    from paged.kernels import decode as dec
    from paged.kernels import paged_attention_decode, reshape_and_cache, rotary_embedding

    takes = inspect.signature(paged_attention_decode).parameters
    per_seq = -(-(ctx + 1) // BS)
    blocks = batch * per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randn(2, blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16,
                          generator=gen) for _ in range(LAYERS)]  # fmt: skip
    table = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, per_seq)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    slots = (table[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS).contiguous()
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qkv = torch.randn(batch, (H + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    k = qkv[:, H * D : (H + HKV) * D].view(batch, HKV, D)
    v = qkv[:, (H + HKV) * D :].view(batch, HKV, D)
    out = torch.empty_like(q)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
    cos_sin = torch.randn(4096, D, device="cuda")
    ws = dec.decode_workspace(batch, H, D, max(splits, 2), "cuda") if splits > 1 else None
    merges = {"": {}}  # how the splits merge: a second launch, or the last split (a ticket)
    if splits > 1 and "counters" in takes:
        merges = {"[ticket]": {"counters": dec.decode_counters(batch, HKV, "cuda")}}
        if hasattr(dec, "_reduce_kernel"):
            merges["[reduce]"] = {}
    scale = D**-0.5

    def attn(c, extra, **kw):
        return paged_attention_decode(q, c[0], c[1], out, seq, table, scale, ctx + 1, splits,
                                      ws, **extra, **kw)  # fmt: skip

    def rope():
        rotary_embedding(pos, q, k, cos_sin, D)

    write = dict(key=k, value=v, slot_mapping=slots)
    rot = dict(write, rotary=(pos, cos_sin))
    out_v = {}
    for tag, extra in merges.items():
        out_v["rope+write+attn" + tag] = [
            lambda c=c, e=extra: (rope(), reshape_and_cache(k, v, c[0], c[1], slots), attn(c, e))
            for c in caches
        ]
        out_v["write+attn" + tag] = [
            lambda c=c, e=extra: (reshape_and_cache(k, v, c[0], c[1], slots), attn(c, e))
            for c in caches
        ]
        if "key" in takes:
            out_v["attn(write)" + tag] = [lambda c=c, e=extra: attn(c, e, **write)
                                          for c in caches]  # fmt: skip
        if "rotary" in takes:
            out_v["attn(rope,write)" + tag] = [lambda c=c, e=extra: attn(c, e, **rot)
                                               for c in caches]  # fmt: skip
    return out_v


def graph_us(calls) -> float:
    """Microseconds a call: the calls (one per layer) captured once in a CUDA graph and
    replayed, as the CUDA plugin times its start-up choices."""
    from paged_cuda.gemv_select import graph_time

    return graph_time(calls) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--ctx", default="160,1000")
    ap.add_argument("--splits", default="1,2,16")
    args = ap.parse_args()
    from paged.kernels import pdl

    print(torch.cuda.get_device_name(0), flush=True)
    for batch in map(int, args.batch.split(",")):
        for ctx in map(int, args.ctx.split(",")):
            for splits in map(int, args.splits.split(",")):
                row = []
                for on in (False, True):
                    pdl.enable(on)
                    with torch.inference_mode():
                        for name, calls in variants(batch, ctx, splits).items():
                            row.append(f"  {name}{' pdl' if on else ''}: {graph_us(calls):.2f}")
                pdl.enable(False)
                print(f"B={batch} ctx={ctx} splits={splits}, us a layer:", flush=True)
                print("\n".join(row), flush=True)


if __name__ == "__main__":
    main()
