"""The attention-backend contract and the per-step metadata every backend receives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class AttentionMetadata:
    """A flat varlen batch: requests [0, num_decodes) have one query token each."""

    num_reqs: int
    num_decodes: int
    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 for padding
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    extra: Any = None  # whatever the backend's plan() attaches
    # KV-cache groups 1.. of a model mixing windows (model/kv_groups.py): the same batch with
    # each group's block tables and slot mapping; this metadata is group 0's.
    group_views: list[AttentionMetadata] = field(default_factory=list)

    def group(self, index: int) -> AttentionMetadata:
        """The metadata a layer of KV-cache group `index` attends with."""
        return self if index == 0 else self.group_views[index - 1]


def plan_groups(
    backend: AttentionBackend,
    meta: AttentionMetadata,
    plan: Callable[[AttentionMetadata], AttentionMetadata] | None = None,
) -> AttentionMetadata:
    """`backend.plan` (or `plan`) of the step's metadata and of each KV-cache group's view."""
    plan = plan or backend.plan
    views = [plan(view) for view in meta.group_views]
    meta = plan(meta)
    meta.group_views = views
    return meta


class AttentionBackend:
    """One instance per model; ``forward`` runs once per layer per step."""

    name = "base"
    # Per-layer options this backend's forward takes as keywords (see `layer_options`):
    # window (attend to the last `window` positions, HF's sliding window), softcap
    # (cap * tanh(scores / cap) before the softmax, Gemma 2) and scale (a layer's own
    # softmax scale instead of the constructor's).
    layer_features: ClassVar[frozenset[str]] = frozenset()
    # Quantized KV cache dtypes (--kv-cache-dtype fp8) this backend writes and reads: it
    # quantizes K/V with the layer's scales (`kv_scales`) on write and dequantizes on read.
    # Any other cache dtype than the model's is refused at start-up (`use_cache_dtype`).
    quantized_cache_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    # Whether plan() of a batch with prefill rows depends on static shapes only (its kernels
    # read lengths and tables from the device), so a graph may capture it: speculative
    # decoding's verification steps then replay graphs (worker/graph_runner.py).
    graph_safe_varlen: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.check_shape(num_heads, num_kv_heads, head_dim)  # at start-up, not in a kernel
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.cache_dtype = dtype  # the KV cache's storage dtype (use_cache_dtype)
        self._kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def check_shape(cls, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError naming the shape this backend cannot run (checked at start-up)."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} attention heads do not share {num_kv_heads} KV heads evenly"
            )

    def check_layer(self, **options: Any) -> None:
        """Raise ValueError naming an option (set, not None) this backend cannot run; models
        call it when they are built, at start-up."""
        for key, value in options.items():
            if value is not None and key not in self.layer_features:
                raise ValueError(
                    f"attention backend {self.name!r} does not support {key}={value!r} "
                    f"(supports: {', '.join(sorted(self.layer_features)) or 'none'})"
                )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    # ---- quantized KV cache ------------------------------------------------------------
    def use_cache_dtype(self, cache_dtype: torch.dtype) -> None:
        """Store the KV cache as `cache_dtype` (at start-up, before any cache is allocated);
        ValueError when this backend cannot."""
        if cache_dtype != self.dtype and cache_dtype not in self.quantized_cache_dtypes:
            kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in
                                     self.quantized_cache_dtypes)) or "none"  # fmt: skip
            raise ValueError(
                f"attention backend {self.name!r} cannot store the KV cache as "
                f"{str(cache_dtype).removeprefix('torch.')} (quantized caches it supports: {kinds})"
            )
        self.cache_dtype = cache_dtype

    @property
    def quantized_cache(self) -> bool:
        return self.cache_dtype != self.dtype

    def bind_kv_scales(
        self, kv_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
    ) -> None:
        """A layer's dequantization scales (float32 `[num_kv_heads]`: stored = value / scale)
        for its quantized cache `kv_cache`; the model runner binds them as it allocates."""
        self._kv_scales[kv_cache.data_ptr()] = (k_scale, v_scale)

    def clear_kv_scales(self) -> None:
        self._kv_scales.clear()

    def kv_scales(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) bound to this layer's quantized cache."""
        return self._kv_scales[kv_cache.data_ptr()]

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Once per step, before the forward: precompute what all layers share."""
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        **options: Any,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]: write k/v to the cache, attend, return [T, Hq, D].
        `options`: the layer's window/softcap/scale where set (never passed otherwise)."""
        raise NotImplementedError

    def forward_rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rope: Any,
        **options: Any,
    ) -> torch.Tensor:
        """The rotary embedding of q and k (the platform's `rotary_embedding` op; `rope` is
        what its `rotary_prepare` returned this step), then `forward`. A backend may rotate
        inside its attention kernel instead (the Triton backend's decode steps)."""
        from paged.model import ops

        q, k = ops.get("rotary_embedding")(positions, q, k, rope)
        return self.forward(q, k, v, kv_cache, meta, **options)


def layer_options(
    backend: AttentionBackend,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> tuple[dict[str, Any], float]:
    """A layer's keyword options for `backend.forward` (only those set) and a factor to
    multiply q by: a layer scale the backend does not take is folded into q instead.
    Refuses, naming the backend, a window or softcap it cannot run."""
    if window is not None and window <= 0:
        raise ValueError(f"sliding window {window} must be positive")
    if softcap is not None and softcap <= 0:
        softcap = None  # HF: 0 / None mean no capping
    backend.check_layer(window=window, softcap=softcap)
    opts: dict[str, Any] = {}
    if window is not None:
        opts["window"] = int(window)
    if softcap is not None:
        opts["softcap"] = float(softcap)
    q_mult = 1.0
    if scale is not None and scale != backend.scale:
        if "scale" in backend.layer_features:
            opts["scale"] = float(scale)
        else:
            q_mult = scale / backend.scale
    return opts, q_mult
