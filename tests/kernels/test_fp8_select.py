"""The CUDA plugin's measured choice between the unsplit and the split-K fp8 decode GEMV
(paged_cuda.fp8_select): the candidate configs, the choice under given timings, and which
linears it times. On a GPU the timings are real: `paged bench latency --quantization fp8`
logs each shape's choice."""

from __future__ import annotations

import math

import pytest
import torch
import triton
from torch import nn

fp8_select = pytest.importorskip("paged_cuda.fp8_select")

H200 = (132, 232448)  # SMs, shared memory a block (bytes)
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("n, k", [*LLAMA_8B, (128256, 4096), (2048, 4096), (512, 2048)])
@pytest.mark.parametrize("sms, smem", [H200, (84, 101376)])  # and an Ada GPU's
def test_candidates_fill_the_gpu_with_whole_slices_that_fit(n, k, sms, smem):
    got = fp8_select.candidates(n, k, sms, smem)
    assert len(got) == len(set(got)) <= 16
    for block_n, block_k, split, warps, stages in got:
        per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # whole BLOCK_K steps
        assert split > 1 and warps == 4 and sms <= triton.cdiv(n, block_n) * split <= 4 * sms
        assert per >= block_k and per * (split - 1) < k  # no empty slice
        assert 1 <= stages <= min(4, per // block_k)
        assert stages * (block_n + 16) * block_k <= smem - fp8_select.SMEM_SLACK
    if (n, k) == (128256, 4096):  # an LM head: enough output blocks already
        assert got == []
    if (n, k) in LLAMA_8B and (sms, smem) == H200:
        assert got


@pytest.mark.parametrize("sms, smem", [H200, (84, 101376)])
def test_one_slice_tiles_only_where_the_output_blocks_fill_the_gpu(sms, smem):
    for n, k in LLAMA_8B:
        got = fp8_select.one_slice(n, k, sms, smem)
        assert len(got) == len(set(got))
        for block_n, block_k, split, _, stages in got:
            assert split == 1 and triton.cdiv(n, block_n) >= sms and block_k <= k
            assert 1 <= stages <= 4 and stages * (block_n + 16) * block_k <= smem - 8192
        assert bool(got) == (triton.cdiv(n, 64) >= sms)  # on an H200 gate/up alone


def test_stages_follow_the_steps_and_the_shared_memory():
    assert fp8_select.stages_for(64, 512, 8, 232448) == 4
    assert fp8_select.stages_for(64, 512, 2, 232448) == 2  # no more stages than steps
    assert fp8_select.stages_for(128, 512, 8, 232448) == 3  # 3 x 72 KB
    assert fp8_select.stages_for(128, 512, 8, 101376) == 1


def test_a_shape_takes_the_fastest_split_only_when_it_beats_the_unsplit_kernel():
    shapes = {(4096, 4096): ["o"] * 3, (6144, 4096): ["qkv"] * 2, (28672, 4096): ["gate_up"],
              (128256, 4096): ["head"]}  # fmt: skip
    unsplit = {"o": 10e-6, "qkv": 10e-6, "gate_up": 30e-6}
    timed = []

    def configs(n, k):
        return fp8_select.candidates(n, k, *H200)

    def time_unsplit(mods):
        timed.append(mods[0])
        return unsplit[mods[0]]

    def time_split(mods, config):
        if config[2] == 8:  # does not compile: shared memory
            return math.inf
        if mods[0] == "gate_up":  # never faster enough
            return 29.5e-6
        return {"o": 6e-6, "qkv": 9e-6}[mods[0]] * (1 + config[2] / 100 + config[0] / 1e4)

    chosen = fp8_select.choose(shapes, configs, time_unsplit, time_split)
    assert set(chosen) == {(4096, 4096), (6144, 4096)}
    assert timed == ["o", "qkv", "gate_up"]  # a shape with no candidate is not timed at all
    config, best, base = chosen[(4096, 4096)]
    assert base == 10e-6 and config[2] == min(c[2] for c in configs(4096, 4096))
    assert best == min(time_split(["o"], c) for c in configs(4096, 4096))


def test_nothing_is_chosen_when_no_split_config_runs():
    chosen = fp8_select.choose({(4096, 4096): ["o"]}, lambda n, k: [(64, 256, 4, 4, 2)],
                               lambda mods: 1.0, lambda mods, c: math.inf)  # fmt: skip
    assert chosen == {}


def test_only_per_channel_fp8_linears_on_the_gpu_are_timed(monkeypatch):
    """Per-channel fp8 QuantLinears by weight shape; not block-scaled ones, dense linears,
    linears already given a forward, or (here, on CPU) any: they are not on a GPU."""
    from paged.quantization.base import QuantLinear
    from paged.quantization.fp8 import Fp8Method

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = QuantLinear(64, 32, False, Fp8Method())
            self.b = QuantLinear(64, 32, True, Fp8Method())
            self.c = QuantLinear(64, 48, False, Fp8Method())
            self.blocks = QuantLinear(256, 32, False, Fp8Method(block=(128, 128)))
            self.dense = nn.Linear(64, 32)
            self.done = QuantLinear(64, 32, False, Fp8Method())
            self.done.forward = lambda x: x

    model = Model()
    assert fp8_select.fp8_linears(model) == {}  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    got = fp8_select.fp8_linears(model)
    assert got == {(32, 64): [model.a, model.b], (48, 64): [model.c]}


def fp8_ops_on_cpu(base: type) -> type:
    """`base` (the cpu platform) with the Triton fp8 linear and the fused norm and SiLU-and-mul
    ops (foldable into a one-row GEMV), for the engine on the interpreter."""

    class Fp8Ops(base):
        def ops(self):
            from paged.kernels.ops import triton_fused_ops

            table = triton_fused_ops()
            names = ("fp8_linear", "fused_add_rms_norm", "add_rms_norm_linear", "silu_and_mul",
                     "silu_and_mul_linear")  # fmt: skip
            return {name: table[name] for name in names}

    return Fp8Ops


@pytest.mark.slow  # 37 s: interpreted Triton through the engine, with the long checks
def test_split_fp8_gemvs_in_the_engine(tiny_models, monkeypatch, engines_on, interpreter_only):
    """Every per-channel fp8 linear on the split GEMV (as if start-up timing chose it for every
    shape): the decode rows run it (the prefill's rows the fp8 GEMM), with every residual add
    and RMSNorm but the first layer's folded into the QKV and gate/up GEMVs and SiLU-and-mul
    into the down projection's (or, with rows "amax", the ops' own kernels writing the rows'
    absmax), and greedy output equals the unsplit GEMV's after the norm and activation
    kernels."""
    from paged import LLM, SamplingParams
    from paged.kernels import fp8_gemv
    from paged.quantization.base import QuantLinear
    from paged_cpu.platform import CpuPlatform

    split = []

    class Fp8OnCpu(fp8_ops_on_cpu(CpuPlatform)):
        name = "fp8-split-on-cpu"

        def prepare_model(self, model, config, source=None) -> None:
            super().prepare_model(model, config, source)
            counters = torch.zeros(64, dtype=torch.int32)
            for mod in model.modules():
                if isinstance(mod, QuantLinear) and split[0]:
                    mod.forward = fp8_gemv.Fp8SplitGemv(mod, (16, 32, 3, 4, 1), counters,
                                                        rows=split[0])

    engines_on(Fp8OnCpu())
    rows, ops_first = [], []
    real, real_norm = fp8_gemv.fp8_gemv_split, fp8_gemv.fused_add_rms_norm
    real_silu = fp8_gemv.silu_and_mul_absmax
    monkeypatch.setattr(fp8_gemv, "fp8_gemv_split", lambda x, *a, **kw: rows.append(
        (len(x), a[5] is not None if len(a) > 5 else False, a[6] if len(a) > 6 else False))
        or real(x, *a, **kw))  # fmt: skip
    monkeypatch.setattr(fp8_gemv, "fused_add_rms_norm", lambda *a: ops_first.append("norm")
                        or real_norm(*a))  # fmt: skip
    monkeypatch.setattr(fp8_gemv, "silu_and_mul_absmax", lambda x: ops_first.append("silu")
                        or real_silu(x))  # fmt: skip
    prompt = list(range(3, 40, 3))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = []
    for mode in (None, "fold", "amax"):
        split[:] = [mode]
        llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="16MiB",
                  quantization="fp8")  # fmt: skip
        got.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        layers = len(llm.engine.runner.model.layers)
        # 3 decode steps, 4 linears a layer
        assert len(rows) == (3 * 4 * layers if mode else 0)
        assert len(ops_first) == (3 * 3 * layers - 3 if mode == "amax" else 0)  # not o_proj
        if mode == "fold":
            assert {m for m, _, _ in rows} == {1}
            assert sum(norm for _, norm, _ in rows) == 3 * (2 * layers - 1)  # not layer 0's
            assert sum(silu for _, _, silu in rows) == 3 * layers
        if mode == "amax":  # the ops in their own kernels, not the GEMV
            assert ops_first.count("norm") == 3 * (2 * layers - 1)
            assert ops_first.count("silu") == 3 * layers
            assert not any(norm or silu for _, norm, silu in rows)
        rows.clear()
        del llm
    assert got[0] == got[1] == got[2]


