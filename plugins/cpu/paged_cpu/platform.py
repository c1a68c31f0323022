"""The CPU platform: torch ops, eager steps, bfloat16 where the processor has it."""

from __future__ import annotations

import os
from functools import cache, partial

import torch

from paged.platform import Platform, PlatformOption


@cache
def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_native_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 10  # the fallback: any accelerator ranks above
    dist_backend = "gloo"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    options = (
        PlatformOption(
            "cpu_native",
            "the C++ kernels (decode attention, fused bf16 ops, GGUF blocks) where built; "
            "off: torch ops only",
            True,
            env="PAGED_CPU_NATIVE",
        ),
        PlatformOption(
            "cpu_packed_weights",
            "bf16/fp16 linear weights reordered once for oneDNN; off: plain F.linear on the "
            "loaded weights (what HF computes)",
            True,
            env="PAGED_CPU_PACKED_WEIGHTS",
        ),
        PlatformOption(
            "cpu_gguf_blocks",
            "a bf16 GGUF model's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K linears computed from the "
            "file's blocks with 8-bit activations (AVX-512 VNNI); off: dense bf16",
            True,
            env="PAGED_CPU_GGUF_BLOCKS",
        ),
    )

    @classmethod
    def probe(cls) -> str | None:
        return None

    def memory(self) -> tuple[int, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        try:
            with open("/proc/meminfo") as f:
                info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
            free = info.get("MemAvailable", free)
        except OSError:
            pass
        return free, total

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if has_native_bf16() else torch.float32

    def kv_cache_budget(self, config) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        free, _ = self.memory()
        return min(512 << 20, free // 8)  # host RAM is shared with everything else

    def gguf_block_layer(self, config):
        """A GGUF's blocks through the C++ kernels (8-bit activations), for bf16 models on one
        process (the file's blocks are whole layers, not shards)."""
        from paged_cpu.linear import gguf_block_linear, gguf_blocks_available

        bf16 = config.torch_dtype == torch.bfloat16
        blocks = self.option("cpu_gguf_blocks") and self.option("cpu_native")
        if not (bf16 and config.world_size == 1 and blocks and gguf_blocks_available()):
            return None
        return gguf_block_linear

    def prepare_model(self, model, config, source=None) -> None:
        from paged_cpu.linear import pack_linears

        with torch.no_grad():
            if self.option("cpu_packed_weights"):
                pack_linears(model, config.torch_dtype)  # the layers still dense

    def ops(self):
        from paged_cpu.fused_ops import fused_ops

        return fused_ops(self.option("cpu_native"))

    def attention_backend(self):
        from paged_cpu.attention import CpuAttentionBackend

        return partial(CpuAttentionBackend, native=self.option("cpu_native"))

    def describe(self) -> dict[str, str]:
        import platform

        return {
            "processor": platform.processor() or platform.machine(),
            "threads": str(torch.get_num_threads()),
            "native_bf16": str(has_native_bf16()),
        }
