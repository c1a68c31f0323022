"""The CUDA platform: Triton paged attention, fused Triton ops, CUDA graphs for decode.

Memory, the profiled KV budget, dtypes, the attention backend and the fused ops come from
paged's `AcceleratorPlatform` through `torch.cuda`; this keeps the probe and the facts."""

from __future__ import annotations

import logging
import time

import torch

from paged.accelerator import AcceleratorPlatform
from paged.platform import PlatformOption

log = logging.getLogger("paged")


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"
    device_masks = ("CUDA_VISIBLE_DEVICES",)
    options = (
        PlatformOption(
            "cuda_gguf_blocks",
            "a GGUF model's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K linears kept as 4-/8-bit blocks on "
            "the GPU (the int4 Triton kernels); off: dense weights in the model dtype",
            True,
        ),
        PlatformOption(
            "cuda_tuned_gemv",
            "one-row dense linears (batch-1 decode) on paged's split-K GEMV for the weight shapes "
            "where timing both at start-up finds it faster than cuBLAS, fp8 linears of up to "
            "four rows on the split-K fp8 GEMV where they beat the unsplit one, and int4 linears "
            "(AWQ, GPTQ) of up to four rows on the split-K int4 GEMM config that times fastest per "
            "shape; off: cuBLAS, the unsplit fp8 GEMV and the int4 GEMM's default configs",
            True,
        ),
        PlatformOption(
            "cuda_fp8_weight_only_decode",
            "one-row fp8 linears (batch-1 decode under --quantization fp8) weight-only: the fp8 "
            "weight converted inside paged's split-K GEMV, the input row kept in the model dtype "
            "(closer to the 16-bit model; results differ from the default); off: the row "
            "quantized to e4m3 per token, as the fp8 GEMMs of prefill do",
            False,
        ),
        PlatformOption(
            "cuda_pdl",
            "paged's Triton kernels launched with programmatic dependent launch on GPUs of "
            "compute capability 9.0 and later (each kernel's launch and first weight loads "
            "overlap the end of the kernel before it); off: plain launches",
            True,
        ),
    )

    @classmethod
    def probe(cls) -> str | None:
        if getattr(torch.version, "hip", None):
            return "this torch is a ROCm build (use the rocm platform)"
        if torch.version.cuda is None:
            return "this torch has no CUDA support (a CPU build)"
        if not torch.cuda.is_available():
            return "no CUDA device visible (driver missing or CUDA_VISIBLE_DEVICES empty)"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None

    def gguf_block_layer(self, config):
        """A GGUF's blocks through the int4 / int8 kernels, on one GPU (the file's blocks are
        whole layers, not tensor-parallel shards)."""
        if config.world_size != 1 or not self.option("cuda_gguf_blocks"):
            return None
        from paged.quantization.gguf import int_block_layer

        return int_block_layer

    def prepare_model(self, model, config, source=None) -> None:
        from paged.kernels import pdl

        pdl.enable(self.option("cuda_pdl") and torch.cuda.get_device_capability()[0] >= 9)
        tuned = self.option("cuda_tuned_gemv")
        t0 = time.perf_counter()
        if tuned:
            from paged_cuda.fp8_select import use_measured_fp8_gemv
            from paged_cuda.gemv_select import use_measured_gemv
            from paged_cuda.int4_select import use_measured_int4_gemm

            use_measured_gemv(model)
            use_measured_fp8_gemv(model)
            use_measured_int4_gemm(model)
        if self.option("cuda_fp8_weight_only_decode"):
            from paged_cuda.fp8_weight_only import use_weight_only_fp8_gemv

            use_weight_only_fp8_gemv(model, timed=tuned)
        if tuned:
            self.empty_cache()  # the timing graphs' memory
            # where the Triton cache is cold, the candidate configs compile first (on threads)
            log.info("start-up GEMV timing took %.1f s", time.perf_counter() - t0)

    def ops(self):
        """The Triton op table; fp8 linears through torch._scaled_mm where the GPU has fp8."""
        table = super().ops()
        from paged_cuda.fp8 import fp8_linear, scaled_mm_available

        if "fp8_linear" in table and scaled_mm_available():
            table["fp8_linear"] = fp8_linear
        return table

    def graph_runner(self):
        from paged_cuda.graphs import CudaGraphStepRunner

        return CudaGraphStepRunner

    def describe(self) -> dict[str, str]:
        import triton

        props = torch.cuda.get_device_properties(0)
        return {
            **super().describe(),
            "capability": f"{props.major}.{props.minor}",
            "cuda": str(torch.version.cuda),
            "triton": triton.__version__,
        }
