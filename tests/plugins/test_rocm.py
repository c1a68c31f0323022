"""paged-rocm on a faked ROCm torch: probe reasons, selection, config checks, dtype defaults,
AMD tiles; its Triton backend against the cpu one under the Triton interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import paged_rocm.hooks
import paged_rocm.platform as rp
from paged.config import EngineConfig
from paged.plugins import probe_platforms, select_platform
from paged_rocm.platform import RocmPlatform, sync_visible_devices
from paged_rocm.tiles import Tiles, choose_tiles, launch_kwargs

MI300X = SimpleNamespace(
    name="AMD Instinct MI300X",
    gcnArchName="gfx942:sramecc+:xnack-",
    warp_size=64,
    shared_memory_per_block=64 * 1024,
    total_memory=192 << 30,
    major=9,
    minor=4,
)


@pytest.fixture
def rocm(monkeypatch, registered):
    """A ROCm build of torch that sees eight MI300X (bf16 support switchable)."""
    registered(paged_rocm.hooks)
    for var in rp.VISIBILITY_VARS:
        monkeypatch.delenv(var, raising=False)
    state = SimpleNamespace(bf16=True, available=True)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state.available)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: state.bf16)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: MI300X)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    return state


def test_probe_refuses_this_cpu_torch(registered):
    registered(paged_rocm.hooks)
    assert "not a ROCm build" in RocmPlatform.probe()
    row = next(r for r in probe_platforms() if r.name == "rocm")
    assert not row.available and "torch.version.hip is unset" in row.reason


def test_probe_reasons(rocm, monkeypatch):
    assert RocmPlatform.probe() is None
    rocm.available = False
    assert "no AMD GPU visible" in RocmPlatform.probe()
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert "HIP_VISIBLE_DEVICES='' hides every device" in RocmPlatform.probe()
    rocm.available = True
    monkeypatch.setattr(rp, "find_spec", lambda name: None)
    assert "triton is not installed" in RocmPlatform.probe()


def test_selected_above_cpu_and_cuda_refuses(rocm):
    rows = {r.name: r for r in probe_platforms()}
    assert rows["rocm"].available and rows["rocm"].priority > rows["cpu"].priority
    if "cuda" in rows:  # the CUDA plugin steps aside on ROCm builds
        assert "ROCm build" in rows["cuda"].reason
    platform = select_platform()
    assert isinstance(platform, RocmPlatform)
    assert platform.device == torch.device("cuda") and platform.dist_backend == "nccl"
    assert select_platform("cpu").name == "cpu"  # forcing still wins


def test_dtype_defaults(rocm):
    assert RocmPlatform().default_dtype() == torch.bfloat16
    rocm.bf16 = False
    assert RocmPlatform().default_dtype() == torch.float16


def test_check_config(rocm, monkeypatch):
    platform = RocmPlatform()
    platform.check_config(EngineConfig(dtype="bfloat16"))
    platform.check_config(EngineConfig(dtype="float32", block_size=32))
    with pytest.raises(ValueError, match="block_size"):
        platform.check_config(EngineConfig(dtype="float16", block_size=8))
    rocm.bf16 = False
    with pytest.raises(ValueError, match="bfloat16 is not supported on gfx942"):
        platform.check_config(EngineConfig(dtype="bfloat16"))
    platform.check_config(EngineConfig(dtype="float16"))


def test_visible_devices_mirrored_or_refused():
    env = {"HIP_VISIBLE_DEVICES": "2,3"}
    sync_visible_devices(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match="disagree"):
        sync_visible_devices({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"})
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    sync_visible_devices(env)  # no HIP mask: left alone
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_describe(rocm, monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    facts = RocmPlatform().describe()
    assert facts["arch"].startswith("gfx942") and facts["wavefront"] == "64"
    assert facts["lds_kib"] == "64" and facts["visible_devices"] == "HIP_VISIBLE_DEVICES=0"


def test_tiles_fit_lds():
    cdna3 = choose_tiles(head_dim=128, elem_size=2, lds_bytes=64 * 1024, warp_size=64)
    assert cdna3["decode"] == Tiles(block_n=32, num_warps=4, num_stages=2)
    assert cdna3["varlen"].block_m == 32
    for tiles in cdna3.values():  # pipelined K+V tiles take at most half the LDS
        assert 2 * tiles.block_n * 128 * 2 * tiles.num_stages <= 32 * 1024
    gfx950 = choose_tiles(head_dim=128, elem_size=2, lds_bytes=160 * 1024, warp_size=64)
    assert gfx950["decode"].block_n == 64 and gfx950["varlen"].block_m == 64
    rdna = choose_tiles(head_dim=64, elem_size=2, lds_bytes=64 * 1024, warp_size=32)
    assert rdna["decode"].num_warps == 8  # 256 lanes with 32-lane waves


def test_tiles_pass_only_where_accepted():
    tiles = Tiles(block_n=32, num_warps=4, num_stages=2, block_m=None)

    def today(q, k, v, out, scale): ...
    def tile_aware(q, k, v, out, scale, block_n=None, num_warps=None, num_stages=None): ...

    assert launch_kwargs(today, tiles) == {}
    assert launch_kwargs(tile_aware, tiles) == {"block_n": 32, "num_warps": 4, "num_stages": 2}
    assert launch_kwargs(tile_aware, None) == {}


def test_triton_backend_matches_cpu(interpreted_report):
    errs = interpreted_report["paged_rocm.attention:RocmTritonAttentionBackend"]
    assert max(errs.values()) < 1e-5, errs


def test_probing_imports_no_vendor_module(interpreted_report):
    probed = interpreted_report["probed"]  # probed with vendor imports made to fail
    assert "not a ROCm build" in probed["rocm"] and "not an XPU build" in probed["xpu"]
