"""The CUDA plugin's measured choice between cuBLAS and the split-K GEMV for one-row dense
linears (paged_cuda.gemv_select): the candidate configs, the choice under given timings, and
the installed forward (the GEMV at one row, F.linear otherwise) on the interpreter. On a GPU
the timings are real: `paged bench latency` logs each shape's choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

gemv_select = pytest.importorskip("paged_cuda.gemv_select")


@pytest.mark.parametrize("n, k", [(2048, 4096), (128, 2048), (4096, 14336), (128256, 4096)])
def test_candidates_fill_the_gpu_without_tiny_slices(n, k):
    got = gemv_select.candidates(n, k)
    for block_n, block_k, split, _ in got:
        assert 128 <= -(-n // block_n) * split <= 4096 and k // split >= block_k
        assert block_n * block_k <= 8192
    assert (len(got) == 1) == (n == 128256)  # a head this wide: only the widest tiles


def test_a_shape_takes_the_fastest_gemv_only_when_it_beats_cublas():
    shapes = {(2048, 4096): ["o"] * 3, (128, 2048): ["gate"] * 3, (8192, 4096): ["up"],
              (262144, 4096): ["head"]}  # fmt: skip
    cublas = {"o": 9e-6, "gate": 5e-6, "up": 20e-6}
    timed = []

    def time_cublas(mods):
        timed.append(mods[0])
        return cublas[mods[0]]

    def time_gemv(mods, config):
        if mods[0] == "up":  # never faster enough
            return 19.9e-6
        return {"o": 5e-6, "gate": 2e-6}[mods[0]] * (1 + config[2] / 100)  # split 1 fastest

    chosen = gemv_select.choose(shapes, gemv_select.candidates, time_cublas, time_gemv)
    assert set(chosen) == {(2048, 4096), (128, 2048)}
    assert timed == ["o", "gate", "up"]  # a shape with no candidate is not timed at all
    config, best, base = chosen[(2048, 4096)]
    assert base == 9e-6 and best == min(time_gemv(["o"], c)
                                        for c in gemv_select.candidates(2048, 4096))  # fmt: skip


def test_the_installed_forward_runs_the_gemv_at_one_row(device, monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True).to(device)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    calls = []
    from paged.kernels import gemv

    real = gemv.gemv_split_k
    monkeypatch.setattr(gemv, "gemv_split_k", lambda *a: calls.append(1) or real(*a))
    lin.forward = gemv_select.OneRowGemv(lin, (8, 32, 2, 4), counters)
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 64, device=device)
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            assert torch.allclose(lin(x), want, atol=1e-5, rtol=1e-5)
    assert calls == [1]  # the one-row call only


def every_linear_on_the_gemv(engines_on, fold: bool = True) -> None:
    """The engine on the Triton interpreter with every nn.Linear on the one-row GEMV (as if
    start-up timing chose it everywhere), folding the op before it in or not."""
    from test_long_prompt import TritonOnCpu

    class AllGemv(TritonOnCpu):
        def prepare_model(self, model, config, source=None) -> None:
            counters = torch.zeros(1024, dtype=torch.int32)
            for mod in model.modules():
                if type(mod) is nn.Linear:
                    mod.forward = gemv_select.OneRowGemv(mod, (8, 32, 2, 4), counters,
                                                         fold=fold)  # fmt: skip

    engines_on(AllGemv())


def test_shapes_after_an_op_are_timed_folded_and_after_the_ops_kernel(tiny_models,
                                                                      monkeypatch):  # fmt: skip
    """Start-up timing (timers and the GPU faked): QKV, gate/up and down try each config with
    their op folded in and after the op's own kernel, o_proj only the first; the fastest is
    installed with the op folded in or not."""
    from paged import LLM
    from paged.kernels.gemv import OneRowGemv

    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=64, num_kv_blocks=16)
    model = llm.engine.runner.model
    layer = model.layers[0]
    kinds = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
             "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}  # fmt: skip
    shapes: dict = {}
    for lay in model.layers:
        for mod in (lay.self_attn.qkv_proj, lay.self_attn.o_proj, lay.mlp.gate_up_proj,
                    lay.mlp.down_proj):  # fmt: skip
            shapes.setdefault(tuple(mod.weight.shape), []).append(mod)
    assert len(shapes) == 4
    configs = [(4, 32, 1, 4), (8, 32, 2, 4)]
    monkeypatch.setattr(gemv_select, "dense_linears", lambda model: shapes)
    monkeypatch.setattr(gemv_select, "candidates", lambda n, k, itemsize=2: configs)
    monkeypatch.setattr(gemv_select, "compile_configs", lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timed, last = [], []
    real_calls = gemv_select.gemv_calls

    def spy(inputs, mods, choice, counters, scale=False):
        timed.append((mods[0], choice))
        return real_calls(inputs, mods, choice, counters, scale)

    def fake_time(calls):  # cuBLAS 3; the GEMV folded 2, after the op's kernel 1 (config 2: +0.5)
        if len(timed) == len(last):
            return 3.0
        last[:] = timed
        config, fold = timed[-1][1]
        return (2.0 if fold else 1.0) + 0.5 * (config == configs[1])

    monkeypatch.setattr(gemv_select, "gemv_calls", spy)
    monkeypatch.setattr(gemv_select, "graph_time", fake_time)
    gemv_select.use_measured_gemv(model)
    for name, mod in kinds.items():
        tried = [choice for m, choice in timed if m is mod or (m.weight.shape == mod.weight.shape)]
        folds = [True, False] if name != "o" else [True]
        assert sorted(tried) == sorted((c, f) for c in configs for f in folds), name
        gemv = vars(mod)["forward"]
        assert isinstance(gemv, OneRowGemv) and gemv.config == configs[0]
        assert gemv.fold == (name == "o")
    del llm


@pytest.mark.slow  # 16 s: interpreted Triton through the engine, with the long checks
def test_norms_fold_into_the_one_row_gemvs(tiny_models, monkeypatch, engines_on, interpreter_only):
    """Every linear on the one-row GEMV (as if start-up timing chose it everywhere): decode
    steps run each residual add and RMSNorm inside the next projection's GEMV (QKV, gate/up)
    and SiLU-and-mul inside the down projection's, and greedy output equals HF's; prefill rows
    take F.linear and the separate ops."""
    from test_hf_parity import hf_greedy
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams
    from paged.kernels import gemv

    every_linear_on_the_gemv(engines_on)
    fused, gated = [], []
    real = gemv.gemv_split_k
    monkeypatch.setattr(gemv, "gemv_split_k", lambda *a: fused.append(a[5] is not None)
                        or gated.append(a[6]) or real(*a))  # fmt: skip
    path = tiny_models["llama"]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=32)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    layers = len(llm.engine.runner.model.layers)
    # four decode steps: both norms of every layer but the first layer's input norm (none)
    assert sum(fused) == 4 * (2 * layers - 1)
    assert sum(gated) == 4 * layers  # every down projection of the four decode steps
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == hf_greedy(hf, prompt, 5)


@pytest.mark.slow  # interpreted Triton through the engine
def test_ops_left_to_their_kernels_before_the_one_row_gemvs(tiny_models, monkeypatch, engines_on,
                                                            interpreter_only):  # fmt: skip
    """Every linear on the one-row GEMV chosen without its op folded in: decode steps run each
    residual add and RMSNorm and SiLU-and-mul as their own kernels, the GEMVs plain, and greedy
    output equals HF's."""
    from test_hf_parity import hf_greedy
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams, kernels
    from paged.kernels import gemv

    every_linear_on_the_gemv(engines_on, fold=False)
    folded, norms = [], []
    real, norm_kernel = gemv.gemv_split_k, kernels.fused_add_rms_norm
    monkeypatch.setattr(gemv, "gemv_split_k", lambda *a: folded.append(a[5] is not None or a[6])
                        or real(*a))  # fmt: skip
    monkeypatch.setattr(kernels, "fused_add_rms_norm",
                        lambda x, *a: norms.append(len(x)) or norm_kernel(x, *a))  # fmt: skip
    path = tiny_models["llama"]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=32)
    prompt = list(range(7, 16))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    layers = len(llm.engine.runner.model.layers)
    assert folded and not any(folded)
    assert norms.count(1) == 3 * 2 * layers  # 3 decode steps: every add's norm and the final
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == hf_greedy(hf, prompt, 4)


