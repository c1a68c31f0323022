"""A backend-vs-cpu check shared by the plugin tests: one mixed step (decodes, a chunked
prefill over cached context, a fresh prefill) and one decode-only step with a long context
(split-K), run through a backend and through paged-cpu's, on CPU tensors.

Run as a script (under TRITON_INTERPRET=1 for the Triton backends) it first checks that
importing and probing the plugins imports no vendor module, then prints a JSON report:
`python attn_reference.py module:Class ...`.
"""

from __future__ import annotations

import importlib
import json
import sys

import torch

from paged.model.attention import AttentionMetadata

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 32
MIXED = [(300, 1), (5, 1), (20, 7), (0, 9)]  # (cached context, new tokens), decodes first


def make_step(reqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """Random q/k/v, a KV cache holding random context, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-(c + n) // BLOCK) for c, n in reqs]
    perm = torch.randperm(sum(nblocks) + 4, generator=gen)[: sum(nblocks)].int()
    tables = torch.zeros(len(reqs), max(nblocks), dtype=torch.int32)
    cache = torch.randn(2, sum(nblocks) + 4, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    slots, off = [], 0
    for i, ((ctx, n), nb) in enumerate(zip(reqs, nblocks)):
        tables[i, :nb] = perm[off : off + nb]
        off += nb
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx, ctx + n)]
    t = len(slots)
    q = torch.randn(t, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen).to(dtype)
    qlens, seqs = [n for _, n in reqs], [c + n for c, n in reqs]
    meta = AttentionMetadata(
        num_reqs=len(reqs),
        num_decodes=sum(1 for _, n in reqs if n == 1),
        num_tokens=t,
        query_start_loc=torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).int(),
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(qlens),
        max_seq_len=max(seqs),
        query_lens_cpu=qlens,
        seq_lens_cpu=seqs,
    )
    return q, k, v, cache, meta


def run(cls: type, step, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the step) of backend `cls` on a private copy of the step."""
    q, k, v, cache, meta = step
    backend = cls(HEADS, KV_HEADS, DIM, DIM**-0.5, BLOCK, dtype, torch.device("cpu"))
    head_major = tuple(backend.kv_cache_shape(cache.shape[1]))[1] == KV_HEADS
    cache = to_head_major(cache) if head_major else cache.clone()
    meta = backend.plan(AttentionMetadata(**{**meta.__dict__, "extra": None}))
    out = backend.forward(q, k, v, cache, meta)
    return out, from_head_major(cache) if head_major else cache


def to_head_major(cache: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block_size, heads, d] -> the cpu backend's [2, heads, blocks, block_size, d]."""
    return cache.permute(0, 3, 1, 2, 4).contiguous()


def from_head_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.permute(0, 2, 3, 1, 4).contiguous()


def max_errors(cls: type, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Largest |difference| from the cpu backend, output and cache, for both steps."""
    from paged_cpu.attention import CpuAttentionBackend

    errs = {}
    for label, reqs in (("mixed", MIXED), ("decode", MIXED[:2])):
        step = make_step(reqs, dtype)
        out, cache = run(cls, step, dtype)
        ref, ref_cache = run(CpuAttentionBackend, step, dtype)
        errs[label] = (out.float() - ref.float()).abs().max().item()
        errs[label + "_cache"] = (cache.float() - ref_cache.float()).abs().max().item()
    return errs


class _Refuse:
    """A meta-path finder that fails any import of a vendor module."""

    VENDOR = ("intel_extension_for_pytorch", "torch_xla", "oneccl_bindings_for_pytorch")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.VENDOR:
            raise ImportError(f"vendor module {name} imported during probing")
        return None


def main(targets: list[str]) -> None:
    sys.meta_path.insert(0, _Refuse())
    from paged.plugins import probe_platforms

    rows = {r.name: r.reason for r in probe_platforms()}  # imports every plugin's platform
    sys.meta_path.pop(0)
    report: dict = {"probed": rows}
    for target in targets:
        mod, cls = target.split(":")
        report[target] = max_errors(getattr(importlib.import_module(mod), cls))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