def test_normed_and_gated_shapes_are_timed_with_their_op(tiny_models, monkeypatch,
                                                         interpreter_only):  # fmt: skip
    """Start-up timing of an fp8 model (timers and the GPU faked): every shape tries the unsplit
    kernel's tile on the split kernel first; QKV and gate/up are timed with the residual add
    and RMSNorm (the norm op before the unsplit GEMV, folded into the split one), down with
    SiLU-and-mul, o_proj with neither, QKV, gate/up and down also with the op's kernel writing
    the rows' absmax; a config that wins is installed with the op foldable, and the absmax
    written by the op's kernel if that won. Every variant timed was compiled ahead first."""
    from paged import LLM
    from paged.kernels import fp8_gemv
    from paged.kernels.gemv import dot_config
    from paged.model import ops

    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="16MiB", quantization="fp8")
    model = llm.engine.runner.model
    layer = model.layers[0]
    kinds = {(m.weight.shape[0], m.weight.shape[1]): kind for kind, m in (
        ("norm", layer.self_attn.qkv_proj), ("norm", layer.mlp.gate_up_proj),
        ("silu", layer.mlp.down_proj), ("plain", layer.self_attn.o_proj))}  # fmt: skip
    assert len(kinds) == 4  # four shapes, one op each
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(fp8_select, "device_limits", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    unsplit, split = [], []
    monkeypatch.setattr(fp8_select, "fp8_gemv_dot", lambda x, w, *a: unsplit.append((w, x)))
    monkeypatch.setattr(fp8_select, "fp8_gemv_split", lambda x, w, s, b, config, counters,
                        norm=None, silu=False, x_amax=None: split.append(
                            (w, config, norm is not None, silu,
                             "fold" if x_amax is None else "amax")))  # fmt: skip
    ops_first = []  # the op's own kernel writing the absmax
    monkeypatch.setattr(fp8_select, "fused_add_rms_norm", lambda x, r, g, eps, amax:
                        ops_first.append("norm") or (x, r))  # fmt: skip
    monkeypatch.setattr(fp8_select, "silu_and_mul_absmax", lambda x: ops_first.append("silu")
                        or (x, torch.ones(len(x), 1)))  # fmt: skip
    norms = []
    real_norm = llm.engine.runner.op_table["fused_add_rms_norm"]
    counting = {**llm.engine.runner.op_table,
                "fused_add_rms_norm": lambda *a: norms.append(1) or real_norm(*a)}  # fmt: skip

    def run_once(calls):
        for call in calls:
            call()
        return 1.0

    monkeypatch.setattr(fp8_select, "graph_time", run_once)
    firsts = {}

    def split_time(calls):  # the unsplit tile (the first config of a shape) wins, with amax
        before = len(split)
        run_once(calls)
        w, config, _, _, rows = split[before]
        firsts.setdefault(tuple(w.shape), config)
        return (0.5 if config == firsts[tuple(w.shape)] else 0.9) - 0.1 * (rows == "amax")

    monkeypatch.setattr(fp8_select, "graph_time_or_inf", split_time)
    compiled = []  # what start-up compiles ahead: a shape's first module under each config

    def compile_configs(shapes, configs, run, device, also=()):
        for shape, mods in shapes.items():
            for config in configs(*shape):
                run(mods[0], config)
        for call in also:
            call()
        compiled.extend((len(split), len(ops_first), len(unsplit), len(norms)))

    monkeypatch.setattr(fp8_select, "compile_configs", compile_configs)
    with ops.using(counting):
        fp8_select.use_measured_fp8_gemv(model)
    variant = lambda entries: {(tuple(w.shape), *rest) for w, *rest in entries}  # noqa: E731
    assert compiled and variant(split[:compiled[0]]) == variant(split[compiled[0]:])
    shapes = lambda entries: {tuple(w.shape) for w, _ in entries}  # noqa: E731
    assert compiled[2] == 4 and shapes(unsplit[:4]) == shapes(unsplit[4:]) == set(kinds)
    del split[:compiled[0]], ops_first[:compiled[1]], unsplit[:4], norms[:compiled[3]]
    for shape, config in firsts.items():
        block_n, block_k, warps, stages = dot_config(*shape, torch.device("cpu"))
        assert config == (block_n, block_k, 1, warps, stages)
    for w, _, normed, silu, rows in split:
        kind = kinds[tuple(w.shape)]
        assert (normed, silu) == ((kind == "norm", kind == "silu") if rows == "fold" else
                                  (False, False))  # fmt: skip
    tried = [kinds[tuple(w.shape)] for w, *_, rows in split if rows == "amax"]
    assert set(tried) == {"norm", "silu"}  # not o_proj: no op before it
    assert sorted(ops_first) == sorted(tried)
    assert len(norms) == sum(kinds[tuple(w.shape)] == "norm" for w, _ in unsplit) > 0
    for mod in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                layer.self_attn.o_proj):  # fmt: skip
        gemv = vars(mod)["forward"]
        assert isinstance(gemv, fp8_gemv.Fp8SplitGemv) and gemv.config[2] == 1
        assert gemv.rows == ("fold" if mod is layer.self_attn.o_proj else "amax")
