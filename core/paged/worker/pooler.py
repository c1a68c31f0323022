"""Pools the final (normed) hidden states of embedding requests, in float32, on the driver.

A pooling request is a prefill that ends with its prompt: the step that computes its last
prompt chunk returns its vector instead of a sampled token. With chunked prefill MEAN keeps a
running float32 sum and CLS the first token's state between chunks (per request, dropped when
the request ends); a chunk starting at position 0 (a first admission, or a recompute after a
preemption) starts over. MEAN and CLS never take prefix-cache hits (kv_cache.find_cached),
whose hidden states would be missing; LAST needs only the last token, always computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.scheduled import ScheduledBatch


class Pooler:
    def __init__(self) -> None:
        self.partial: dict[str, torch.Tensor] = {}  # request id -> MEAN's sum | CLS's row

    @staticmethod
    def wanted(batch: ScheduledBatch) -> bool:
        return any(r.params.pooling is not None for r in batch.reqs)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.partial.pop(rid, None)

    def pool(
        self, hidden: torch.Tensor, batch: ScheduledBatch
    ) -> tuple[list[str], list[int], torch.Tensor] | None:
        """(request ids, vector lengths, the vectors concatenated) of the pooling requests
        that complete their prompt in this step; `hidden`: every row of the step."""
        ids, lens, vecs, off = [], [], [], 0
        for r, n in zip(batch.reqs, batch.num_new):
            rows, off = hidden[off : off + n], off + n
            p = r.params.pooling
            if p is None:
                continue
            rid, start = r.request_id, r.num_computed_tokens
            if start == 0:
                self.partial.pop(rid, None)
            elif p.needs_every_token and rid not in self.partial:
                raise RuntimeError(
                    f"pooling {rid}: the hidden states of tokens 0..{start} are gone"
                )
            done = start + n >= r.num_prompt_tokens
            if p.pooling_type == "MEAN":
                acc = rows.float().sum(0)
                if start:
                    acc = acc + self.partial[rid]
                vec = acc / r.num_prompt_tokens
            elif p.pooling_type == "CLS":
                acc = rows[0].float() if start == 0 else self.partial[rid]
                vec = acc
            else:  # LAST
                acc = vec = rows[-1].float()
            if not done:
                if p.needs_every_token:
                    self.partial[rid] = acc
                continue
            self.partial.pop(rid, None)
            if p.dimensions is not None:  # Matryoshka: the leading dimensions, then normalise
                vec = vec[: p.dimensions]
            if p.normalize:
                vec = F.normalize(vec, p=2, dim=-1)
            ids.append(rid)
            lens.append(vec.shape[0])
            vecs.append(vec)
        if not ids:
            return None
        return ids, lens, torch.cat(vecs)
