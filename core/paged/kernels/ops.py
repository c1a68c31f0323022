"""The fused-op table of the GPU platforms: the Triton kernels of `paged.kernels` in place of
the torch defaults of `paged.model.ops` (same names and signatures).

Device-neutral: the same kernels compile for CUDA, HIP and Intel GPUs. The elementwise
kernels use 4-16 warps (<= 1024 lanes with 64-lane wavefronts, the HIP work-group limit) and
no shared-memory tiles, so no device needs its own launch sizes. Importing this module does
not import triton.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.util import find_spec
from typing import NamedTuple

import torch


class RopeTable(NamedTuple):
    """What this table's rotary_prepare returns: the kernels gather cos/sin per token
    themselves (the decode attention kernel too, which rotates q and k inside)."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_pos, rot_dim]: cos halves, then sin halves (float32)


def _rotary_prepare(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    return RopeTable(positions, cos_sin_cache)


def _rotary_embedding(positions, q: torch.Tensor, k: torch.Tensor, rope):
    from paged.kernels import rotary_embedding

    pos, cache = rope
    return rotary_embedding(pos, q, k, cache, q.shape[-1])


def _qk_norm_rotary(positions, q, k, rope, q_weight, k_weight, eps, gemma=False):
    from paged.kernels import rotary_embedding

    pos, cache = rope
    norm = (q_weight, k_weight, eps)
    return rotary_embedding(pos, q, k, cache, q.shape[-1], norm=norm, gemma_norm=gemma)


def _one_row_gemv(linear, x):
    """The linear's decode GEMV that folds the op before it in (paged_cuda's gemv_select and
    fp8_select install them on the module, not as the class's method) when x is an input it
    takes and it was chosen to fold the op; else None."""
    from paged.kernels.fp8_gemv import Fp8SplitGemv
    from paged.kernels.gemv import OneRowGemv

    gemv = vars(linear).get("forward")
    return gemv if isinstance(gemv, (OneRowGemv, Fp8SplitGemv)) and gemv.folds(x) else None


def _add_rms_norm_linear(x, residual, weight, eps, linear):
    """One kernel where the linear runs on the one-row GEMV (and the input is one row)."""
    from paged.kernels import fused_add_rms_norm

    gemv = _one_row_gemv(linear, x)
    if gemv is not None and residual.is_contiguous():
        return gemv(x, norm=(residual, weight, eps))
    x, residual = fused_add_rms_norm(x, residual, weight, eps)
    return linear(x), residual


def _silu_and_mul_linear(gate_up, linear):
    """One kernel where the down projection runs on the one-row GEMV (and the input is one
    row)."""
    from paged.kernels import silu_and_mul

    gemv = _one_row_gemv(linear, gate_up)
    if gemv is not None:
        return gemv(gate_up, silu_mul=True)
    return linear(silu_and_mul(gate_up))


def _gemma_rms_norm(x, weight, eps):
    from paged.kernels.gemma import gemma_rms_norm

    return gemma_rms_norm(x, weight, eps)


def _gemma_add_rms_norm(x, residual, weight, eps):
    from paged.kernels.gemma import gemma_add_rms_norm

    return gemma_add_rms_norm(x, residual, weight, eps)


def _gelu_and_mul(x, approximate="tanh"):
    from paged.kernels.gemma import gelu_and_mul

    return gelu_and_mul(x, approximate)


def _moe_route(logits, top_k, renormalize, dtype):
    from paged.kernels.moe_routing import moe_route

    return moe_route(logits, top_k, renormalize, dtype)


def _fp8_linear(x, weight, scale, group_k, bias=None):
    from paged.kernels.fp8_gemm import fp8_linear

    return fp8_linear(x, weight, scale, group_k, bias)


def _int4_linear(x, codes, scales, zeros, group_k, bias=None, mins=None, bits=4):
    from paged.kernels.int4_gemm import int4_linear

    return int4_linear(x, codes, scales, zeros, group_k, bias, mins, bits)


def triton_fused_ops() -> dict[str, Callable]:
    """{op name: Triton kernel} for `Platform.ops()`; empty (the torch defaults) without triton."""
    if find_spec("triton") is None:
        return {}
    from paged import kernels

    return {
        "rms_norm": kernels.rms_norm,
        "fused_add_rms_norm": kernels.fused_add_rms_norm,
        "add_rms_norm_linear": _add_rms_norm_linear,
        "rotary_prepare": _rotary_prepare,
        "rotary_embedding": _rotary_embedding,
        "qk_norm_rotary": _qk_norm_rotary,
        "silu_and_mul": kernels.silu_and_mul,
        "silu_and_mul_linear": _silu_and_mul_linear,
        "gemma_rms_norm": _gemma_rms_norm,  # Gemma 2/3 (paged.kernels.gemma)
        "gemma_add_rms_norm": _gemma_add_rms_norm,
        "gelu_and_mul": _gelu_and_mul,
        "moe_route": _moe_route,
        "fused_moe": kernels.fused_moe,
        # Not here: fused_moe_from_logits and add_rms_norm_moe. Their defaults run the
        # kernels above (moe_route, then fused_moe; fused_add_rms_norm, then the router and
        # the experts). paged.kernels.moe's decode fusions of them, each GEMV program routing
        # its token itself and the norm folded into the router's and gate/up GEMVs, measured
        # slower on an H200 (34.1 vs 27.7 us a layer at 1 token; 40.7 vs 40.0 us): the
        # per-program routing before the first weight load costs more than the launch it
        # saves (bench/moe_kernel.py --inline-routing).
        "fp8_linear": _fp8_linear,  # paged.quantization's linears
        "int4_linear": _int4_linear,
        "int8_linear": functools.partial(_int4_linear, bits=8),
        "lora_shrink": kernels.lora_shrink,
        "lora_expand": kernels.lora_expand,
        "apply_token_bitmask": kernels.apply_token_bitmask,  # structured outputs' mask
    }
