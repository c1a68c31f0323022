"""Attention on Intel GPUs: IPEX's paged-attention kernels when usable, else Triton.

Both paths share the default cache layout `[2, blocks, block_size, kv_heads, head_dim]` (the
"flash" layout, which IPEX's `reshape_and_cache_flash` and `flash_attn_varlen_func` take),
so the choice never changes the KV cache. One varlen call serves every step, decodes
included, as vLLM's XPU backend does: IPEX's `single_query_cached_kv_attention` wants the
head-major layout `[blocks, kv_heads, block_size, head_dim]` and is not used.

Order: the platform's xpu_attention option (`--xpu-attention ipex|triton`,
`LLM(xpu_attention=...)`, fallback `PAGED_XPU_ATTENTION`) forces one; otherwise (`auto`) IPEX
when an XPU build of it imports, has both ops, the dtype is float16/bfloat16 and the GPU has
XMX units; otherwise the portable Triton kernels.
"""

from __future__ import annotations

from importlib.util import find_spec

import torch

from paged.model.attention import AttentionBackend, AttentionMetadata

ATTENTION_ENV = "PAGED_XPU_ATTENTION"  # the xpu_attention option's fallback
CHOICES = ("auto", "ipex", "triton")
IPEX_OPS = ("reshape_and_cache_flash", "flash_attn_varlen_func")


def has_xmx(index: int = 0) -> bool:
    props = torch.xpu.get_device_properties(index)
    return bool(getattr(props, "has_subgroup_matrix_multiply_accumulate", True))


def ipex_problem(dtype: torch.dtype) -> str | None:
    """None when IPEX's paged attention can serve `dtype` here, else why not."""
    if find_spec("intel_extension_for_pytorch") is None:
        return "intel_extension_for_pytorch is not installed"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"IPEX flash attention takes float16/bfloat16, not {str(dtype)[6:]}"
    try:
        import intel_extension_for_pytorch as ipex
    except Exception as e:  # a broken or mismatched IPEX must not stop the Triton path
        return f"importing intel_extension_for_pytorch failed: {type(e).__name__}: {e}"
    version = str(getattr(ipex, "__version__", "?"))
    if "xpu" not in version:
        return f"intel_extension_for_pytorch {version} is not an XPU build"
    modules = getattr(getattr(ipex, "llm", None), "modules", None)
    paged = getattr(modules, "PagedAttention", None)
    missing = [op for op in IPEX_OPS if not hasattr(paged, op)]
    if missing:
        return f"intel_extension_for_pytorch {version} lacks PagedAttention.{missing[0]}"
    if not has_xmx():
        return "this GPU has no XMX units (IPEX's flash kernels need them)"
    return None


def choose_attention(
    dtype: torch.dtype, choice: str = "auto"
) -> tuple[type[AttentionBackend], str]:
    """(backend class, why): the IPEX -> Triton fallback order described above; `choice`
    is the xpu_attention option (auto | ipex | triton)."""
    if choice not in CHOICES:
        raise ValueError(f"xpu_attention={choice!r}: use auto, ipex or triton")
    problem = "xpu_attention=triton" if choice == "triton" else ipex_problem(dtype)
    if problem is None:
        return IpexAttentionBackend, "ipex"
    if choice == "ipex":
        raise ValueError(f"xpu_attention=ipex, but {problem}")
    if find_spec("triton") is None:
        raise ValueError(
            f"no attention kernels for XPU: {problem}, and triton is not installed "
            "(pytorch-triton-xpu comes with XPU builds of torch)"
        )
    from paged_xpu.triton_attention import XpuTritonAttentionBackend

    return XpuTritonAttentionBackend, f"triton ({problem})"


class IpexAttentionBackend(AttentionBackend):
    name = "ipex"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cu_kv: torch.Tensor | None = None  # int32 [0, cumsum(seq_lens)...]

    def ensure_workspace(self, max_batch: int) -> None:
        if self.cu_kv is None or self.cu_kv.shape[0] < max_batch + 1:
            self.cu_kv = torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        self.ensure_workspace(meta.num_reqs)
        return meta

    def plan_for_graph(self, meta: AttentionMetadata) -> AttentionMetadata:
        return self.plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        from intel_extension_for_pytorch.llm.modules import PagedAttention

        k_cache, v_cache = kv_cache[0], kv_cache[1]
        PagedAttention.reshape_and_cache_flash(
            k, v, k_cache, v_cache, meta.slot_mapping, "auto", 1.0, 1.0
        )
        n = meta.num_reqs
        # Cumulative context lengths, recomputed in every layer so a captured graph does too.
        cu_kv = self.cu_kv[: n + 1]
        torch.cumsum(meta.seq_lens, 0, dtype=torch.int32, out=cu_kv[1:])
        q = q.contiguous()
        out = torch.empty_like(q)
        PagedAttention.flash_attn_varlen_func(
            out,
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            cu_kv,
            meta.max_query_len,
            meta.max_seq_len,
            self.scale,
            True,  # causal, aligned to the end of each context
            meta.block_tables,
            None,  # alibi slopes
        )
        return out
