"""ModelRunner: a scheduled batch -> flat device tensors -> forward -> sampled token ids."""

from __future__ import annotations

import logging
import time

import torch

from paged.config import EngineConfig
from paged.engine.scheduler import Batch
from paged.input_buffers import InputBuffers
from paged.model import ops
from paged.model.attention import AttentionMetadata
from paged.model.llama import head_dim_of
from paged.model.registry import model_class
from paged.platform import Platform
from paged.sampling.sampler import build_sampling_batch, sample

log = logging.getLogger("paged")


class ModelRunner:
    def __init__(
        self, config: EngineConfig, platform: Platform, hf_config, max_model_len: int, weights=None
    ) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = config.torch_dtype
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        ops.use(platform.ops())
        head_dim = head_dim_of(hf_config)
        self.backend = platform.attention_backend()(
            hf_config.num_attention_heads,
            hf_config.num_key_value_heads,
            head_dim,
            head_dim**-0.5,
            config.block_size,
            self.dtype,
            self.device,
        )
        self.model = self._build_model(weights)
        self.vocab_size = hf_config.vocab_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.inputs = InputBuffers(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs,
            self.max_blocks_per_seq,
            config.block_size,
            self.device,
            platform.pin_memory,
        )
        self.step_runner = platform.step_runner()(self.model, config, platform, self.backend)

    def _build_model(self, weights) -> torch.nn.Module:
        cls = model_class(self.hf_config)
        with torch.device("meta"):
            model = cls(self.hf_config, self.backend, self.max_model_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.init_rope(self.device)
        t0 = time.perf_counter()
        if weights is None:  # dummy: seeded random weights, drawn on the device
            gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.02, generator=gen)
        else:
            loaded = model.load_weights(weights)
            missing = model.expected_weights() - loaded
            if missing:
                raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
        log.info("weights ready in %.1f s", time.perf_counter() - t0)
        return model.eval()

    # ---- KV cache -------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        shape = self.backend.kv_cache_shape(1)
        per_layer = torch.Size(shape).numel() * torch.empty((), dtype=self.dtype).element_size()
        return per_layer * self.hf_config.num_hidden_layers

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self.backend.kv_cache_shape(num_blocks)
        self.kv_caches = []
        for layer in self.model.layers:
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.kv_cache = cache
            self.kv_caches.append(cache)

    def profile_run(self) -> None:
        """A forward over `max_num_batched_tokens` tokens and logits for `max_num_seqs` rows,
        on a throwaway KV cache, so the platform sees the activation peak."""
        from paged.engine.request import Request
        from paged.engine.scheduler import Batch
        from paged.sampling.params import SamplingParams

        cfg, bs = self.config, self.block_size
        budget = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * self.max_model_len)
        batch, next_block = Batch(), 0
        while budget > 0:
            n = min(budget, self.max_model_len - 1)
            req = Request(f"profile-{len(batch)}", [0] * n, SamplingParams(temperature=0))
            nblocks = -(-n // bs)
            req.block_ids = list(range(next_block, next_block + nblocks))
            next_block += nblocks
            batch.reqs.append(req)
            batch.num_new.append(n)
            budget -= n
        self.platform.reset_peak_memory()
        self.allocate_kv_cache(next_block)
        with torch.inference_mode():
            input_ids, positions, meta, _ = self.prepare(batch)
            hidden = self.step_runner.forward(input_ids, positions, meta)
            rows = torch.zeros(cfg.max_num_seqs, dtype=torch.long, device=self.device)
            self.model.compute_logits(hidden[rows]).softmax(-1)
        self.platform.synchronize()
        self.kv_caches = []
        for layer in self.model.layers:
            layer.self_attn.kv_cache = None
        del hidden
        self.platform.empty_cache()

    # ---- one step -------------------------------------------------------------------
    def prepare(
        self, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input ids, positions, attention metadata, logits rows) on the device."""
        return self.inputs.pack(batch)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> tuple[list[int], dict[str, dict[int, float]]]:
        """Run one step. Returns a sampled token per request that completed its prompt, and
        {request id: {token: logprob}} for those that asked for logprobs (sampled first)."""
        input_ids, positions, meta, logits_idx = self.prepare(batch)
        hidden = self.step_runner.forward(input_ids, positions, meta)
        if logits_idx.numel() == 0:
            return [], {}
        if logits_idx.numel() != hidden.shape[0]:  # pure decode steps need no gather
            hidden = hidden[logits_idx]
        logits = self.model.compute_logits(hidden)
        sampling_reqs = [r for r, s in zip(batch.reqs, meta.seq_lens_cpu) if s >= r.num_tokens]
        want = [r.params.logprobs for r in sampling_reqs]
        logprobs = logits.log_softmax(-1) if any(w is not None for w in want) else None
        sb = build_sampling_batch(sampling_reqs, self.device, self.vocab_size)
        tokens = sample(logits, sb)
        return tokens.tolist(), self._logprobs(sampling_reqs, want, logprobs, tokens)

    @staticmethod
    def _logprobs(
        reqs, want: list[int | None], logprobs: torch.Tensor | None, tokens: torch.Tensor
    ) -> dict[str, dict[int, float]]:
        """The sampled token's logprob plus the top-n, from the raw (unpenalised) logits."""
        if logprobs is None:
            return {}
        k = max(w or 0 for w in want)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_v, top_i = logprobs.topk(k, dim=-1) if k else (None, None)
        top_v = top_v.tolist() if k else None
        top_i = top_i.tolist() if k else None
        out = {}
        for row, (req, w) in enumerate(zip(reqs, want)):
            if w is None:
                continue
            entry = {int(tokens[row]): chosen[row]}
            for j in range(w):
                entry.setdefault(top_i[row][j], top_v[row][j])
            out[req.request_id] = entry
        return out
