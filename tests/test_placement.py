"""Device slices for replicas on one host: each platform's own masks (Platform.device_masks),
counted per device type, so a fleet mixing platforms gives each its own devices."""

from __future__ import annotations

import pytest

from paged.engine.placement import assign_devices, check_local_replicas, cores, visible_devices
from paged.plugins import platform_class
from paged_cpu.platform import CpuPlatform
from paged_cuda.platform import CudaPlatform
from paged_rocm.platform import RocmPlatform, sync_visible_devices
from paged_xpu.platform import XpuPlatform

MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


@pytest.fixture(autouse=True)
def no_masks(monkeypatch):
    for var in MASKS:
        monkeypatch.delenv(var, raising=False)


def test_a_mixed_fleet_counts_devices_per_platform(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    shares = cores(5)
    platforms = [CudaPlatform, XpuPlatform, CpuPlatform, CudaPlatform, XpuPlatform]
    assign_devices(shares, platforms, [2, 1, 1, 1, 2])
    envs = [p.env for p in shares]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "4,5" and "ZE_AFFINITY_MASK" not in envs[0]
    # the XPU replicas count their own devices from 0 (no mask set: all of the host's)
    assert envs[1]["ZE_AFFINITY_MASK"] == "0" and "CUDA_VISIBLE_DEVICES" not in envs[1]
    assert set(envs[2]) == {"OMP_NUM_THREADS"}  # a CPU replica: no device mask at all
    assert envs[3]["CUDA_VISIBLE_DEVICES"] == "6"
    assert envs[4]["ZE_AFFINITY_MASK"] == "1,2"
    assert shares[4].describe().endswith("; ZE_AFFINITY_MASK=1,2")


def test_a_replica_past_the_visible_devices_gets_none(monkeypatch):
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.0,0.1")  # tiles of one card
    shares = cores(3)
    assign_devices(shares, [XpuPlatform] * 3, [1] * 3)
    assert [p.env["ZE_AFFINITY_MASK"] for p in shares] == ["0.0", "0.1", ""]


def test_rocm_slices_hips_mask_into_both(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,3")
    shares = cores(2)
    assign_devices(shares, [RocmPlatform] * 2, [1, 1])
    env = dict(shares[1].env)
    assert env["HIP_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "3"
    sync_visible_devices(env)  # the replica's ROCm check finds the two masks agree
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # HIP honours CUDA's mask too
    shares = cores(1)
    assign_devices(shares, [RocmPlatform], [1])
    assert shares[0].env["HIP_VISIBLE_DEVICES"] == "7"


def test_the_device_count_bound_reads_the_platforms_mask(monkeypatch):
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    assert visible_devices(XpuPlatform) == 2
    check_local_replicas([("xpu", XpuPlatform, 2, 1), ("cpu", CpuPlatform, 1, 2)])
    with pytest.raises(ValueError, match=r"3 xpu devices needed \(xpu: .*\), 2 visible"):
        check_local_replicas([("xpu", XpuPlatform, 1, 3)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a mask that hides all: none known
    assert visible_devices(CudaPlatform) is None


def test_platform_class_finds_without_creating(monkeypatch):
    monkeypatch.delenv("PAGED_PLATFORM", raising=False)
    assert platform_class("xpu") is XpuPlatform  # forced: no probe, available or not
    assert platform_class("nonesuch") is None
    assert platform_class() is CpuPlatform  # this machine's best available one
    monkeypatch.setenv("PAGED_PLATFORM", "rocm")
    assert platform_class() is RocmPlatform
