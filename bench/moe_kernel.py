"""The fused-MoE Triton kernel (paged/kernels/moe.py) against the grouped torch path it
replaces (paged.model.ops.fused_moe), one Qwen3-30B-A3B layer's experts in bfloat16:

    python bench/moe_kernel.py [--tokens 1,8,64,256,2048] [--experts 128 --top-k 8
                                --hidden 2048 --inter 768] [--sweep | --inline-routing]

Needs CUDA (exits cleanly without it). Per token count: median time of each (triton's
do_bench, L2 flushed), the kernel inside a CUDA graph (it has no host sync, so it can be
captured), the bytes of the experts the batch routes to (each read once) over the kernel's
time, the relative error against the torch path. Results: bench/results/moe-kernel.md.
`--sweep`: one token's two decode GEMVs (gate/up with SiLU per pair, then down summed) under
every (BLOCK_N, BLOCK_K, warps), in a CUDA graph cycling through 8 routings so the experts come from
HBM; prints the best beside the default (paged.kernels.moe.gemv_config, down_sum_config).
`--inline-routing`: per token count (default 1,2,4,8), the decode path from router logits as
three launches (moe_route, then the two GEMVs) against two (the GEMVs routing inline:
fused_moe_from_logits), Qwen3-MoE's routing (renormalised, bf16 weights), in a CUDA graph
cycling through 8 routings so the experts come from HBM; checks both give the same bits. Then
one token's post-attention residual add + RMSNorm, router and experts: the norm kernel, the
router (cuBLAS, or the split-K GEMV under the config gemv_select would time best) and the two
GEMVs, against the router's GEMV and the gate/up GEMV with the norm folded in
(add_rms_norm_moe: one launch fewer), 8 inputs in one CUDA graph.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))


def sweep(e: int, k: int, h: int, i: int) -> None:
    import itertools

    from triton.testing import do_bench_cudagraph

    from paged.kernels.moe import _down_sum, _gate_up, down_sum_config, gemv_config

    dt, dev = torch.bfloat16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=dt, generator=gen) * 0.02
    x = torch.randn(1, h, device=dev, dtype=dt, generator=gen)
    routes = [torch.randperm(e, device=dev, generator=gen)[:k].contiguous() for _ in range(8)]
    weights = torch.full((k,), 1.0 / k, device=dev, dtype=torch.float32)
    act = torch.randn(k, i, device=dev, dtype=dt, generator=gen)
    k_pad = 1 << (k - 1).bit_length()
    kernels = (  # name, output, bytes read, launch(cfg, ids), default, configs
        ("gate_up+silu", torch.empty(k, i, device=dev, dtype=dt), k * 2 * i * h * 2,
         lambda cfg, ids, out: _gate_up(x, w13, out, ids, k, cfg), gemv_config(i, h),
         [c for c in itertools.product((2, 4, 8, 16), (128, 256, 512, 1024), (4, 8))
          if c[0] * c[1] * 2 <= 4096 * c[2]]),
        ("down, k experts summed", torch.empty(1, h, device=dev, dtype=dt), k * h * i * 2,
         lambda cfg, ids, out: _down_sum(act, w2, out, weights, ids, k, cfg),
         down_sum_config(h, i),
         [c for c in itertools.product((1, 2, 4, 8), (64, 128, 256, 512), (4, 8))
          if k_pad * c[0] * c[1] <= 4096 * c[2]]),
    )  # fmt: skip
    for name, out, nbytes, launch, default, configs in kernels:
        best = []
        for cfg in configs:

            def run(cfg=cfg, launch=launch, out=out):
                for ids in routes:
                    launch(cfg, ids, out)

            best.append((do_bench_cudagraph(run, rep=40, return_mode="median") / 8, cfg))
        best.sort()
        d_us = dict((c, ms) for ms, c in best).get(default, float("nan")) * 1e3
        top = ", ".join(f"{c} {ms * 1e3:.1f} us ({nbytes / ms / 1e6:.0f} GB/s)"
                        for ms, c in best[:4])  # fmt: skip
        print(f"{name}: best {top}; default {default} {d_us:.1f} us", flush=True)


def routed_paths(x, w13, w2, routings: list[torch.Tensor], k: int) -> tuple[float, float, bool]:
    """(us of moe_route + the two GEMVs, us of the two routing inline, same bits), a routing's
    time: the mean over `routings` in one CUDA graph."""
    from triton.testing import do_bench_cudagraph

    from paged.kernels.moe import Route, _down_sum, _gate_up
    from paged.kernels.moe_routing import moe_route

    dt = x.dtype
    act = x.new_empty(x.shape[0] * k, w13.shape[1] // 2)
    out = torch.empty_like(x)

    def three(logits):
        weights, ids = moe_route(logits, k, True, dt)
        _gate_up(x, w13, act, ids.view(-1), k)
        _down_sum(act, w2, out, weights.view(-1), ids.view(-1), k)

    def two(logits):
        route = Route(logits, True, True)
        _gate_up(x, w13, act, None, k, route=route)
        _down_sum(act, w2, out, None, None, k, route=route)

    outs, us = [], []
    for path in (three, two):
        outs.append([path(lg) or out.clone() for lg in routings])
        run = lambda path=path: [path(lg) for lg in routings]
        us.append(do_bench_cudagraph(run, rep=100, return_mode="median") / len(routings) * 1e3)
    return us[0], us[1], all(torch.equal(a, b) for a, b in zip(*outs))


def inline_routing(tokens: list[int], e: int, k: int, h: int, i: int) -> None:
    from paged.kernels.moe import GEMV_MAX_PAIRS

    dt, dev = torch.bfloat16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=dt, generator=gen) * 0.02
    print(f"{'tokens':>7} {'route+2 us':>10} {'inline us':>10} {'saved us':>9} {'same bits':>9}")
    for t in tokens:
        x = torch.randn(t, h, device=dev, dtype=dt, generator=gen)
        routings = [(2 * torch.randn(t, e, device=dev, generator=gen)).to(dt) for _ in range(8)]
        three, two, same = routed_paths(x, w13, w2, routings, k)
        note = "" if t * k <= GEMV_MAX_PAIRS else "  (engine: moe_route + grouped GEMM here)"
        print(f"{t:>7} {three:>10.1f} {two:>10.1f} {three - two:>9.1f} {same!s:>9}{note}",
              flush=True)  # fmt: skip


def norm_folded(e: int, k: int, h: int, i: int) -> None:
    """One token: norm kernel + router + experts (routing inline) against the norm folded into
    the router's GEMV and the experts' gate/up GEMV; us per input, the mean over 8 inputs in
    one CUDA graph (the experts from HBM), and the folded output's difference from the norm's."""
    from triton.testing import do_bench_cudagraph

    from paged.kernels import fused_add_rms_norm
    from paged.kernels.gemv import gemv_split_k, split_k_counters
    from paged.kernels.moe import fused_moe_from_logits
    from paged.kernels.moe_routing import moe_route
    from paged_cuda.gemv_select import candidates

    dt, dev, eps = torch.bfloat16, "cuda", 1e-6
    gen = torch.Generator(device=dev).manual_seed(1)
    rand = partial(torch.randn, device=dev, dtype=dt, generator=gen)
    w13, w2, gate = rand(e, 2 * i, h) * 0.02, rand(e, h, i) * 0.02, rand(e, h) * 0.05
    gain = rand(h).abs() + 0.5
    inputs = [(rand(1, h), 4 * rand(1, h)) for _ in range(8)]  # (x, residual)
    configs = candidates(e, h)
    counters = torch.zeros(max(split_k_counters(e, 1, c) for c in configs), dtype=torch.int32,
                           device=dev)  # fmt: skip

    def router(config, x, norm=None):  # config None: cuBLAS
        if config is None:
            return torch.nn.functional.linear(x, gate)
        return gemv_split_k(x, gate, None, config, counters, norm)

    def separate(config, x, r):  # the norm kernel in place, as the engine runs it
        normed, _ = fused_add_rms_norm(x, r, gain, eps)
        return fused_moe_from_logits(normed, w13, w2, router(config, normed), k, True, dt)

    def normed_router(config, x, r):  # (logits, new residual)
        return router(config, x, (r, gain, eps))

    def folded(config, x, r):
        logits, _ = normed_router(config, x, r)
        return fused_moe_from_logits(x, w13, w2, logits, k, True, dt, norm=(r, gain, eps))

    def us(path, config) -> float:
        # copies: the separate norm updates them in place (their values drift over the
        # replays, which moves the routing, not the bytes read)
        xs = [(x.clone(), r.clone()) for x, r in inputs]
        run = lambda: [path(config, x, r) for x, r in xs]  # noqa: E731
        return do_bench_cudagraph(run, rep=100, return_mode="median") / len(xs) * 1e3

    # the router's config as gemv_select chooses it for a linear after a norm: timed with it
    config = min(configs, key=lambda c: us(normed_router, c))
    times = [us(separate, None), us(separate, config), us(folded, config)]
    same, diff = 0, 0.0  # folded vs norm + GEMV router, where both route to the same experts
    for x, r in inputs:
        normed, _ = fused_add_rms_norm(x.clone(), r.clone(), gain, eps)
        ids = [moe_route(lg, k, True, dt)[1] for lg in (normed_router(config, x, r)[0],
                                                          router(config, normed))]  # fmt: skip
        if torch.equal(*ids):
            got, want = folded(config, x, r).float(), separate(config, x.clone(), r.clone())
            diff = max(diff, ((got - want.float()).abs().max() / want.abs().max()).item())
            same += 1
    print(f"\none token, add + norm + router + experts (router GEMV {config}): norm + cuBLAS "
          f"router {times[0]:.1f} us, norm + GEMV router {times[1]:.1f} us, folded "
          f"{times[2]:.1f} us (saved {min(times[:2]) - times[2]:.1f} us); folded vs norm + GEMV: "
          f"the same experts for {same}/{len(inputs)} inputs, max diff {diff:.1e} of the "
          f"output's max there (the normed input is not rounded to bf16)", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=None, help="default 1,8,64,256,2048 (1,2,4,8 inline)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true")
    mode.add_argument("--inline-routing", action="store_true")
    args = ap.parse_args()
    tokens = args.tokens or ("1,2,4,8" if args.inline_routing else "1,8,64,256,2048")
    tokens = [int(t) for t in tokens.split(",")]
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    if args.sweep:
        sweep(args.experts, args.top_k, args.hidden, args.inter)
        return 0
    if args.inline_routing:
        inline_routing(tokens, args.experts, args.top_k, args.hidden, args.inter)
        norm_folded(args.experts, args.top_k, args.hidden, args.inter)
        return 0
    from common import write_results
    from triton.testing import do_bench, do_bench_cudagraph

    from paged.kernels.moe import fused_moe
    from paged.model.ops import fused_moe as torch_moe
    from paged.model.ops import moe_route as route

    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    dt, dev = torch.bfloat16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=dt, generator=gen) * 0.02
    gate = torch.randn(e, h, device=dev, dtype=dt, generator=gen) * 0.02
    per_expert = 3 * h * i * 2  # bytes of one expert's three matrices
    rows, figures = [], {}
    print(f"{'tokens':>7} {'experts hit':>11} {'triton us':>10} {'graph us':>9} "
          f"{'GB/s':>6} {'torch us':>9} {'speed-up':>8} {'rel err':>8}")  # fmt: skip
    for t in tokens:
        x = torch.randn(t, h, device=dev, dtype=dt, generator=gen)
        weights, ids = route(x @ gate.t(), k, renormalize=True, dtype=dt)
        hit = int(ids.unique().numel())
        run = partial(fused_moe, x, w13, w2, weights, ids)
        ref = partial(torch_moe, x, w13, w2, weights, ids)
        got, want = run(), ref()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        ms = do_bench(run, return_mode="median")
        graph_ms = do_bench_cudagraph(run, return_mode="median")
        ref_ms = do_bench(ref, return_mode="median")
        gbs = hit * per_expert / ms / 1e6
        print(f"{t:>7} {hit:>11} {ms * 1e3:>10.1f} {graph_ms * 1e3:>9.1f} {gbs:>6.0f} "
              f"{ref_ms * 1e3:>9.1f} {ref_ms / ms:>7.2f}x {err:>8.1e}", flush=True)  # fmt: skip
        figures[t] = dict(experts_hit=hit, triton_ms=ms, graph_ms=graph_ms, torch_ms=ref_ms,
                          gb_per_s=gbs, rel_err=err)  # fmt: skip
        result = (
            f"triton {ms * 1e3:.1f} us (graph {graph_ms * 1e3:.1f} us, {gbs:.0f} GB/s), "
            f"torch {ref_ms * 1e3:.1f} us, {ref_ms / ms:.2f}x, rel err {err:.1e}"
        )
        rows.append((f"{t} tokens ({hit} experts hit)", result))
    shape = f"E={e} top-{k} hidden {h} inter {i} bf16"
    extra = {"shape": shape, "device": torch.cuda.get_device_name(0), "tokens": figures}
    write_results("moe-kernel.md", f"fused MoE, {shape}", rows, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
