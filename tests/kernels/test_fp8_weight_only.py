"""`--cuda-fp8-weight-only-decode` (paged_cuda.fp8_weight_only): the configs it tries, and the
engine with it on the interpreter: one-row fp8 linears on the split-K GEMV with the weight's
scales and the input unquantized, greedy output equal to the dequantized linears'."""

from __future__ import annotations

import pytest
import torch
import triton

fp8_weight_only = pytest.importorskip("paged_cuda.fp8_weight_only")
gemv_select = pytest.importorskip("paged_cuda.gemv_select")

H200 = (132, 232448)  # SMs, shared memory a block (bytes)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_fp8_configs_read_as_many_bytes_a_step_where_they_fit(n, k):
    wide, narrow = gemv_select.candidates(n, k, itemsize=1), gemv_select.candidates(n, k)
    assert [c[:1] + c[2:] for c in wide] == [c[:1] + c[2:] for c in narrow]
    for (block_n, block_k, split, _), (_, bf16_k, _, _) in zip(wide, narrow):
        assert block_n * block_k <= 8192 and k // split >= block_k
        assert block_k == (2 * bf16_k if k // split >= 2 * bf16_k and block_n * bf16_k <= 4096
                           else bf16_k)  # fmt: skip
    assert any(c != d for c, d in zip(wide, narrow))


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (512, 4096), (48, 64)])
def test_the_untimed_config_splits_k_only_to_fill_the_gpu(n, k):
    block_n, block_k, split, warps = fp8_weight_only.default_config(n, k, H200[0])
    assert (block_n, warps) == (4, 4) and block_k == min(1024, triton.next_power_of_2(k))
    assert k // split >= block_k
    want = {(6144, 4096): 1, (4096, 14336): 1, (512, 4096): 4, (48, 64): 1}[(n, k)]
    assert split == want  # 128 blocks of 4 rows: 4 x 128 >= 2 x 132 programs


@pytest.mark.slow  # interpreted Triton through the engine, twice
def test_weight_only_fp8_decode_in_the_engine(tiny_models, monkeypatch, engines_on,
                                              interpreter_only):  # fmt: skip
    """With the option's installer run (untimed; the GPU faked), every decode step's fp8
    linears run the split-K GEMV with the weight's scales, the residual add and RMSNorm folded
    into QKV and gate/up (but the first layer's) and SiLU-and-mul into down; prefill keeps the
    fp8 GEMM. Greedy output equals an engine whose one-row fp8 linears are the dequantized
    weights' float32 F.linear."""
    from test_fp8_select import fp8_ops_on_cpu

    from paged import LLM, SamplingParams
    from paged.kernels import gemv
    from paged.quantization.base import QuantLinear
    from paged_cpu.platform import CpuPlatform

    weight_only = []

    def dequantized(mod):
        w = mod.weight.float() * mod.weight_scale

        def forward(x):
            if x.dim() == 2 and x.shape[0] == 1:
                return torch.nn.functional.linear(x, w, mod.bias)
            return type(mod).forward(mod, x)

        return forward

    class Fp8OnCpu(fp8_ops_on_cpu(CpuPlatform)):
        name = "fp8-weight-only-on-cpu"

        def prepare_model(self, model, config, source=None) -> None:
            super().prepare_model(model, config, source)
            if not weight_only[0]:
                for mod in model.modules():
                    if isinstance(mod, QuantLinear):
                        mod.forward = dequantized(mod)
                return
            with monkeypatch.context() as mp:
                mp.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
                mp.setattr(fp8_weight_only, "device_limits", lambda device: H200)
                mp.setattr(torch.cuda, "synchronize", lambda: None)
                fp8_weight_only.use_weight_only_fp8_gemv(model, timed=False)

    engines_on(Fp8OnCpu())
    calls = []
    real = gemv.gemv_split_k
    monkeypatch.setattr(gemv, "gemv_split_k", lambda *a: calls.append(
        (len(a[0]), a[5] is not None, a[6], a[7] is not None)) or real(*a))  # fmt: skip
    prompt = list(range(3, 40, 3))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = []
    for on in (False, True):
        weight_only[:] = [on]
        llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="16MiB",
                  quantization="fp8")  # fmt: skip
        got.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        layers = len(llm.engine.runner.model.layers)
        del llm
    assert got[0] == got[1]
    assert len(calls) == 3 * 4 * layers  # 3 decode steps, 4 linears a layer
    assert all(rows == 1 and scaled for rows, _, _, scaled in calls)
    assert sum(norm for _, norm, _, _ in calls) == 3 * (2 * layers - 1)
    assert sum(silu for _, _, silu, _ in calls) == 3 * layers


def test_timed_choice_of_config_and_fold(tiny_models, monkeypatch):
    """Timed (timers and the GPU faked): every shape tries each config, those after a norm or
    SiLU-and-mul also after the op's own kernel; the fastest is installed with the weight's
    scales, whatever the fp8 GEMV's own timing chose."""
    from paged import LLM
    from paged.kernels.gemv import OneRowGemv
    from paged.quantization.base import QuantLinear

    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="16MiB", quantization="fp8")
    model = llm.engine.runner.model
    layer = model.layers[0]
    shapes: dict = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            shapes.setdefault(tuple(mod.weight.shape), []).append(mod)
    configs = [(4, 32, 1, 4), (8, 32, 2, 4)]
    monkeypatch.setattr(fp8_weight_only, "fp8_linears", lambda model: shapes)
    monkeypatch.setattr(fp8_weight_only, "device_limits", lambda device: H200)
    monkeypatch.setattr(gemv_select, "candidates", lambda n, k, itemsize=2: configs)
    compiled, timed = [], []
    monkeypatch.setattr(fp8_weight_only, "compile_configs",
                        lambda shapes, tries, run, device: compiled.extend(
                            c for shape in shapes for c in tries(*shape)))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    real_calls = gemv_select.gemv_calls

    def spy(inputs, mods, choice, counters, scale=False):
        assert scale
        timed.append((mods[0], choice))
        return real_calls(inputs, mods, choice, counters, scale)

    def fake_time(calls):  # config 2 after the op's kernel is fastest, then config 2 folded
        config, fold = timed[-1][1]
        return 3.0 - (config == configs[1]) - 0.5 * (not fold)

    monkeypatch.setattr(fp8_weight_only, "gemv_calls", spy)
    monkeypatch.setattr(fp8_weight_only, "graph_time_or_inf", fake_time)
    fp8_weight_only.use_weight_only_fp8_gemv(model, timed=True)
    assert sorted(compiled) == sorted(c for _, c in timed)
    for mod, op in ((layer.self_attn.qkv_proj, True), (layer.mlp.gate_up_proj, True),
                    (layer.mlp.down_proj, True), (layer.self_attn.o_proj, False)):  # fmt: skip
        gemv = vars(mod)["forward"]
        assert isinstance(gemv, OneRowGemv) and gemv.scale is mod.weight_scale
        assert gemv.config == configs[1] and gemv.fold == (not op)
        first = shapes[tuple(mod.weight.shape)][0]
        tried = sorted(c for m, c in timed if m is first)
        assert tried == sorted((c, f) for c in configs for f in ([True, False] if op else [True]))
    del llm
