"""Mixture-of-Experts layers: softmax top-k routing and the experts of one layer, stacked.

Each expert's gate and up projections are stacked into `w13` [E, 2*I, H] (gate rows first, as
`silu_and_mul` splits them) and the down projections into `w2` [E, H, I]. Routing and experts
run through the overridable op `fused_moe_from_logits` (paged.model.ops: `moe_route`, then
`fused_moe`, a grouped torch loop by default; on the GPU platforms the Triton routing kernel,
then a grouped GEMM, or per-pair GEMVs at decode). Under tensor parallelism every rank holds a
column slice [inter_start, inter_end) of every expert's gate/up and the matching columns of
down; the router is replicated and the partial outputs are summed by the row-parallel
all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from paged.distributed import parallel, tp_all_reduce
from paged.model import ops
from paged.model.attention import AttentionBackend
from paged.model.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from paged.model.parallel import split_range
from paged.quantization import narrow_in

# layers.L.mlp.experts.E.gate_proj.weight (Qwen-MoE) | layers.L.block_sparse_moe.experts.E.w1.weight
_EXPERT = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
# layers.L.mlp.experts.gate_up_proj | down_proj: transformers' in-memory stacked layout
_STACKED = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class SparseMoE(nn.Module):
    """A layer's router (`gate`) and its experts; output summed over tensor-parallel ranks."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        weights_in_model_dtype: bool,
    ) -> None:
        super().__init__()
        p = parallel()
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} exceeds the {num_experts} experts")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.inter_start, self.inter_end = split_range(inter, p.tp_size, p.tp_rank)
        local = self.inter_end - self.inter_start
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_logits(x, self.gate(x))

    def from_logits(
        self, x: torch.Tensor, logits: torch.Tensor, experts: Callable | None = None
    ) -> torch.Tensor:
        """The rest of forward after the router (whose input norm a platform's add_rms_norm_moe
        may fuse with it). `experts`: a kernel with fused_moe_from_logits' arguments in place of
        that op (paged.kernels.moe's with the norm folded in, say)."""
        dtype = x.dtype if self.weights_in_model_dtype else None
        moe = experts or ops.get("fused_moe_from_logits")  # moe_route then fused_moe, maybe as one
        return tp_all_reduce(moe(x, self.w13, self.w2, logits, self.top_k, self.renormalize, dtype))

    # ---- weights ----------------------------------------------------------------------
    def load_expert(self, expert: int, part: int, full: torch.Tensor) -> None:
        """Expert `expert`'s full checkpoint matrix: part 0 gate [I, H], 1 up [I, H], 2 down
        [H, I]; this rank's slice goes in."""
        s, e = self.inter_start, self.inter_end
        local = e - s
        with torch.no_grad():
            if part == 2:
                self._copy(self.w2[expert], full[:, s:e])
            else:
                self._copy(self.w13[expert, part * local : (part + 1) * local], full[s:e])

    def load_stacked(self, which: str, full: torch.Tensor) -> None:
        """transformers' stacked tensors: gate_up_proj [E, 2I, H] or down_proj [E, H, I]."""
        if which == "down_proj":
            for ex in range(full.shape[0]):
                self.load_expert(ex, 2, full[ex])
            return
        inter = full.shape[1] // 2
        for ex in range(full.shape[0]):
            self.load_expert(ex, 0, full[ex, :inter])
            self.load_expert(ex, 1, full[ex, inter:])

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise ValueError(
                f"expert weight: shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(src)


class Layer(DecoderLayer):
    """A pre-norm decoder layer around the given attention and MLP (a SparseMoE or dense)."""

    def __init__(self, cfg, attn: nn.Module, mlp: nn.Module) -> None:
        nn.Module.__init__(self)
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def check_silu(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (silu only)")


class MoECausalLM(LlamaForCausalLM):
    """A Llama-shaped model whose layers `make_layer` builds (some or all with a SparseMoE);
    loads per-expert checkpoint tensors into the stacked experts."""

    # The experts' matmuls are sized by how many tokens the router sends each one.
    requires: ClassVar[frozenset[str]] = frozenset({"dynamic_shapes"})

    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        check_silu(cfg)
        super().__init__(cfg, backend, max_model_len)
        self.layers = nn.ModuleList(
            self.make_layer(cfg, backend, i) for i in range(self.start_layer, self.end_layer)
        )

    def make_layer(self, cfg, backend: AttentionBackend, index: int) -> nn.Module:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= super().load_weights(self._load_experts(weights, loaded))
        return loaded

    def _load_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors go into the SparseMoE modules (recorded in `loaded`); the rest pass
        on, a Mixtral `block_sparse_moe` renamed to our `mlp`."""
        for name, tensor in weights:
            short = name.removeprefix("model.")
            m = _EXPERT.fullmatch(short)
            stacked = None if m else _STACKED.fullmatch(short)
            if m is None and stacked is None:
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor
                continue
            layer = self._local_layer(int((m or stacked).group(1)))
            if layer is None:
                continue  # another pipeline stage's
            moe = self.layers[layer].mlp
            if not isinstance(moe, SparseMoE):
                raise ValueError(f"unexpected expert weight {name!r}: layer is dense")
            prefix = f"layers.{layer}.mlp"
            if m is not None:
                expert, part = int(m.group(2)), _PART[m.group(3)]
                if expert >= moe.num_experts:
                    raise ValueError(f"unexpected weight {name!r}: {moe.num_experts} experts")
                moe.load_expert(expert, part, tensor)
                loaded.add(f"{prefix}.{'w2' if part == 2 else 'w13'}#{expert}.{part}")
            else:
                which = stacked.group(2)
                moe.load_stacked(which, tensor)
                parts = (2,) if which == "down_proj" else (0, 1)
                loaded |= {
                    f"{prefix}.{'w2' if p == 2 else 'w13'}#{e}.{p}"
                    for e in range(tensor.shape[0])
                    for p in parts
                }

    def _local_layer(self, i: int) -> int | None:
        return i - self.start_layer if self.start_layer <= i < self.end_layer else None

    def expected_weights(self) -> set[str]:
        names = set()
        for name in super().expected_weights():
            mod, _, param = name.rpartition(".")
            if param not in ("w13", "w2"):
                names.add(name)
                continue
            n = self.get_submodule(mod).num_experts
            parts = (0, 1) if param == "w13" else (2,)
            names |= {f"{name}#{e}.{p}" for e in range(n) for p in parts}
        return names

    # Dense MLP layers among MoE ones: their column range, not layer 0's (maybe a SparseMoE).
    def _dense_range(self) -> tuple[int, int]:
        p = parallel()
        return split_range(self.config.intermediate_size, p.tp_size, p.tp_rank)

    def _tp_slice(self, name: str, parts: list[str], t: torch.Tensor) -> torch.Tensor:
        if parallel().tp_size > 1 and "mlp" in parts:
            s, e = self._dense_range()
            if "gate_proj" in parts or "up_proj" in parts:
                return t.narrow(0, s, e - s)
            if "down_proj" in parts:
                if name.endswith(".bias"):
                    return t if parallel().tp_rank == 0 else torch.zeros_like(t)
                return narrow_in(t, s, e - s, self.config.intermediate_size)
        return super()._tp_slice(name, parts, t)

    def _shard_sizes(self, target: str) -> list[int]:
        if "gate_up_proj" in target:
            s, e = self._dense_range()
            return [e - s, e - s]
        return super()._shard_sizes(target)
