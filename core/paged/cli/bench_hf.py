"""``--baseline hf`` for ``paged bench throughput|latency``: HF transformers on paged's weights.

Modes (``--hf-modes``): ``eager`` is ``generate`` (greedy, left-padded batches);
``static`` is ``generate`` with ``cache_implementation="static"``, whose decode forward
transformers compiles on GPUs (an untimed warm-up pays the compile; its time is reported);
``batch`` is ``generate_batch`` (continuous batching). A dummy-weight paged model is copied
into an HF model of the same config as views (no extra memory); a checkpoint is loaded by HF
from the same path. paged's engine is released first, so only one KV cache lives at a time.
Importing this module is cheap: torch and transformers load only when the baseline runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import math
import os
import time
from collections.abc import Iterator
from typing import Any

from paged.cli.bench_offline import register_baseline

MODES = ("eager", "static", "batch")
LABELS = {"eager": "hf generate", "static": "hf generate static", "batch": "hf generate_batch"}


def add_args(p: argparse.ArgumentParser, bench: str) -> None:
    g = p.add_argument_group("--baseline hf (HF transformers on the same weights)")
    g.add_argument("--hf-modes", default=",".join(MODES), help="comma list of eager,static,batch")
    g.add_argument(
        "--hf-batch-size",
        type=int,
        default=64 if bench == "throughput" else 1,
        help="prompts per generate call for eager and static",
    )
    if bench == "latency":
        g.add_argument("--hf-num-iters", type=int, default=None, help="default: --num-iters")
    if bench == "throughput":
        g.add_argument("--hf-num-prompts", type=int, default=None, help="cap (default: all)")
        g.add_argument(
            "--hf-max-seconds",
            type=float,
            default=None,
            help="time budget per mode: eager/static stop after the batch that would pass it; "
            "batch sizes its prompt count from a warm-up probe",
        )


# ---- the HF model on paged's weights ----------------------------------------------------
# paged's stacked experts (model/moe.py) and transformers' (Qwen3-MoE, Mixtral): same layout
_MOE_NAMES = ((".mlp.w13", ".mlp.experts.gate_up_proj"), (".mlp.w2", ".mlp.experts.down_proj"))


def paged_to_hf_weights(model, fused: set[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """paged's parameters under HF names, stacked q/k/v and gate/up split back (views),
    except those HF keeps fused too (`fused`: HF's names, e.g. Phi-3's qkv_proj)."""
    by_stack: dict[str, dict[int, str]] = {}
    for frag, (stacked, idx) in model.stacked.items():
        by_stack.setdefault(stacked, {})[idx] = frag
    for name, p in model.named_parameters():
        hf_name = name if name.startswith("lm_head") else f"model.{name}"
        for ours, theirs in _MOE_NAMES:  # stacked experts: transformers' in-memory layout
            if hf_name.endswith(ours):
                hf_name = hf_name.removesuffix(ours) + theirs
        parts = name.split(".")
        stacked = next((s for s in by_stack if s in parts), None)
        if stacked is None or hf_name in fused:
            yield hf_name, p.detach()
            continue
        for idx, piece in enumerate(p.detach().split(model._shard_sizes(name), dim=0)):
            yield hf_name.replace(stacked, by_stack[stacked][idx]), piece


def hf_from_paged(model, hf_config, dtype, device):
    """An HF CausalLM whose parameters are views of paged `model`'s: the same weights."""
    import torch

    if any(not hasattr(m, "weight") for m in model.modules() if hasattr(m, "out_features")):
        raise ValueError(
            "the engine's weights were reordered for this device (paged-cpu, bfloat16): "
            "pass --no-cpu-packed-weights (LLM(cpu_packed_weights=False); env fallback "
            "PAGED_CPU_PACKED_WEIGHTS=0) to compare with HF on the same weights"
        )
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(hf_config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        missing, unexpected = hf.load_state_dict(
            dict(paged_to_hf_weights(model, set(hf.state_dict()))), strict=False, assign=True
        )
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if tied:
        hf.tie_weights()
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"paged -> HF weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # Buffers computed in __init__ (rotary inv_freq) were made on meta: rebuild those modules.
    for name, mod in list(hf.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if hasattr(mod, "scalar_embed_scale"):  # Gemma's scaled embedding: a constant
                mod.embed_scale = torch.tensor(mod.scalar_embed_scale, device=device)
                continue
            parent, _, attr = name.rpartition(".")
            with torch.device(device):
                setattr(hf.get_submodule(parent), attr, type(mod)(hf.config))
    bad = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if bad:
        raise ValueError(f"paged -> HF weights: still on meta: {bad[:5]}")
    return hf.eval()


def hf_model(llm, release: bool = False):
    """HF transformers' model of the same weights as paged's `llm`, on the same device.
    With `release`, paged's engine is freed first (after the copy, for dummy weights)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    eng = llm.engine
    dtype, device, src = eng.runner.dtype, eng.platform.device, eng.source
    if eng.config.load_format == "dummy" or src is None:
        hf = hf_from_paged(eng.runner.model, eng.hf_config, dtype, device)
        del eng
        if release:
            release_engine(llm)
    else:
        del eng
        if release:  # before HF loads its own copy: one model and no KV cache at a time
            release_engine(llm)
        if src.kind == "gguf":
            d, f = os.path.split(src.path)
            hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, local_files_only=True)
        hf = hf.to(device).eval()
    # A checkpoint's sampling defaults would fill our config's unset fields: start neutral.
    hf.generation_config = GenerationConfig(do_sample=False)
    return hf


def release_engine(llm) -> None:
    """Free paged's KV cache, graphs and scheduler; weights shared with HF views survive."""
    eng = llm.engine
    for layer in getattr(eng.runner.model, "layers", []):
        layer.self_attn.kv_cache = None
    eng.runner.kv_caches = []
    llm.engine = None
    platform = eng.platform
    del eng
    gc.collect()
    platform.empty_cache()


def _free(device) -> None:
    """Collect garbage and return cached device memory (the device module's own call)."""
    import torch

    gc.collect()
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "empty_cache"):
        mod.empty_cache()


def _sync(device) -> None:
    import torch

    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


# ---- one HF mode --------------------------------------------------------------------
class HFRunner:
    """run(prompts, n) -> (seconds, tokens generated) for one mode; `n` tokens per prompt."""

    def __init__(self, model, mode: str, device) -> None:
        self.model, self.mode, self.device = model, mode, device
        eos = getattr(model.config, "eos_token_id", None)
        eos = eos if isinstance(eos, int) else (eos[0] if eos else 0)
        self.eos = eos
        self.startup_s: list[float] = []  # generate_batch: manager start-up per call

    def gen_config(self, n: int):
        from transformers import GenerationConfig

        if self.mode == "batch":  # eos -1: never matches, so every request runs to n
            return GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=-1)
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,  # eos is masked until n: never stops early
            eos_token_id=self.eos,
            pad_token_id=self.eos,
            cache_implementation="static" if self.mode == "static" else None,
        )

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, int]:
        if self.mode == "batch":
            return self._run_batch(prompts, n)
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, generation_config=self.gen_config(n)
        )
        _sync(self.device)
        return time.perf_counter() - t0, (out.shape[1] - width) * len(prompts)

    def _run_batch(self, prompts: list[list[int]], n: int) -> tuple[float, int]:
        fn = self.model.generate_batch
        params = inspect.signature(fn).parameters
        kw: dict[str, Any] = {"generation_config": self.gen_config(n)}
        if "progress_bar" in params:
            kw["progress_bar"] = False
        cb = self._cb_config(prompts, n)
        if cb is not None and "continuous_batching_config" in params:
            kw["continuous_batching_config"] = cb
        t0 = time.perf_counter()
        outs = fn(inputs=[list(p) for p in prompts], **kw)
        _sync(self.device)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.generated_tokens) for o in outs.values())
        failed = [o.error for o in outs.values() if getattr(o, "error", None)]
        if failed or len(outs) != len(prompts):
            raise RuntimeError(f"generate_batch: {len(outs)}/{len(prompts)} done; {failed[:1]}")
        # From the first request's arrival to the last one's end: without manager start-up.
        try:
            start = min(o.created_time for o in outs.values())
            end = max(o.lifespan[1] for o in outs.values())
            gen = end - start if 0 < end - start <= wall else wall
        except (AttributeError, TypeError, IndexError, ValueError):
            gen = wall
        self.startup_s.append(wall - gen)
        return gen, tokens

    def _cb_config(self, prompts: list[list[int]], n: int):
        """On CPU, a KV cache sized to the work (its default sizing from memory is slow)."""
        if self.device.type != "cpu":
            return None
        try:
            from transformers import ContinuousBatchingConfig
        except ImportError:
            return None
        tokens = sum(len(p) + n for p in prompts)
        return ContinuousBatchingConfig(
            num_blocks=math.ceil(tokens / 256) + len(prompts) + 4, max_batch_tokens=256
        )


