"""Flags left unset take the platform's defaults; a value given is kept."""

from __future__ import annotations

from transformers import LlamaConfig

from paged.config import EngineConfig
from paged.worker.worker import resolve_config
from paged_cpu.platform import CpuPlatform
from paged_cuda.platform import CudaPlatform

HF = LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=256)


class WidePlatform(CpuPlatform):
    default_max_num_seqs = 48
    default_max_num_batched_tokens = 4096


def test_unset_batch_limits_take_the_platform_defaults():
    cpu = resolve_config(EngineConfig(), CpuPlatform(), HF)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 2048)
    wide = resolve_config(EngineConfig(), WidePlatform(), HF)
    assert (wide.max_num_seqs, wide.max_num_batched_tokens) == (48, 4096)
    given = resolve_config(
        EngineConfig(max_num_seqs=7, max_num_batched_tokens=99), WidePlatform(), HF
    )
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (7, 99)
    # GPUs decode wider batches (bench/results/h200.md: 512 against 256 on an H200)
    assert (CudaPlatform.default_max_num_seqs, CudaPlatform.default_max_num_batched_tokens) == (
        512,
        8192,
    )
