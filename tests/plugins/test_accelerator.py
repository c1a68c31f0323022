"""paged's AcceleratorPlatform, the one base of the cuda, rocm and xpu platforms: each
plugin keeps only what differs, and the base drives the device through the torch module
its platform names (`torch.cuda` for cuda and rocm, `torch.xpu` for xpu), here faked."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from paged.accelerator import AcceleratorGraphStepRunner, AcceleratorPlatform
from paged.config import EngineConfig
from paged.kernels.backend import TritonAttentionBackend
from paged.model import ops as model_ops
from paged.worker.step_runner import StepRunner

GiB = 1 << 30
SHARED = (
    "memory",
    "kv_cache_budget",
    "synchronize",
    "empty_cache",
    "reset_peak_memory",
    "default_dtype",
    "step_runner",
)
EXTENDED = ("ops",)  # a plugin may add to the base's op table, never replace it
GRAPH_API = ("graphs_available", "new_graph", "graph_capture", "graph_pool")


def plugin_platforms() -> list[type]:
    from paged_rocm.platform import RocmPlatform
    from paged_xpu.platform import XpuPlatform

    found = [RocmPlatform, XpuPlatform]
    try:
        from paged_cuda.platform import CudaPlatform
    except ImportError:  # paged-cuda not installed
        return found
    return [CudaPlatform, *found]


def test_gpu_plugins_share_the_base():
    platforms = plugin_platforms()
    for cls in platforms:
        assert issubclass(cls, AcceleratorPlatform), cls
        redefined = [m for m in SHARED if m in vars(cls)]
        assert not redefined, f"{cls.__name__} redefines {redefined}"
        for name in EXTENDED:
            if name in vars(cls):
                assert f"super().{name}()" in inspect.getsource(vars(cls)[name]), (cls, name)
        assert cls.needs_profile_run and cls.pin_memory and cls.overlap_steps
        runner = cls().graph_runner()
        assert issubclass(runner, AcceleratorGraphStepRunner)
        assert not [m for m in GRAPH_API if m in vars(runner)], runner
        assert hasattr(getattr(torch, cls.device_module or cls.device_type), runner.graph_class)
    modules = {cls.name: cls.device_module or cls.device_type for cls in platforms}
    assert modules["rocm"] == "cuda" and modules["xpu"] == "xpu"  # HIP answers as torch.cuda


class FakeModule:
    """A torch device module: memory counters, bf16 switch, a graph API that records."""

    class FakeGraph:
        pass

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bf16 = True
        self.info = (30 * GiB, 80 * GiB)  # free, total
        self.reserved = 42 * GiB
        self.peak = 40 * GiB

    def mem_get_info(self):
        return self.info

    def memory_reserved(self):
        return self.reserved

    def max_memory_allocated(self):
        return self.peak

    def synchronize(self):
        self.calls.append("synchronize")

    def empty_cache(self):
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self):
        self.calls.append("reset_peak_memory_stats")

    def is_bf16_supported(self):
        return self.bf16

    def get_device_properties(self, index):
        return SimpleNamespace(name="Fake GPU 9000", total_memory=80 * GiB)

    def device_count(self):
        return 2

    def graph(self, graph, pool=None):
        self.calls.append(f"graph {type(graph).__name__} {pool}")
        return "recording"

    def graph_pool_handle(self):
        return "pool"


class FakeRunner(AcceleratorGraphStepRunner):
    graph_class = "FakeGraph"
    graph_name = "Fake"


class FakePlatform(AcceleratorPlatform):
    name = "fake-accelerator"
    device_type = "cpu"
    device_module = "fakeacc"

    def graph_runner(self):
        return FakeRunner


@pytest.fixture
def fake(monkeypatch) -> FakeModule:
    mod = FakeModule()
    monkeypatch.setattr(torch, "fakeacc", mod, raising=False)
    return mod


def test_memory_and_budget(fake):
    platform = FakePlatform()
    assert platform.torch_module is fake and platform.memory() == (30 * GiB, 80 * GiB)
    # 80 * 0.9 = 72 GiB, minus the profiled peak (40), minus 8 GiB outside torch
    assert platform.kv_cache_budget(EngineConfig(gpu_memory_utilization=0.9)) == 24 * GiB
    assert platform.kv_cache_budget(EngineConfig(kv_cache_memory=123)) == 123
    fake.peak = 70 * GiB
    assert platform.kv_cache_budget(EngineConfig(gpu_memory_utilization=0.9)) == 0


def test_memory_without_mem_get_info(fake, monkeypatch):
    monkeypatch.delattr(FakeModule, "mem_get_info")
    assert FakePlatform().memory() == (38 * GiB, 80 * GiB)  # total - reserved


def test_synchronize_and_peak(fake):
    platform = FakePlatform()
    platform.reset_peak_memory()
    platform.synchronize()
    platform.empty_cache()
    assert fake.calls == ["synchronize", "reset_peak_memory_stats", "synchronize", "empty_cache"]


def test_dtypes_and_config(fake):
    platform = FakePlatform()
    assert platform.default_dtype() == torch.bfloat16
    platform.check_config(EngineConfig(dtype="bfloat16"))
    with pytest.raises(ValueError, match="block_size"):
        platform.check_config(EngineConfig(dtype="float16", block_size=8))
    fake.bf16 = False
    assert platform.default_dtype() == torch.float16
    with pytest.raises(ValueError, match="bfloat16 is not supported on Fake GPU 9000"):
        platform.check_config(EngineConfig(dtype="bfloat16"))


def test_describe(fake):
    assert FakePlatform().describe() == {
        "device": "Fake GPU 9000",
        "count": "2",
        "memory_gib": "80.0",
    }


def test_kernels_and_ops(fake, monkeypatch):
    platform = FakePlatform()
    assert platform.attention_backend() is TritonAttentionBackend
    pytest.importorskip("triton")
    fused = platform.ops()
    # A Triton kernel for every op (the model's and the sampler's structured-outputs mask)
    # but the two MoE fusions that measured slower than their defaults' kernels (kernels/ops.py)
    slower = {"add_rms_norm_moe", "fused_moe_from_logits"}
    assert set(fused) == set(model_ops._DEFAULTS) - slower
    import paged.kernels.ops as kernel_ops

    monkeypatch.setattr(kernel_ops, "find_spec", lambda name: None)
    assert platform.ops() == {}  # no triton: the torch defaults


def test_graph_api_from_the_module(fake, monkeypatch):
    platform = FakePlatform()
    assert platform.step_runner() is FakeRunner
    runner = FakeRunner(None, None, platform, None)
    assert runner.graphs_available()
    graph = runner.new_graph()
    assert isinstance(graph, FakeModule.FakeGraph)
    assert runner.graph_pool() == "pool"
    assert runner.graph_capture(graph, "pool") == "recording"
    assert fake.calls == ["graph FakeGraph pool"]
    monkeypatch.delattr(FakeModule, "FakeGraph")  # this torch has no graphs: eager
    assert platform.step_runner() is StepRunner and not runner.graphs_available()


@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu"])
def test_each_plugin_reaches_its_module(name, monkeypatch):
    cls = {c.name: c for c in plugin_platforms()}.get(name)
    if cls is None:
        pytest.skip(f"paged-{name} is not installed")
    mod = getattr(torch, "xpu" if name == "xpu" else "cuda")
    fake = FakeModule()
    for attr in ("mem_get_info", "memory_reserved", "max_memory_allocated", "synchronize"):
        monkeypatch.setattr(mod, attr, getattr(fake, attr))
    monkeypatch.setattr(mod, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    platform = cls()
    assert platform.torch_module is mod
    assert platform.kv_cache_budget(EngineConfig(gpu_memory_utilization=0.9)) == 24 * GiB
    platform.reset_peak_memory()
    assert fake.calls == ["synchronize", "reset_peak_memory_stats"]
