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
        self,
        config: EngineConfig,
        platform: Platform,
        hf_config,
        max_model_len: int,
        weights=None,
        source=None,
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
        self.model = self._build_model(weights, source)
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
        # Overlap: launch step N+1 before step N's tokens reach the host (see EngineCore.step).
        self.overlap = bool(
            platform.overlap_steps if config.async_scheduling is None else config.async_scheduling
        )

    def _build_model(self, weights, source) -> torch.nn.Module:
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
        self.platform.prepare_model(model, self.config, source if weights is not None else None)
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
        return self.inputs.pack(batch)[:4]

    @torch.inference_mode()
    def launch(self, batch: Batch, prev: StepHandle | None = None) -> StepHandle:
        """Queue one step on the device: forward, logits, sampling. Input tokens still pending
        from `prev` (the step in flight) are taken from its sampled tokens on the device."""
        prev_rows = prev.rows if prev is not None else None
        input_ids, positions, meta, logits_idx, fill = self.inputs.pack(batch, prev_rows)
        if fill is not None:
            input_ids[fill[0]] = prev.tokens[fill[1]]
        hidden = self.step_runner.forward(input_ids, positions, meta)
        reqs = [r for r, s in zip(batch.reqs, meta.seq_lens_cpu) if s >= r.num_tokens]
        if not reqs:
            return StepHandle(reqs, None, [], None)
        if logits_idx.numel() != hidden.shape[0]:  # pure decode steps need no gather
            hidden = hidden[logits_idx]
        logits = self.model.compute_logits(hidden)
        want = [r.params.logprobs for r in reqs]
        k = max((w or 0 for w in want), default=0)
        sb = build_sampling_batch(reqs, self.device, self.vocab_size)
        tokens = sample(logits, sb)
        extra: list[torch.Tensor] = []
        if any(w is not None for w in want):  # from the raw (unpenalised) logits
            logprobs = logits.log_softmax(-1)
            extra.append(logprobs.gather(1, tokens[:, None]).squeeze(1))
            if k:
                extra.extend(logprobs.topk(k, dim=-1))
        handle = StepHandle(reqs, tokens, want, None)
        if self.overlap and self.device.type != "cpu":  # result() waits for this step only
            handle.host = [self._to_host(t) for t in (tokens, *extra)]
            handle.event = torch.Event(device=self.device)
            handle.event.record()
        else:
            handle.host = [tokens, *extra]
        return handle

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.platform.pin_memory)
        return host.copy_(t, non_blocking=True)


class StepHandle:
    """A launched step: the requests that sample in it (row order) and its device results."""

    def __init__(self, reqs: list, tokens: torch.Tensor | None, want: list, host) -> None:
        self.reqs = reqs
        self.tokens = tokens  # [len(reqs)] on the device: the next step may read them
        self.rows = {r.request_id: i for i, r in enumerate(reqs)}
        self.want = want  # per request: None, or how many top logprobs it asked for
        self.host = host  # tokens (+ chosen logprob, top values, top ids) as host tensors
        self.event = None  # marks the host copies done (overlapped platforms)
        self._result: tuple[list[int], dict[str, dict[int, float]]] | None = None

    def result(self) -> tuple[list[int], dict[str, dict[int, float]]]:
        """(a sampled token per request, {request id: {token: logprob}} for those that asked
        for logprobs, the sampled token's first). Waits for this step only."""
        if self._result is None:
            if self.event is not None:
                self.event.synchronize()
            if not self.reqs:
                self._result = [], {}
            else:
                tokens = self.host[0].tolist()
                self._result = tokens, self._logprobs(tokens, [h.tolist() for h in self.host[1:]])
        return self._result

    def _logprobs(self, tokens: list[int], extra: list[list]) -> dict[str, dict[int, float]]:
        if not extra:
            return {}
        chosen, top_v, top_i = extra[0], *(extra[1:] or (None, None))
        out = {}
        for row, (req, w) in enumerate(zip(self.reqs, self.want)):
            if w is None:
                continue
            entry = {tokens[row]: chosen[row]}
            for j in range(w):
                entry.setdefault(top_i[row][j], top_v[row][j])
            out[req.request_id] = entry
        return out
