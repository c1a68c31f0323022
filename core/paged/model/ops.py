"""Elementwise ops with torch defaults that a platform may replace with fused kernels.

The defaults follow HF transformers' Llama arithmetic exactly, so float32 output is
token-identical to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from paged.quantization.reference import fp8_linear, int4_linear, int8_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(residual + x) * weight), residual + x): a pre-norm layer's residual
    add, its norm and the projection after it (GPU platforms run one-row inputs as one
    kernel: paged.kernels.gemv's OneRowGemv)."""
    x, residual = get("fused_add_rms_norm")(x, residual, weight, eps)
    return linear(x), residual


def add_rms_norm_moe(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, moe
) -> tuple[torch.Tensor, torch.Tensor]:
    """(moe(rms_norm(residual + x) * weight), residual + x): a pre-norm layer's residual add,
    its norm and the mixture of experts after it (paged.model.moe.SparseMoE). One op, so that
    a platform may fold the norm into its expert kernels (paged.kernels.moe can; measured
    slower on an H200, so the GPU platforms do not)."""
    x, residual = get("fused_add_rms_norm")(x, residual, weight, eps)
    return moe(x), residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (HF's arithmetic): x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32,
    then cast to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def gemma_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's residual add and the norm after it: s = residual + x (in the model dtype);
    returns (gemma_rms_norm(s), s). Neither input is changed."""
    s = residual + x
    return gemma_rms_norm(s, weight, eps), s


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_prepare(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per step: per-token (cos, sin) [T, 1, D] in the model dtype, as HF casts them."""
    cs = cos_sin_cache[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, :half].repeat(1, 2).unsqueeze(1).to(dtype)
    sin = cs[:, half:].repeat(1, 2).unsqueeze(1).to(dtype)
    return cos, sin


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rope
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D]; `rope` is what rotary_prepare returned for this step."""
    cos, sin = rope
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    rope,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An RMSNorm over each query and key head (Qwen3's q_norm / k_norm; `gemma`: Gemma 3's,
    gemma_rms_norm), then the rotary embedding: the platform's norm and rotary_embedding ops,
    one after the other."""
    d, norm = q.shape[-1], get("gemma_rms_norm" if gemma else "rms_norm")
    q = norm(q.reshape(-1, d), q_weight, eps).view(q.shape)
    k = norm(k.reshape(-1, d), k_weight, eps).view(k.shape)
    return get("rotary_embedding")(positions, q, k, rope)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_linear(gate_up: torch.Tensor, linear) -> torch.Tensor:
    """linear(silu_and_mul(gate_up)): a gated MLP's activation and its down projection (GPU
    platforms run one-row inputs as one kernel: paged.kernels.gemv's OneRowGemv)."""
    return linear(get("silu_and_mul")(gate_up))


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU: gelu(gate) * up over the halves of the last dim (Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing: (weights [T, k], expert ids [T, k]) from router logits
    [T, E]: softmax in float32, the top k, optionally renormalised to sum to one, cast to
    `dtype` (None: kept in float32, as HF's Mixtral does)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if dtype is None else weights.to(dtype)), ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts MLP: sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])
    with expert e = w2[e] @ silu_and_mul(w13[e] @ x). x [T, H], w13 [E, 2I, H], w2 [E, H, I].
    Grouped as HF does: a loop over the experts that received tokens (in expert order, each
    expert's tokens in (k, token) order), added back with index_add_."""
    num_tokens = topk_ids.shape[0]
    out = torch.zeros_like(x)
    flat = topk_ids.t().reshape(-1)  # [k * T]: slot j is token j % T, choice j // T
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.t().reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tokens = slots % num_tokens
        h = silu_and_mul(F.linear(x[tokens], w13[expert]))
        y = F.linear(h, w2[expert]) * weights[slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def fused_moe_from_logits(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weight_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The MoE layer from its router logits [T, E]: moe_route, then fused_moe (the active ones,
    a platform's own where it replaces them). One op so that a platform may route inside its
    expert kernels (paged.kernels.moe.fused_moe_from_logits can; measured slower on an H200,
    so the GPU platforms do not)."""
    weights, ids = get("moe_route")(router_logits, top_k, renormalize, weight_dtype)
    return get("fused_moe")(x, w13, w2, weights, ids)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta) -> torch.Tensor:
    """Batched LoRA shrink: row t of the result is x[t] @ a[slot(t)]^T (zero for tokens without
    an adapter). x [T, K], a [slots, N, K]. `meta` (paged.lora.layers.LoRABatch): token
    indices grouped by slot (`token_ids`) and each slot's run (`starts`, `starts_host`).
    Grouped: one matmul per slot with tokens (the Triton kernel is paged.kernels.lora)."""
    out = x.new_zeros(x.shape[0], a.shape[1])
    for s, (lo, hi) in enumerate(zip(meta.starts_host, meta.starts_host[1:])):
        if hi > lo:
            ids = meta.token_ids[lo:hi]
            out.index_put_((ids,), F.linear(x.index_select(0, ids), a[s]).to(out.dtype))
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, sizes: list[int], meta):
    """Batched LoRA expand, in place: for each slice j of `sizes` (consecutive columns of y,
    rows of b), y[t, slice j] += xa[t, jR:(j+1)R] @ b[slot(t), slice j]^T; b [slots,
    sum(sizes), R] with the adapter's scale folded in (qkv_proj: three slices, one each)."""
    r = b.shape[2]
    bounds = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
    for s, (lo, hi) in enumerate(zip(meta.starts_host, meta.starts_host[1:])):
        if hi > lo:
            ids = meta.token_ids[lo:hi]
            rows = xa.index_select(0, ids).to(b.dtype)
            parts = [F.linear(rows[:, j * r : (j + 1) * r], b[s, bounds[j] : bounds[j + 1]])
                     for j in range(len(sizes))]  # fmt: skip
            delta = torch.cat(parts, dim=1)
            y.index_put_((ids,), delta.to(y.dtype), accumulate=True)


_MASK_ADD: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """Set to -inf, in place, the logits of rows `rows` [k] (None: all, in order) whose bit is
    clear in `bitmask` (int32 [k, ceil(V/32)]; token t is bit t % 32 of word t // 32, as
    xgrammar packs it). A platform may replace this with its own kernel (Platform.ops())."""
    key = (logits.device, logits.dtype)
    table = _MASK_ADD.get(key)
    if table is None:  # byte value -> its 8 bits, lowest first, as 0 (set) or -inf (clear)
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill(bits == 0, float("-inf"))
        table = _MASK_ADD[key] = table.to(logits.device, logits.dtype)
    # Little-endian bytes: byte b of a row holds tokens 8b .. 8b+7. Adding 0 / -inf is one
    # vectorised pass (a boolean masked_fill is several times slower on CPU).
    k, vocab = bitmask.shape[0], logits.shape[-1]
    add = table[bitmask.contiguous().view(torch.uint8).long()].view(k, -1)
    n = min(vocab, add.shape[1])  # ids past the bitmask stay as they are
    if rows is None:
        logits[:, :n] += add[:, :n]
    elif n == vocab:
        logits.index_add_(0, rows, add[:, :n])
    else:
        logits.index_add_(0, rows, torch.nn.functional.pad(add, (0, vocab - n)))


_DEFAULTS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "add_rms_norm_linear": add_rms_norm_linear,  # the norm and the projection after it
    "add_rms_norm_moe": add_rms_norm_moe,  # the norm and the mixture of experts after it
    "rotary_prepare": rotary_prepare,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rotary": qk_norm_rotary,  # Qwen3 (paged.model.qwen3)
    "silu_and_mul": silu_and_mul,
    "silu_and_mul_linear": silu_and_mul_linear,  # the activation and the down projection
    "gemma_rms_norm": gemma_rms_norm,  # Gemma 2/3 (paged.model.gemma)
    "gemma_add_rms_norm": gemma_add_rms_norm,
    "gelu_and_mul": gelu_and_mul,
    "apply_token_bitmask": apply_token_bitmask,  # structured outputs' mask (sampler)
    "moe_route": moe_route,  # softmax top-k routing (paged.model.moe)
    "fused_moe": fused_moe,  # mixture-of-experts MLP (paged.model.moe)
    "fused_moe_from_logits": fused_moe_from_logits,  # the two above in one op
    "fp8_linear": fp8_linear,  # quantized linears (paged.quantization): fp8 weights
    "int4_linear": int4_linear,  # AWQ / GPTQ int4 weights, a GGUF's Q4 blocks
    "int8_linear": int8_linear,  # a GGUF's Q8_0 blocks (int4_linear's layout, 8-bit codes)
    "lora_shrink": lora_shrink,  # multi-LoRA (paged.lora.layers)
    "lora_expand": lora_expand,
}
_active: dict[str, Callable] = dict(_DEFAULTS)
_installed: list[dict[str, Callable] | None] = [None]  # the table whose entries _active holds


def table(overrides: dict[str, Callable]) -> dict[str, Callable]:
    """The defaults with a platform's fused ops (unknown names are an error, to catch typos)."""
    unknown = set(overrides) - set(_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown ops: {sorted(unknown)}")
    return {**_DEFAULTS, **overrides}


def install(ops: dict[str, Callable]) -> None:
    """Make a table (from `table`) the active one; nothing to do when it already is. A model
    runner installs its own before each step, so engines of two platforms in one process (an
    offline LLM beside another) each run their own kernels."""
    if _installed[0] is not ops:
        _active.clear()
        _active.update(ops)
        _installed[0] = ops


def use(overrides: dict[str, Callable]) -> None:
    """Install a platform's fused ops."""
    install(table(overrides))


@contextlib.contextmanager
def using(overrides: dict[str, Callable]) -> Iterator[None]:
    """`use` for the length of a with block, then the table as it was (tests, benchmarks)."""
    saved, owner = dict(_active), _installed[0]
    use(overrides)
    try:
        yield
    finally:
        _active.clear()
        _active.update(saved)
        _installed[0] = owner


def get(name: str) -> Callable:
    return _active[name]
