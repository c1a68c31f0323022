"""paged-xpu on a faked torch.xpu and a stubbed IPEX: probe reasons, selection, the
IPEX -> Triton fallback order, the IPEX backend's calls against the cpu backend, the Triton
fallback under the interpreter, graphs or eager, the collective backend."""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from attn_reference import max_errors

import paged_xpu.attention as xa
import paged_xpu.hooks
import paged_xpu.platform as xp
from paged.config import EngineConfig
from paged.plugins import probe_platforms, select_platform
from paged.worker.step_runner import StepRunner
from paged_xpu.attention import IpexAttentionBackend, choose_attention
from paged_xpu.platform import XpuPlatform
from paged_xpu.triton_attention import XpuTritonAttentionBackend

IPEX = "intel_extension_for_pytorch"
MAX1550 = SimpleNamespace(
    name="Intel(R) Data Center GPU Max 1550",
    total_memory=64 << 30,
    driver_version="1.6.31294",
    has_subgroup_matrix_multiply_accumulate=True,
)


@pytest.fixture
def xpu(monkeypatch, registered):
    """An XPU build of torch that sees one Max 1550 (bf16 support switchable)."""
    registered(paged_xpu.hooks)
    monkeypatch.delenv(xa.ATTENTION_ENV, raising=False)
    for var in xp.MASK_VARS:
        monkeypatch.delenv(var, raising=False)
    state = SimpleNamespace(bf16=True, available=True)
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: state.available)
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda *a, **k: state.bf16)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda *a: MAX1550)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    return state


