"""Every portable Triton kernel compiles for an NVIDIA Hopper GPU, checked without one: the
interpreter that runs the other kernel tests on CPU accepts code the GPU compiler refuses
(an fp8 KV cache once failed at start-up on the H200 that way). compile_for_gpu.py runs the
kernels' wrappers on meta tensors and compiles each launch for sm_90.

Marked slow (make test-slow; CI runs it): about 130 variants, three minutes of one core with a
cold Triton cache, most of it LLVM and ptxas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    backends = subprocess.run(
        [sys.executable, "-c", "from triton.backends import backends; print(*backends)"],
        capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"},
    ).stdout.split()  # fmt: skip
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lines = p.stdout.splitlines()
    names = {line.split()[1] for line in lines if line.startswith("compiled ")}
    expected = {"_reshape_and_cache_kernel", "_split_kernel", "_varlen_kernel",
                "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_quant_rows",
                "_gemv_kernel", "_gemv_split_k_kernel", "_fp8_gemv_dot_kernel", "_fp8_gemm",
                "_fp8_gemv_split_kernel",
                "_int4_gemm_split_kernel", "_dequant_kernel",
                "_pair_gemv", "_down_gemv_sum", "_route_kernel", "_grouped_gemm", "_lora_gemm",
                "_apply_bitmask_kernel", "_gemma_rms_norm_kernel",
                "_gelu_and_mul_kernel"}  # fmt: skip
    assert expected <= names, sorted(expected - names)
    routed = {line.split()[1] for line in lines if "('ROUTE', True)" in line}
    assert routed == {"_pair_gemv", "_down_gemv_sum"}  # the decode GEMVs' inline routing
    normed = {line.split()[1] for line in lines if "('NORM', True)" in line}
    # the norm folded into GEMVs (bf16, fp8, the MoE's)
    assert normed == {"_gemv_split_k_kernel", "_fp8_gemv_split_kernel", "_pair_gemv"}
    gated = {line.split()[1] for line in lines if "('SILU_MUL', True)" in line
             and "('PDL', True)" in line}  # fmt: skip
    # SiLU-and-mul folded into the down GEMV (bf16, fp8)
    assert gated == {"_gemv_split_k_kernel", "_fp8_gemv_split_kernel"}
    weight_only = [line for line in lines if line.startswith("compiled _gemv_split_k_kernel ")
                   and "('W_SCALED', True)" in line]  # fmt: skip
    # fp8 weights converted inside the one-row GEMV: plain, norm and SiLU-and-mul folded in
    assert len(weight_only) == 3
    both = {line.split()[1] for line in lines if "('NORM', True)" in line
            and "('ROUTE', True)" in line}  # fmt: skip
    assert both == {"_pair_gemv"}  # MoE decode: the gate/up GEMV routes and norms its input
    int4 = [line for line in lines if line.startswith("compiled _int4_gemm_split_kernel ")]
    contiguous = {("('CONTIGUOUS_X', True)" in line, "('BITS', 8)" in line) for line in int4}
    # 8-bit codes: both loads (by the row block); 4-bit codes: contiguous in every block
    assert contiguous == {(True, True), (False, True), (True, False)}
    pdl = {line.split()[1] for line in lines if "('PDL', True)" in line}
    decode = {"_reshape_and_cache_kernel", "_split_kernel", "_rms_norm_kernel",
              "_rotary_kernel", "_silu_and_mul_kernel", "_gemv_kernel", "_gemv_split_k_kernel",
              "_fp8_gemv_dot_kernel", "_fp8_gemv_split_kernel", "_int4_gemm_split_kernel",
              "_pair_gemv", "_down_gemv_sum", "_route_kernel", "_gemma_rms_norm_kernel",
              "_gelu_and_mul_kernel"}  # fmt: skip
    assert decode <= pdl, sorted(decode - pdl)  # launched with PDL on Hopper (paged.kernels.pdl)
    # The decode attention, one launch: (SPLIT, QUANT, PDL) of the variants with the cache
    # write fused in (the backend's decode step), and without it
    split = [line for line in lines if line.startswith("compiled _split_kernel ")]
    flags = lambda line: tuple(f"('{c}', True)" in line for c in ("SPLIT", "QUANT", "PDL"))  # noqa: E731
    fused = {flags(line) for line in split if "('WRITE_KV', True)" in line}
    assert {(s, q, False) for s in (True, False) for q in (True, False)} <= fused  # fp8 or not
    assert {(True, False, True), (False, False, True)} <= fused  # CUDA's decode step
    rotated = {flags(line) for line in split if "('ROTARY', True)" in line}
    assert {(True, False, True), (False, False, True)} <= rotated  # Llama's decode, rotary in
    plain = {flags(line) for line in split if "('WRITE_KV', False)" in line}
    assert {(True, False, False), (False, False, False), (True, True, False)} <= plain
    assert "kernel variants compiled for" in lines[-1]