def _modes(args: argparse.Namespace, model=None) -> tuple[list[str], dict[str, str]]:
    """The modes to run, in MODES order (generate_batch last: it may switch attention)."""
    wanted = [m.strip() for m in args.hf_modes.split(",") if m.strip()]
    bad = [m for m in wanted if m not in MODES]
    if bad:
        raise ValueError(f"--hf-modes: unknown {bad}; choose from {', '.join(MODES)}")
    wanted = [m for m in MODES if m in wanted]
    skipped = {}
    if "batch" in wanted and model is not None and not hasattr(model, "generate_batch"):
        skipped["batch"] = "this transformers has no generate_batch"
    return [m for m in wanted if m not in skipped], skipped


def _compiled(model) -> bool:
    return getattr(model, "_compiled_call", None) is not None


def _setup(llm):
    import transformers

    device = llm.engine.platform.device
    t0 = time.perf_counter()
    model = hf_model(llm, release=True)
    load_s = time.perf_counter() - t0
    print(f"hf: transformers {transformers.__version__} on {device}, model ready in {load_s:.1f} s")
    info = {"transformers": transformers.__version__, "device": str(device), "load_s": load_s}
    return model, device, info


def _cleanup(model) -> None:
    for attr in ("_cache", "_compiled_call"):
        if hasattr(model, attr):
            delattr(model, attr)
    _free(next(model.parameters()).device)


