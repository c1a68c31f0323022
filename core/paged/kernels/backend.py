"""The attention backend over the portable Triton kernels, shared by the GPU plugins.

Split-K decode for pure-decode steps, one launch that also writes the step's K/V to the cache
(graph-safe: fixed splits, a preallocated workspace and counters), the cache write and the
varlen kernel for steps with prefill chunks (causal over cached context plus new tokens).
Device-neutral: the CUDA plugin uses it as is, ROCm subclasses it to pass AMD-sized launch
tiles, XPU to rename it. Triton is imported only when a kernel is planned or launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from paged.model.attention import AttentionBackend, AttentionMetadata


@dataclass
class TritonPlan:
    decode_only: bool
    num_splits: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    layer_features = frozenset({"window", "softcap", "scale"})
    quantized_cache_dtypes = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
    graph_safe_varlen = True  # the varlen grid comes from max_query_len and the batch size
    # Keyword arguments for the kernel wrappers' launch tiles (block_n, num_warps, num_stages,
    # and block_m for varlen). Empty: the kernels' own defaults, tuned on an H200. Subclasses
    # set these, or override `launch_tiles` to choose them from the device.
    decode_tiles: ClassVar[dict[str, int]] = {}
    varlen_tiles: ClassVar[dict[str, int]] = {}
    # Decode steps: the decode kernel writes the step's K/V itself and rotates q and k where
    # forward_rotary passes the rope (fuse_decode), or the cache write and the rotary kernel
    # run first; the splits merge in a second launch, or in the split kernel by the last split
    # to finish (merge_in_split, a ticket). The same bits every way. On an H100 at batch 1
    # (bench/results/h200.md, 2026-12-05 10:22) the fused write with a second launch was
    # fastest (5.76 ms a token against 5.81 unfused and 5.87 merging in the split kernel;
    # 5.62 against 5.64 by ticket once empty splits were skipped, 2026-12-07 23:09).
    fuse_decode: ClassVar[bool] = True
    merge_in_split: ClassVar[bool] = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workspace: torch.Tensor | None = None
        # int32 zeros: the decode's split tickets (allocated only under merge_in_split)
        self.counters: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []  # outgrown buffers a captured graph may use
        self.decode_kwargs, self.varlen_kwargs = self.launch_tiles()

    @classmethod
    def check_shape(cls, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from paged.kernels.head_dims import unsupported_head_dim

        super().check_shape(num_heads, num_kv_heads, head_dim)
        if (why := unsupported_head_dim(head_dim)) is not None:
            raise ValueError(f"{why}; attention backend {cls.name!r}")

    def use_cache_dtype(self, cache_dtype: torch.dtype) -> None:
        super().use_cache_dtype(cache_dtype)
        if self.quantized_cache:
            self._probe_quantized_cache()

    def _probe_quantized_cache(self) -> None:
        """Write and read a tiny fp8 cache once, at start-up: a device whose Triton cannot
        convert the dtype (e4m3 before NVIDIA sm89, some ROCm/XPU builds) fails here, with
        the reason, instead of in the first step."""
        from paged.kernels import paged_attention_decode, reshape_and_cache

        dev, h, d = self.device, self.num_kv_heads, self.head_dim
        name = str(self.cache_dtype).removeprefix("torch.")
        try:
            cache = torch.zeros(2, 2, self.block_size, h, d, dtype=self.cache_dtype, device=dev)
            ones = torch.ones(h, dtype=torch.float32, device=dev)
            kv = torch.full((1, h, d), 0.375, dtype=self.dtype, device=dev)  # exact in fp8
            slot = torch.zeros(1, dtype=torch.long, device=dev)
            reshape_and_cache(kv, kv, cache[0], cache[1], slot, ones, ones)  # position 0
            q = torch.ones(1, self.num_heads, d, dtype=self.dtype, device=dev)
            out = torch.zeros_like(q)
            seq = torch.full((1,), 2, dtype=torch.int32, device=dev)
            table = torch.arange(2, dtype=torch.int32, device=dev).view(1, 2)
            paged_attention_decode(q, cache[0], cache[1], out, seq, table, self.scale, 2, 1,
                                   k_scale=ones, v_scale=ones, key=kv, value=kv,
                                   slot_mapping=slot + 1, **self.decode_kwargs)  # fmt: skip
            ok = bool((out.float().cpu() == 0.375).all())  # position 1 written by the decode
        except Exception as e:  # the compiler's or the driver's refusal
            raise ValueError(
                f"attention backend {self.name!r}: the Triton kernels cannot store the KV cache "
                f"as {name} on this device ({type(e).__name__}: {str(e)[:300]})"
            ) from None
        if not ok:
            raise ValueError(
                f"attention backend {self.name!r}: an {name} KV cache reads back wrong values "
                "on this device"
            )

    def launch_tiles(self) -> tuple[dict[str, int], dict[str, int]]:
        """(decode, varlen) keyword arguments for `paged_attention_decode` and
        `paged_attention_varlen`; called once, at construction."""
        return dict(self.decode_tiles), dict(self.varlen_tiles)

    def ensure_workspace(self, max_batch: int) -> None:
        """The split-K decode's workspace (and its tickets, where the splits merge in the
        split kernel) for batches up to `max_batch`."""
        from paged.kernels.decode import MAX_SPLITS, decode_counters, decode_workspace

        if self.workspace is None or self.workspace.shape[0] < max_batch:
            if self.workspace is not None:  # graphs captured before keep their pointers
                self._retired += [t for t in (self.workspace, self.counters) if t is not None]
            self.workspace = decode_workspace(
                max_batch, self.num_heads, self.head_dim, MAX_SPLITS, self.device
            )
            if self.merge_in_split:
                self.counters = decode_counters(max_batch, self.num_kv_heads, self.device)

    def plan_for_graph(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Plan a captured decode step: splits fixed from the static shapes."""
        from paged.kernels import choose_num_splits

        splits = choose_num_splits(meta.num_reqs, self.num_kv_heads, meta.max_seq_len)
        return self.plan(meta, num_splits=splits)

    def plan(self, meta: AttentionMetadata, num_splits: int | None = None) -> AttentionMetadata:
        from paged.kernels import choose_num_splits

        decode_only = meta.num_decodes == meta.num_reqs
        if decode_only and num_splits is None:
            num_splits = choose_num_splits(meta.num_reqs, self.num_kv_heads, meta.max_seq_len)
        if decode_only and num_splits > 1:
            self.ensure_workspace(meta.num_reqs)
        meta.extra = TritonPlan(decode_only, num_splits or 1)
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`rotary` (decode steps only: forward_rotary): q and k not yet rotated, the kernel
        rotates them (positions, cos_sin_cache)."""
        from paged.kernels import paged_attention_decode, paged_attention_varlen, reshape_and_cache

        plan: TritonPlan = meta.extra
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        scales = {}
        if self.quantized_cache:  # fp8: quantized on write, dequantized on read
            scales["k_scale"], scales["v_scale"] = self.kv_scales(kv_cache)
        fused = plan.decode_only and self.fuse_decode  # the decode kernel writes its K/V
        if not fused:
            reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = self.scale if scale is None else scale
        layer = {"window": window, "softcap": softcap, **scales}
        if plan.decode_only:
            split = plan.num_splits > 1
            written = {"key": k, "value": v, "slot_mapping": meta.slot_mapping} if fused else {}
            paged_attention_decode(
                q,
                k_cache,
                v_cache,
                out,
                meta.seq_lens,
                meta.block_tables,
                scale,
                meta.max_seq_len,
                plan.num_splits,
                self.workspace if split else None,
                counters=self.counters if split else None,
                rotary=rotary,
                **written,
                **self.decode_kwargs,
                **layer,
            )
        else:
            assert rotary is None, "the varlen kernel takes rotated q and k"
            paged_attention_varlen(
                q,
                k_cache,
                v_cache,
                out,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                meta.max_query_len,
                meta.max_seq_len,
                **self.varlen_kwargs,
                **layer,
            )
        return out

    def forward_rotary(self, positions, q, k, v, kv_cache, meta, rope, **options):
        """Decode steps with the Triton op table's rope (positions, cos_sin_cache) over every
        dim of a power-of-two head, under fuse_decode: q and k rotated inside the decode
        kernel (one launch fewer a layer); otherwise the rotary kernel, then forward."""
        from paged.kernels.head_dims import head_pad
        from paged.kernels.ops import RopeTable

        plan: TritonPlan = meta.extra
        d = q.shape[-1]
        if (
            plan.decode_only
            and self.fuse_decode
            and isinstance(rope, RopeTable)
            and rope.cos_sin_cache.shape[-1] == d == head_pad(d)
        ):
            return self.forward(q, k, v, kv_cache, meta, rotary=rope, **options)
        return super().forward_rotary(positions, q, k, v, kv_cache, meta, rope, **options)
