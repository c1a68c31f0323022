"""How a model is split over tensor-parallel ranks, and the vocabulary-parallel embedding.

Attention is split by KV-head groups: rank r holds a contiguous range of KV heads and the
query heads that read them (as even as the counts allow, so 3 KV heads over 2 ranks give 1
and 2); with fewer KV heads than ranks each KV head is replicated and its query heads are
split. MLP columns and vocabulary rows are split in contiguous ranges. The linears stay plain
`nn.Linear` modules holding their shard, so platforms may still repack or replace them; the
all-reduce of a row-parallel output happens in the layer that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged.distributed import parallel, tp_all_reduce


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """[start, end) of part i when n items are split into `parts` contiguous parts."""
    return n * i // parts, n * (i + 1) // parts


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv0, kv1 = split_range(num_kv_heads, tp, rank)
        return HeadShard(kv0 * group, (kv1 - kv0) * group, kv0, kv1 - kv0)
    if tp % num_kv_heads or group % (tp // num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size: {tp} ranks cannot share {num_kv_heads} KV heads of "
            f"{group} query heads each evenly (use at most {num_kv_heads} ranks, or a "
            f"multiple of {num_kv_heads} that divides the {num_heads} query heads)"
        )
    per_kv = tp // num_kv_heads  # ranks sharing one KV head
    kv = rank // per_kv
    q_each = group // per_kv
    return HeadShard(kv * group + (rank % per_kv) * q_each, q_each, kv, 1)


def check_split(hf_config, tp: int, pp: int) -> None:
    """Refuse, with a ValueError naming the flag, a split of this model (its config.json) that
    its ranks could not build: query heads that do not share the KV heads evenly, a tensor
    parallel size head_shard cannot place, more pipeline stages than layers (split_range would
    leave a stage without one). MLP columns, MoE experts' columns and vocabulary rows split
    over any number of ranks. The engine calls it before any rank starts."""
    heads = getattr(hf_config, "num_attention_heads", None)
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and isinstance(kv, int):
        if kv < 1 or heads % kv:
            raise ValueError(f"model: {heads} attention heads do not share {kv} KV heads evenly")
        if tp > 1:
            head_shard(heads, kv, tp, 0)  # the rule every rank applies (raises for all alike)
    layers = getattr(hf_config, "num_hidden_layers", None)
    if isinstance(layers, int) and pp > layers:
        raise ValueError(
            f"pipeline_parallel_size: {pp} stages for the model's {layers} layers would leave "
            f"a stage without one (at most {layers})"
        )


def vocab_shard(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of this rank's vocabulary rows; every shard has the same size (the last
    one padded past the vocabulary)."""
    per = -(-vocab_size // tp)
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on each rank; a lookup outside them gives zeros, and
    the all-reduce sums the one rank that holds each token."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        p = parallel()
        self.vocab_size = vocab_size
        self.start, self.end = vocab_shard(vocab_size, p.tp_size, p.tp_rank)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel().tp_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        return tp_all_reduce(x)

    def load(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full [vocab, dim] matrix (padding rows stay zero)."""
        rows = full[self.start : min(self.end, full.shape[0])]
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: rows.shape[0]].copy_(rows)