# ---- throughput ---------------------------------------------------------------------
@register_baseline("hf")
def hf_baseline(args, prompts, output_len, llm=None, paged: dict | None = None):
    if llm is None:
        raise ValueError("--baseline hf needs the paged LLM (its weights and device)")
    _modes(args)  # bad --hf-modes: fail before any work
    fn = _throughput if hasattr(args, "hf_num_prompts") else _latency
    return fn(args, prompts, output_len, llm, paged or {})


def _throughput(args, prompts, n, llm, paged: dict) -> dict:
    model, device, info = _setup(llm)
    modes, skipped = _modes(args, model)
    cap = args.hf_num_prompts or len(prompts)
    results: dict[str, dict] = {}
    for mode in modes:
        print(f"hf: {mode} ...", flush=True)
        try:
            results[mode] = _throughput_mode(HFRunner(model, mode, device), prompts[:cap], n, args)
            r = results[mode]
            print(f"hf: {mode}: {r['output_tokens_per_s']:.1f} output tok/s", flush=True)
        except Exception as e:  # one mode failing must not lose the others
            skipped[mode] = f"{type(e).__name__}: {e}"
            print(f"hf: {mode} failed: {skipped[mode]}", flush=True)
        _cleanup(model)
    ours = paged.get("total_tokens_per_s", 0.0)
    for r in results.values():
        r["paged_speedup"] = ours / r["total_tokens_per_s"] if r["total_tokens_per_s"] else 0.0
    rows = [("paged", "-", paged.get("num_requests", len(prompts)), paged, None)]
    rows += [
        (LABELS[m], results[m]["batch_size"], results[m]["num_prompts"], results[m], m)
        for m in results
    ]
    print(f"{' paged vs HF transformers (same weights) ':=^78}")
    print(f"{'':<24}{'batch':>7}{'prompts':>9}{'out tok/s':>12}{'total tok/s':>13}{'paged x':>10}")
    for label, bs, num, r, mode in rows:
        x = f"{r['paged_speedup']:.2f}" if mode else ""
        print(
            f"{label:<24}{bs!s:>7}{num:>9}{r.get('output_tokens_per_s', 0):>12.1f}"
            f"{r.get('total_tokens_per_s', 0):>13.1f}{x:>10}"
        )
    _print_notes(results, skipped)
    return {"baseline": "hf", "hf": results, "hf_skipped": skipped, "hf_info": info}


def _throughput_mode(runner: HFRunner, prompts: list[list[int]], n: int, args) -> dict:
    budget = args.hf_max_seconds
    bs = min(args.hf_batch_size, len(prompts))
    r: dict[str, Any] = {"mode": runner.mode}
    if runner.mode == "batch":
        probe = prompts[:bs]
        r["warmup_s"], _ = runner.run(probe, n)  # also the warm-up
        count = len(prompts)
        if budget and r["warmup_s"] > 0:  # the probe is slower per prompt than a full run
            count = min(count, max(len(probe), int(budget * len(probe) / r["warmup_s"])))
        elapsed, tokens = runner.run(prompts[:count], n)
        r |= {"batch_size": "auto", "startup_s": runner.startup_s[-1]}
    else:
        batches = [prompts[i : i + bs] for i in range(0, len(prompts) - bs + 1, bs)]
        t0 = time.perf_counter()
        if runner.mode == "static":  # compile + capture at the timed shapes
            runner.run(batches[0], n)
        else:
            runner.run(batches[0][:2], 2)
        r["warmup_s"] = time.perf_counter() - t0
        elapsed = tokens = count = 0
        for b in batches:
            s, t = runner.run(b, n)
            elapsed, tokens, count = elapsed + s, tokens + t, count + len(b)
            if budget and elapsed * (count + len(b)) / count > budget:
                break
        r["batch_size"] = bs
        if runner.mode == "static":
            r["compiled"] = _compiled(runner.model)
            r["compile_s"] = max(0.0, r["warmup_s"] - elapsed * bs / count)
    n_in = sum(len(p) for p in prompts[:count])
    r |= {
        "num_prompts": count,
        "elapsed_s": elapsed,
        "total_output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "total_tokens_per_s": (n_in + tokens) / elapsed,
    }
    return r