def test_the_linears_after_a_norm_are_timed_with_it(tiny_models):
    """A decoder layer's QKV and dense gate/up projections follow a norm that the GEMV takes
    in, its down projection SiLU-and-mul (so start-up times them with it); o_proj and the
    head follow neither."""
    from paged import LLM

    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=64, num_kv_blocks=16)
    model = llm.engine.runner.model
    want = {id(m) for layer in model.layers for m in (layer.self_attn.qkv_proj,
                                                      layer.mlp.gate_up_proj)}  # fmt: skip
    assert gemv_select.normed_linears(model) == want and len(want) == 2 * len(model.layers)
    downs = {id(layer.mlp.down_proj) for layer in model.layers}
    assert gemv_select.gated_linears(model) == downs


@pytest.mark.slow  # 15 s: interpreted Triton through the engine, with the long checks
def test_the_moe_norm_runs_before_the_router_and_expert_gemvs(tmp_path, monkeypatch, engines_on,
                                                             interpreter_only):  # fmt: skip
    """Qwen3-MoE (layer 0 dense, layer 1 experts) with every linear on the one-row GEMV: at
    decode the dense layer's and the QKV's norms fold into their GEMVs, while the sparse layer's
    post-attention norm runs as its own kernel before the router's and the experts' GEMVs
    (add_rms_norm_moe's default: the folded kernels measured slower on an H200); the router is
    timed with its norm at start-up; greedy output equals HF's."""
    from test_hf_parity import hf_greedy
    from test_models_qwen3_moe import make_model
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams, kernels
    from paged.kernels import gemv, moe

    every_linear_on_the_gemv(engines_on)
    router, experts, norms = [], [], []  # per call: the norm folded in / a norm kernel's rows
    split_k, gate_up, norm_kernel = gemv.gemv_split_k, moe._gate_up, kernels.fused_add_rms_norm
    monkeypatch.setattr(gemv, "gemv_split_k",
                        lambda *a: router.append(a[5] is not None) or split_k(*a))  # fmt: skip
    monkeypatch.setattr(moe, "_gate_up", lambda *a, norm=None, **kw: experts.append(
        norm is not None) or gate_up(*a, norm=norm, **kw))  # fmt: skip
    monkeypatch.setattr(kernels, "fused_add_rms_norm",
                        lambda x, *a: norms.append(len(x)) or norm_kernel(x, *a))  # fmt: skip
    path = make_model("qwen3_moe", str(tmp_path / "qwen3_moe"))
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=32)
    try:
        prompt = list(range(5, 14))
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        model = llm.engine.runner.model
        dense, sparse = model.layers
        want = {dense.self_attn.qkv_proj, dense.mlp.gate_up_proj, sparse.self_attn.qkv_proj}
        assert gemv_select.normed_linears(model) == {id(m) for m in want}
    finally:
        llm.engine.shutdown()
    # four decode steps, each: dense gate/up and layer 1's QKV with their norms folded, the
    # router and the experts' gate/up not (prefill: the experts' GEMVs too, 9 x top 2 pairs)
    assert sum(router) == 4 * 2 and experts == [False] * 5
    assert norms == [9] * 4 + [1, 1] * 4  # prefill: every add's norm; decode: the MoE's, final
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == hf_greedy(hf, prompt, 5)
