"""float8_e4m3fn inside Triton kernels: per-token scales and rounding to e4m3's values, the
one arithmetic of every kernel that quantizes activations (fp8_gemm's quantize_fp8_rows, the
decode GEMVs of gemv.py)."""

import triton
import triton.language as tl


@triton.jit
def round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32:
    the cast to fp8 is then exact whatever rounding the conversion does (the CPU
    interpreter's float32 -> fp8 cast mis-rounds values that carry into the next binade)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3's subnormals share 2^-6's step
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_ulp = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # exact: a power of two
    t = tl.abs(v) * inv_ulp
    r = (t + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 adds round t to an integer
    return tl.where(v < 0, -r, r) * ulp


@triton.jit
def token_scale(amax):
    """A row's per-token scale from its absmax: absmax / 448 (1e-12 for a zero row)."""
    return tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0), 1e-12)


@triton.jit
def quantize_e4m3(x, scale):
    """x / scale saturated to +-448 and rounded to e4m3's values, in float32. Both divisions
    here round correctly (div_rn): Triton's `/` on a GPU is within 2 ulp, which moves a value
    near a rounding boundary of e4m3 onto the other fp8 value than torch's division gives."""
    q = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    return round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