# ---- latency ------------------------------------------------------------------------
def _latency(args, prompts, n, llm, paged: dict) -> dict:
    model, device, info = _setup(llm)
    modes, skipped = _modes(args, model)
    batch = [prompts[i % len(prompts)] for i in range(args.hf_batch_size)]
    results: dict[str, dict] = {}
    for mode in modes:
        print(f"hf: {mode} ...", flush=True)
        try:
            results[mode] = _latency_mode(HFRunner(model, mode, device), batch, n, args)
            r = results[mode]
            print(f"hf: {mode}: {r['tpot_ms']:.2f} ms/token", flush=True)
        except Exception as e:
            skipped[mode] = f"{type(e).__name__}: {e}"
            print(f"hf: {mode} failed: {skipped[mode]}", flush=True)
        _cleanup(model)
    ours = paged.get("mean_tpot_ms", 0.0)
    for r in results.values():
        r["paged_speedup"] = r["tpot_ms"] / ours if ours else 0.0
    print(f"{' paged (mean) vs HF transformers (best run), same weights ':=^74}")
    print(f"{'':<24}{'batch':>7}{'TTFT ms':>12}{'ms/token':>12}{'e2e ms':>10}{'paged x':>9}")
    p = paged
    print(
        f"{'paged':<24}{p.get('batch_size', '-')!s:>7}{p.get('mean_ttft_ms', 0):>12.2f}"
        f"{p.get('mean_tpot_ms', 0):>12.2f}{p.get('mean_e2el_ms', 0):>10.1f}{'':>9}"
    )
    for m, r in results.items():  # HF: best of --hf-num-iters runs
        print(
            f"{LABELS[m]:<24}{r['batch_size']:>7}{r['ttft_ms']:>12.2f}"
            f"{r['tpot_ms']:>12.2f}{r['e2el_ms']:>10.1f}{r['paged_speedup']:>9.2f}"
        )
    _print_notes(results, skipped)
    return {"baseline": "hf", "hf": results, "hf_skipped": skipped, "hf_info": info}


def _latency_mode(runner: HFRunner, batch: list[list[int]], n: int, args) -> dict:
    t0 = time.perf_counter()
    for _ in range(max(1, args.num_iters_warmup)):  # static: the compile happens here
        runner.run(batch, n)
    r: dict[str, Any] = {"mode": runner.mode, "batch_size": len(batch)}
    r["warmup_s"] = time.perf_counter() - t0
    ttft, e2e = [], []
    for _ in range(max(1, args.hf_num_iters or args.num_iters)):
        ttft.append(runner.run(batch, 1)[0])  # prefill + first token
        e2e.append(runner.run(batch, n)[0])
    # Best of the runs (kind to HF): decode per token from the fastest full and 1-token runs.
    best_ttft, best_e2e = min(ttft) * 1000, min(e2e) * 1000
    r |= {
        "num_iters": len(e2e),
        "ttft_ms": best_ttft,
        "e2el_ms": best_e2e,
        "tpot_ms": (best_e2e - best_ttft) / (n - 1) if n > 1 else 0.0,
        "mean_ttft_ms": sum(ttft) / len(ttft) * 1000,
        "mean_e2el_ms": sum(e2e) / len(e2e) * 1000,
    }
    r["decode_tokens_per_s"] = len(batch) * 1000 / r["tpot_ms"] if r["tpot_ms"] > 0 else 0.0
    if runner.mode == "static":
        r["compiled"] = _compiled(runner.model)
        warm = max(1, args.num_iters_warmup)
        r["compile_s"] = max(0.0, r["warmup_s"] - warm * r["mean_e2el_ms"] / 1000)
    if runner.startup_s:
        r["startup_s"] = sum(runner.startup_s) / len(runner.startup_s)
    return r


def _print_notes(results: dict[str, dict], skipped: dict[str, str]) -> None:
    for m, r in results.items():
        if m == "static":
            state = (
                "compiled" if r.get("compiled") else "not compiled (transformers compiles on GPUs)"
            )
            print(
                f"  static: {state}; warm-up {r['warmup_s']:.1f} s, compile ~{r['compile_s']:.1f} s"
            )
        if m == "batch" and "startup_s" in r:
            print(f"  generate_batch: manager start-up {r['startup_s']:.1f} s per call, untimed")
    for m, why in skipped.items():
        print(f"  skipped {m}: {why}")
    print("=" * 78)