class IpexReference:
    """IPEX's two ops as documented (flash layout, causal aligned to each context's end)."""

    @staticmethod
    def reshape_and_cache_flash(key, value, key_cache, value_cache, slots, dtype, k_sc, v_sc):
        assert dtype == "auto" and k_sc == v_sc == 1.0
        keep = slots >= 0
        key_cache.view(-1, *key.shape[1:])[slots[keep]] = key[keep]
        value_cache.view(-1, *value.shape[1:])[slots[keep]] = value[keep]

    @staticmethod
    def flash_attn_varlen_func(
        out, q, key_cache, value_cache, cu_q, cu_kv, max_q, max_kv, scale, causal, tables, alibi
    ):
        assert causal and alibi is None and q.is_contiguous() and int(cu_kv[0]) == 0
        bs, group = key_cache.shape[1], q.shape[1] // key_cache.shape[2]
        for b in range(cu_q.numel() - 1):
            q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
            kv = int(cu_kv[b + 1] - cu_kv[b])
            assert q1 - q0 <= max_q and kv <= max_kv
            blocks = tables[b, : -(-kv // bs)].long()
            keys = key_cache[blocks].flatten(0, 1)[:kv].repeat_interleave(group, 1).float()
            vals = value_cache[blocks].flatten(0, 1)[:kv].repeat_interleave(group, 1).float()
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * scale
            rows = torch.arange(q1 - q0)[:, None] + kv - (q1 - q0)
            s.masked_fill_(torch.arange(kv)[None, :] > rows, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals).to(out.dtype)


def stub_ipex(monkeypatch, version: str = "2.8.10+xpu", ops=xa.IPEX_OPS) -> None:
    """Put a fake intel_extension_for_pytorch (with llm.modules.PagedAttention) in sys.modules."""
    pkg, llm, mods = (types.ModuleType(n) for n in (IPEX, IPEX + ".llm", IPEX + ".llm.modules"))
    pkg.__spec__ = importlib.util.spec_from_loader(IPEX, loader=None)
    pkg.__version__ = version
    attrs = {op: staticmethod(getattr(IpexReference, op)) for op in ops}
    mods.PagedAttention = type("PagedAttention", (), attrs)
    pkg.llm, llm.modules = llm, mods
    for m in (pkg, llm, mods):
        monkeypatch.setitem(sys.modules, m.__name__, m)


def test_probe_refuses_this_cpu_torch(registered):
    registered(paged_xpu.hooks)
    row = next(r for r in probe_platforms() if r.name == "xpu")
    assert not row.available and "not an XPU build" in row.reason


def test_probe_reasons(xpu, monkeypatch):
    assert XpuPlatform.probe() is None
    xpu.available = False
    assert "no Intel GPU visible" in XpuPlatform.probe()
    monkeypatch.setenv("ZE_AFFINITY_MASK", "")
    assert "ZE_AFFINITY_MASK='' hides every device" in XpuPlatform.probe()
    xpu.available = True
    monkeypatch.setattr(xp, "find_spec", lambda name: None)
    assert "no attention kernels" in XpuPlatform.probe()


def test_selected_above_cpu(xpu):
    platform = select_platform()
    assert isinstance(platform, XpuPlatform) and platform.device == torch.device("xpu")
    assert select_platform("cpu").name == "cpu"


def test_fallback_without_ipex(xpu):
    cls, why = choose_attention(torch.bfloat16)  # IPEX is not installed here
    assert cls is XpuTritonAttentionBackend and "not installed" in why


@pytest.mark.parametrize(
    "version, ops, dtype, xmx, reason",
    [
        ("2.8.10+xpu", xa.IPEX_OPS, torch.bfloat16, True, None),
        ("2.8.10+xpu", xa.IPEX_OPS, torch.float16, True, None),
        ("2.8.10+xpu", xa.IPEX_OPS, torch.float32, True, "not float32"),
        ("2.8.0+cpu", xa.IPEX_OPS, torch.bfloat16, True, "not an XPU build"),
        ("2.3.110+xpu", ("flash_attn_varlen_func",), torch.bfloat16, True, "lacks"),
        ("2.8.10+xpu", xa.IPEX_OPS, torch.bfloat16, False, "no XMX"),
    ],
)
def test_ipex_then_triton(xpu, monkeypatch, version, ops, dtype, xmx, reason):
    stub_ipex(monkeypatch, version, ops)
    props = SimpleNamespace(**{**vars(MAX1550), "has_subgroup_matrix_multiply_accumulate": xmx})
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda *a: props)
    cls, why = choose_attention(dtype)
    if reason is None:
        assert cls is IpexAttentionBackend and why == "ipex"
    else:
        assert cls is XpuTritonAttentionBackend and reason in why


def test_broken_ipex_falls_back(xpu, monkeypatch):
    real = xa.find_spec
    monkeypatch.setattr(xa, "find_spec", lambda n: object() if n == IPEX else real(n))
    monkeypatch.setitem(sys.modules, IPEX, None)  # the import itself fails
    cls, why = choose_attention(torch.bfloat16)
    assert cls is XpuTritonAttentionBackend and "importing intel_extension_for_pytorch" in why


def test_forced_attention(xpu, monkeypatch):
    stub_ipex(monkeypatch)
    assert choose_attention(torch.bfloat16, "triton")[0] is XpuTritonAttentionBackend
    with pytest.raises(ValueError, match="ipex, but IPEX flash attention takes"):
        choose_attention(torch.float32, "ipex")
    with pytest.raises(ValueError, match="use auto, ipex or triton"):
        choose_attention(torch.bfloat16, "cuda")


def test_attention_option_flag_and_env_fallback(xpu, monkeypatch):
    """--xpu-attention reaches check_config; PAGED_XPU_ATTENTION is read only without it."""
    stub_ipex(monkeypatch)
    platform = XpuPlatform()
    platform.configure({})
    monkeypatch.setenv(xa.ATTENTION_ENV, "triton")  # the fallback, no flag given
    platform.check_config(EngineConfig(dtype="bfloat16"))
    assert platform.attention_backend() is XpuTritonAttentionBackend
    config = EngineConfig(dtype="bfloat16", platform_options={"xpu_attention": "ipex"})
    platform.configure(config.platform_options)  # the flag wins over the environment
    platform.check_config(config)
    assert platform.attention_backend() is IpexAttentionBackend
    monkeypatch.setenv(xa.ATTENTION_ENV, "ipex")
    platform.configure({"xpu_attention": "auto"})
    with pytest.raises(ValueError, match="ipex, but IPEX flash attention takes"):
        XpuPlatform().check_config(EngineConfig(dtype="float32"))  # env: ipex, fp32
    platform.check_config(EngineConfig(dtype="float32"))  # auto: Triton serves fp32
    assert platform.attention_backend() is XpuTritonAttentionBackend
    monkeypatch.setenv(xa.ATTENTION_ENV, "cuda")
    with pytest.raises(ValueError, match="PAGED_XPU_ATTENTION='cuda': use auto, ipex, triton"):
        XpuPlatform().configure({})
    with pytest.raises(ValueError, match="xpu_attention: expected one of auto, ipex, triton"):
        EngineConfig(platform_options={"xpu_attention": "cuda"})


def test_no_kernels_at_all(xpu, monkeypatch):
    monkeypatch.setattr(xa, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="no attention kernels for XPU"):
        choose_attention(torch.bfloat16)


def test_ipex_backend_matches_cpu(monkeypatch):
    stub_ipex(monkeypatch)
    errs = max_errors(IpexAttentionBackend, torch.float32)
    assert max(errs.values()) < 1e-5, errs


def test_check_config_picks_attention(xpu, monkeypatch):
    stub_ipex(monkeypatch)
    platform = XpuPlatform()
    assert platform.default_dtype() == torch.bfloat16
    platform.check_config(EngineConfig(dtype="bfloat16"))
    assert platform.attention_backend() is IpexAttentionBackend
    platform.check_config(EngineConfig(dtype="float32"))
    assert platform.attention_backend() is XpuTritonAttentionBackend
    with pytest.raises(ValueError, match="block_size"):
        platform.check_config(EngineConfig(dtype="float16", block_size=8))
    xpu.bf16 = False
    assert platform.default_dtype() == torch.float16
    with pytest.raises(ValueError, match="bfloat16 is not supported on Intel"):
        platform.check_config(EngineConfig(dtype="bfloat16"))


def test_graphs_where_available(xpu, monkeypatch):
    from paged_xpu.graphs import XpuGraphStepRunner

    assert XpuPlatform().step_runner() is XpuGraphStepRunner
    monkeypatch.delattr(torch.xpu, "XPUGraph")
    assert XpuPlatform().step_runner() is StepRunner


def test_dist_backend(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_xccl_available", lambda: True)
    assert XpuPlatform().dist_backend == "xccl"
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    monkeypatch.setattr(xp, "find_spec", lambda n: object() if "oneccl" in n else None)
    assert xp.choose_dist_backend() == "ccl"


def test_triton_backend_matches_cpu(interpreted_report):
    errs = interpreted_report["paged_xpu.triton_attention:XpuTritonAttentionBackend"]
    assert max(errs.values()) < 1e-5, errs
