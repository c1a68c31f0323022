"""ModelRunner: a scheduled batch -> flat device tensors -> forward -> sampled token ids."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import partial

import torch

from paged.config import EngineConfig
from paged.distributed import (
    all_reduce_min_host,
    broadcast_host,
    broadcast_object_host,
    parallel,
)
from paged.model import ops
from paged.model.attention import AttentionMetadata
from paged.model.kv_groups import KVGroups, kv_groups, one_group
from paged.model.kv_quant import KVScales
from paged.model.llama import head_dim_of
from paged.model.loader import iter_weights
from paged.model.parallel import head_shard
from paged.model.registry import model_class
from paged.platform import Platform
from paged.quantization import building, init_dummy, quant_method, quantized_weights
from paged.quantization.gguf import (
    BlockLayerFactory,
    block_pieces,
    gguf_block_arrays,
    held_weights,
    unreplaced,
    use_gguf_blocks,
    weights_on_meta,
)
from paged.sampling.params import SamplingParams
from paged.sampling.sampler import (
    bitmask_rows,
    build_sampling_batch,
    plain_rows,
    sample,
    sample_rows,
)
from paged.scheduled import ScheduledBatch
from paged.worker.input_buffers import InputBuffers
from paged.worker.pipeline import pipeline_forward
from paged.worker.pooler import Pooler

log = logging.getLogger("paged")
# The first int of a step header the driver sends the other ranks: a step (whose decode graph
# may run the tail: the logits' gather is inside it on every rank), the end, or a step whose
# every row's hidden state is wanted (embeddings, a speculative tap: forward, then the head).
STEP, STOP, STEP_EVERY_ROW = 1, 2, 3


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        hf_config,
        max_model_len: int,
        weights=None,
        source=None,
        kv_grouping: bool = True,
    ) -> None:
        """`kv_grouping`: layers mixing windows get a block table per KV-cache group (off for a
        draft model, which reads the target's first group's tables)."""
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = config.torch_dtype
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.op_table = ops.table(platform.ops())  # installed before each step (ops.install)
        ops.install(self.op_table)
        head_dim = head_dim_of(hf_config)
        p = parallel()  # this rank's heads (all of them with one rank)
        heads = head_shard(hf_config.num_attention_heads, hf_config.num_key_value_heads,
                           p.tp_size, p.tp_rank)  # fmt: skip
        self.backend = platform.attention_backend()(
            heads.q_count,
            heads.kv_count,
            head_dim,
            head_dim**-0.5,
            config.block_size,
            self.dtype,
            self.device,
        )
        self.cache_dtype = config.kv_cache_torch_dtype
        self.heads = heads
        if self.cache_dtype != self.dtype:  # --kv-cache-dtype fp8: refused here if unsupported
            try:
                self.backend.use_cache_dtype(self.cache_dtype)
            except ValueError as e:
                raise ValueError(
                    f"--kv-cache-dtype {config.kv_cache_dtype} is not supported on platform "
                    f"{platform.name}: {e}"
                ) from None
        self.kv_scales = KVScales()  # the checkpoint's, read while its weights load
        self.model = self._build_model(weights, source)
        self.lora = None  # --enable-lora: the adapters' slots (wraps the model's linears)
        if config.enable_lora:
            from paged.lora.manager import LoRAManager

            max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.lora = LoRAManager(self.model, config, hf_config, max_tokens, self.device,
                                    self.dtype)  # fmt: skip
        self.vocab_size = hf_config.vocab_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_groups = self._kv_groups(kv_grouping)
        self.inputs = InputBuffers(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs,
            self.max_blocks_per_seq,
            config.block_size,
            self.device,
            platform.pin_memory,
            len(self.kv_groups),
        )
        self.step_runner = platform.step_runner()(self.model, config, platform, self.backend)
        self.step_runner.num_kv_groups = len(self.kv_groups)
        if self._tail_in_graph():  # small decode graphs run the head and the argmax too,
            self.step_runner.tail = self._logits_and_greedy  # and graphs of their own the draw
            self.step_runner.sampler = sample_rows
        # Overlap: launch step N+1 before step N's tokens reach the host (see EngineCore.step).
        self.overlap = bool(
            platform.overlap_steps if config.async_scheduling is None else config.async_scheduling
        )
        self.pooler = Pooler()  # embedding requests' vectors (and their state across chunks)
        # (batch, every row's final hidden state) after each step's forward: EAGLE reads them
        # (the inputs of the model's aux_layers instead where it has them: EAGLE-3)
        self.hidden_tap: Callable[[ScheduledBatch, torch.Tensor], None] | None = None
        # --seed: unseeded requests draw from torch's default generators, seeded here (as vLLM
        # seeds its workers), so the same requests in the same order sample the same tokens.
        torch.manual_seed(config.seed)

    def _tail_in_graph(self) -> bool:
        """Whether a decode step's head and greedy argmax may run inside its graph: one
        pipeline stage (with tensor-parallel ranks the logits' gather is captured too, and
        every rank replays the graph: follow), no LoRA (adapters on the head), no
        speculative decoding (verification and proposers read the hidden states), no aux
        layers in the output, not an embedding model (no head)."""
        c, p = self.config, parallel()
        return (
            p.pp_size == 1
            and not c.enable_lora
            and c.speculative_config is None
            and not getattr(self.model, "aux_layers", ())
            and c.runner != "pooling"
        )

    def _logits_and_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits = self.model.compute_logits(hidden)
        return logits, (None if logits is None else logits.argmax(dim=-1))

    def architecture(self) -> type:
        """The model's class (a speculative head's runner builds its own)."""
        return model_class(self.hf_config)

    def _build_model(self, weights, source) -> torch.nn.Module:
        cls = self.architecture()
        method = quant_method(self.config.quantization, self.hf_config, dummy=weights is None)
        with torch.device("meta"), building(method):  # --quantization: quantized linears
            model = cls(self.hf_config, self.backend, self.max_model_len)
        if self.config.runner == "pooling":  # no LM head: embeddings only (its weights unused)
            model.lm_head = None
        quant: Mapping[str, tuple[torch.Tensor, ...]] = {}  # the GGUF's blocks, read as asked
        pieces: dict[str, list[str]] = {}
        held: dict[str, list[str]] = {}
        make = None if weights is None else self._gguf_blocks(source)
        if make is not None:  # the layers the blocks may replace: their weights not read
            quant = gguf_block_arrays(source, self.hf_config)
            pieces = block_pieces(model, quant, getattr(model, "tied", False))
            held = held_weights(model, quant, pieces)
            skip = {n for names in held.values() for n in names}
            weights = iter_weights(source, self.hf_config, skip=skip)
        if weights is not None and self.config.runner == "pooling":
            weights = ((n, t) for n, t in weights if not n.startswith("lm_head."))
        with weights_on_meta(model, held):
            model = model.to_empty(device=self.device)
        model = model.to(self.dtype)
        model.init_rope(self.device)
        t0 = time.perf_counter()
        if weights is None:  # dummy: seeded random weights, drawn on the device
            gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
            with torch.no_grad():
                done = set(init_dummy(model, gen))  # quantized linears draw their own
                for name, p in model.named_parameters():
                    if name in done:
                        continue
                    if "norm" in name:
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.02, generator=gen)
        else:
            weights = quantized_weights(model, method, weights)  # converted for its linears
            loaded = model.load_weights(self.kv_scales.take(weights))
            if self.kv_scales and self.cache_dtype == self.dtype:
                log.info("the checkpoint's KV cache scales are unused (--kv-cache-dtype auto)")
            expected = model.expected_weights()
            missing = {n for n in expected - loaded if _module_of(n) not in held}
            if missing:
                raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
            if make is not None:
                self._use_gguf_blocks(model, quant, pieces, held, make, source)
        self.platform.prepare_model(model, self.config, source if weights is not None else None)
        log.info("weights ready in %.1f s", time.perf_counter() - t0)
        return model.eval()

    def _gguf_blocks(self, source) -> BlockLayerFactory | None:
        """The platform's block layers for a GGUF model's Q4/Q5/Q6/Q8 tensors, if it has any."""
        if source is None or source.kind != "gguf":
            return None
        return self.platform.gguf_block_layer(self.config)

    def _use_gguf_blocks(self, model, quant, pieces, held, make, source) -> None:
        """Put the platform's block layers in; read the dense weights of those `held` layers
        (their weights on the meta device) that it kept dense."""
        use_gguf_blocks(model, quant, pieces, make, self.device)
        left = unreplaced(model, held)
        if not left:
            return
        for target in left:
            mod = model.get_submodule(target)
            mod.weight = torch.nn.Parameter(
                torch.empty(mod.weight.shape, dtype=self.dtype, device=self.device),
                requires_grad=False,
            )
        only = {n for names in left.values() for n in names}
        loaded = model.load_weights(iter_weights(source, self.hf_config, only=only))
        missing = {n for n in model.expected_weights() - loaded if _module_of(n) in left}
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")

    # ---- KV cache -------------------------------------------------------------------
    def _kv_groups(self, allowed: bool) -> KVGroups:
        """The model's KV-cache groups (model/kv_groups.py). One where checkpoint KV scales
        differ per layer: a cache tensor shared by several layers has one scale."""
        args = (self.hf_config, self.model.layers, self.max_model_len)
        args += (getattr(self.model, "start_layer", 0),)
        if self.kv_scales and self.cache_dtype != self.dtype:
            allowed = False
        return kv_groups(*args) if allowed else one_group(*args)

    def _cache_places(self) -> list[tuple[int, int]]:
        """(group, cache tensor) of each of this pipeline stage's layers."""
        start = getattr(self.model, "start_layer", 0)
        return [self.kv_groups.place(start + i) for i in range(len(self.model.layers))]

    def bytes_per_block(self) -> int:
        """Bytes of one block id: in each of this stage's cache tensors (one per layer, or
        shared by the i-th layer of every KV-cache group)."""
        shape = self.backend.kv_cache_shape(1)
        elem = torch.empty((), dtype=self.cache_dtype).element_size()  # fp8: 1 byte
        per_layer = torch.Size(shape).numel() * elem
        return per_layer * len({t for _, t in self._cache_places()})

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self.backend.kv_cache_shape(num_blocks)
        self.kv_caches = []
        self.backend.clear_kv_scales()
        cfg, h = self.hf_config, self.heads
        tensors: dict[int, torch.Tensor] = {}
        for i, (layer, (group, t)) in enumerate(zip(self.model.layers, self._cache_places())):
            layer.self_attn.kv_group = group
            if t in tensors:  # shared with the same place in another group
                layer.self_attn.kv_cache = tensors[t]
                continue
            cache = tensors[t] = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
            layer.self_attn.kv_cache = cache
            self.kv_caches.append(cache)
            if self.cache_dtype != self.dtype:
                index = getattr(self.model, "start_layer", 0) + i  # the checkpoint's numbering
                scales = self.kv_scales.for_layer(index, h.kv_count, h.kv_start,
                                                  cfg.num_key_value_heads)  # fmt: skip
                self.backend.bind_kv_scales(cache, *(s.to(self.device) for s in scales))

    def profile_run(self) -> None:
        """A forward over `max_num_batched_tokens` tokens and logits for `max_num_seqs` rows,
        on a throwaway KV cache, so the platform sees the activation peak."""
        ops.install(self.op_table)
        cfg, bs = self.config, self.block_size
        budget = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (self.max_model_len - 1))
        batch, next_block = ScheduledBatch(), 0
        while budget > 0:
            n = min(budget, self.max_model_len - 1)
            nblocks = -(-n // bs)
            blocks = list(range(next_block, next_block + nblocks))
            req = ProfileRequest(f"profile-{len(batch)}", [0] * n, blocks, len(self.kv_groups))
            next_block += nblocks
            batch.reqs.append(req)
            batch.num_new.append(n)
            budget -= n
        self.platform.reset_peak_memory()
        self.allocate_kv_cache(next_block)
        with torch.inference_mode():
            input_ids, positions, meta, _ = self.prepare(batch)
            rows = torch.zeros(cfg.max_num_seqs, dtype=torch.long, device=self.device)
            hidden = self.forward(input_ids, positions, meta, rows)
            if hidden is not None and self.config.runner != "pooling":
                logits = self.model.compute_logits(hidden)
                if logits is not None:
                    logits.softmax(-1)
        self.platform.synchronize()
        self.kv_caches = []
        for layer in self.model.layers:
            layer.self_attn.kv_cache = None
        del hidden
        self.platform.empty_cache()

    # ---- one step -------------------------------------------------------------------
    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input ids, positions, attention metadata, logits rows) on the device."""
        return self.inputs.pack(batch)[:4]

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepHandle:
        """Queue one step on the device: forward, logits, sampling, and the vectors of the
        embedding requests that complete their prompt (StepHandle.embeddings)."""
        ops.install(self.op_table)
        self.pooler.forget(batch.finished_ids)
        self.pooled = None
        handle = self._launch(batch, prev)
        if self.pooled is not None:
            ids, lens, vecs = self.pooled
            if self.overlap and self.device.type != "cpu":
                vecs = self._to_host(vecs)
                handle.event = torch.Event(device=self.device)  # after every copy of the step
                handle.event.record()
            handle.pooled = (ids, lens, vecs)
        return handle

    def _launch(self, batch: ScheduledBatch, prev: StepHandle | None) -> StepHandle:
        """Input tokens still pending from `prev` (the step in flight) are taken from its
        sampled tokens on the device."""
        if prev is not None:  # its tokens feed this step
            prev.finish()
        prev_rows = prev.rows if prev is not None else None
        header = self.inputs.pack_host(batch, prev_rows)
        every_row = Pooler.wanted(batch) or self.hidden_tap is not None
        if parallel().world_size > 1:  # the other ranks run the same step (worker.follow_steps)
            kind = STEP_EVERY_ROW if every_row else STEP
            broadcast_host(torch.tensor([kind, *header], dtype=torch.int64))
            for view in self.inputs.views(header):
                broadcast_host(view)
        input_ids, positions, meta, logits_idx, fill = self.inputs.load(header)
        if self.lora is not None:  # the step's adapters in slots, its tokens by slot
            loras = [getattr(r, "lora_request", None) for r in batch.reqs]
            if parallel().world_size > 1:  # the other ranks load the same (follow)
                broadcast_object_host((loras, list(self.lora.forgotten)))
            self._prepare_lora(loras, meta.query_lens_cpu)  # the forward's tokens
        if fill is not None:
            input_ids[fill[0]] = prev.tokens[fill[1]]
        if self.inputs.block_copies is not None:
            self.step_runner.copy_blocks(self.inputs.block_copies)
        tail = None  # (logits, greedy ids) where the decode graph ran the head too
        if every_row:  # every row's hidden state
            every = self.step_runner.forward(input_ids, positions, meta)  # (one pipeline stage)
            every, aux = self._split_aux(every)
            if Pooler.wanted(batch):  # embeddings
                self.pooled = self.pooler.pool(every, batch)
            if self.hidden_tap is not None:
                self.hidden_tap(batch, every if aux is None else aux)
            hidden = every[logits_idx] if logits_idx.numel() else None
        else:
            tail = self._decode_tail(input_ids, positions, meta, logits_idx)
            if tail is None:
                hidden = self.forward(input_ids, positions, meta, logits_idx)
        # the requests that sample, and the sequence index of the token each samples
        sampling = [
            (r, int(s))
            for r, s in zip(batch.reqs, meta.seq_lens_cpu)
            if s >= r.num_tokens and r.params.pooling is None
        ]
        reqs, index = [r for r, _ in sampling], [i for _, i in sampling]
        if logits_idx.numel() == 0:
            return StepHandle(reqs, None, [], None)
        logits, greedy = tail if tail is not None else (self.model.compute_logits(hidden), None)
        prompt, split = None, self.inputs.row_split
        if split is not None:  # rows of prompt_logprobs among the sampling rows
            prompt = prompt_logprobs(batch, logits[torch.from_numpy(split[1]).to(self.device)])
            logits = logits[torch.from_numpy(split[0]).to(self.device)]
        if not reqs:  # a prompt chunk that samples nothing
            handle = StepHandle(reqs, None, [], [])
            handle.prompt = prompt
            handle.prompt_host = self._host_copies(handle, prompt[1])
            return handle
        if batch.spec:  # speculative decoding: verify the proposals (rows 1 + k each)
            from paged.spec_decode.verify import launch_verify

            mask = batch.token_bitmask
            mask = mask() if callable(mask) else mask
            handle = launch_verify(self, batch, reqs, index, logits, mask)
            handle.prompt = prompt
            handle.prompt_host = self._host_copies(handle, prompt[1] if prompt else [])
            return handle
        if batch.forks:  # forked sequences sample from their leader's row
            logits, reqs, index = fork_rows(logits, reqs, index, batch.forks)
            greedy = None
        handle = StepHandle(reqs, None, [r.params.logprobs for r in reqs], None)
        handle.prompt = prompt
        mask = batch.token_bitmask  # structured outputs etc.: masked in the sampler
        if getattr(mask, "deferred", False):  # the engine finishes the step once it is filled
            handle.pending = partial(self._sample_deferred, handle, index, logits, mask, prompt,
                                     greedy)
            return handle
        if callable(mask):  # filled now, while the device runs the queued forward
            mask = mask()
        self._sample(handle, index, logits, mask, prompt, greedy)
        return handle

    def _decode_tail(self, input_ids, positions, meta, logits_idx) -> tuple | None:
        """(logits, greedy ids) of a decode step whose graph runs the head too, else None."""
        if logits_idx.numel() != meta.num_tokens:  # (a decode step's rows all sample)
            return None
        return self.step_runner.decode_logits(input_ids, positions, meta)

    @torch.inference_mode()
    def _sample_deferred(self, handle: StepHandle, index: list[int], logits: torch.Tensor,
                         mask, prompt, greedy: torch.Tensor | None) -> None:  # fmt: skip
        self._sample(handle, index, logits, mask(), prompt, greedy)

    def _sample(self, handle: StepHandle, index: list[int], logits: torch.Tensor, mask, prompt,
                greedy: torch.Tensor | None = None) -> None:  # fmt: skip
        """Queue the step's sampling (masked by `mask`, the structured outputs' bitmask, or
        None), its logprobs, and the host copies `handle` reads. `index`: per row, the
        sequence index of the token it samples. `greedy`: the rows' argmax already taken (in
        the decode graph), the tokens when nothing else applies."""
        reqs, want = handle.reqs, handle.want
        k = max((w or 0 for w in want), default=0)
        tokens = None
        if greedy is not None and mask is None:  # the decode graph ran the tail
            tokens = self._sample_in_graph(reqs, greedy)
        if tokens is None:
            sb = build_sampling_batch(reqs, self.device, self.vocab_size, index)
            if mask is not None:
                sb.bitmask = bitmask_rows(mask, reqs, self.device, self.platform.pin_memory)
            tokens = greedy if greedy is not None and sb.argmax_only else sample(logits, sb)
        extra: list[torch.Tensor] = []
        if any(w is not None for w in want):  # from the raw (unpenalised) logits
            logprobs = logits.log_softmax(-1)
            chosen = logprobs.gather(1, tokens[:, None])
            extra += [chosen.squeeze(1), (logprobs > chosen).sum(-1) + 1]  # value, rank
            if k:
                extra.extend(logprobs.topk(k, dim=-1))
        handle.tokens = tokens
        copies = self._host_copies(handle, [tokens, *extra, *(prompt[1] if prompt else [])])
        handle.host, handle.prompt_host = copies[: 1 + len(extra)], copies[1 + len(extra) :]

    def _sample_in_graph(self, reqs: list, greedy: torch.Tensor) -> torch.Tensor | None:
        """The tokens of a decode step whose graph ran the tail, where nothing but temperature,
        top-k/top-p and min-p shapes the draw: the graph's argmax, or its sampler graph's
        draw; None otherwise (sample eagerly)."""
        rows = plain_rows(reqs, self.vocab_size)
        if rows is None:
            return None
        if all(t == 0.0 for t, *_ in rows):
            return greedy
        sort = any(k < self.vocab_size or p < 1.0 for t, k, p, _ in rows if t > 0)
        return self.step_runner.decode_sample(len(rows), rows, sort)

    def _host_copies(self, handle: StepHandle, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as result() reads them: host copies that an event marks done where the
        device runs ahead (overlap), else the tensors themselves."""
        if self.overlap and self.device.type != "cpu":  # result() waits for this step only
            tensors = [self._to_host(t) for t in tensors]
            handle.event = torch.Event(device=self.device)
            handle.event.record()
        return tensors

    def _prepare_lora(self, loras: list, query_lens: list[int]) -> None:
        """The step's adapters into slots; with several ranks, all of them or none (a rank
        that cannot load them fails the step on every rank, instead of leaving the others
        waiting in the forward's collectives)."""
        error: Exception | None = None
        try:
            self.lora.prepare(loras, query_lens)
        except Exception as e:
            error = e
        if parallel().world_size > 1 and all_reduce_min_host(int(error is None)) == 0:
            error = error or RuntimeError("LoRA: another rank could not load this step's adapters")
        if error is not None:
            raise error

    @torch.inference_mode()
    def follow(self, header: list[int], every_row: bool = False) -> None:
        """A rank other than the driver: run the step whose inputs just arrived in the current
        host buffers (its part of the forward, and of the logits' gather), down the driver's
        path: the decode graph with the tail where the driver replays it (`every_row`: the
        driver wants every row's hidden state, so forward, then the head)."""
        ops.install(self.op_table)
        input_ids, positions, meta, logits_idx, _ = self.inputs.load(header)
        if self.lora is not None:  # the driver's adapters for this step, in the same slots
            loras, forgotten = broadcast_object_host()
            for lora_int_id in forgotten:
                self.lora.forget(lora_int_id)
            try:
                self._prepare_lora(loras, meta.query_lens_cpu)
            except Exception:  # every rank skips this step's forward; the driver reports it
                log.exception("LoRA adapters of a step could not be loaded")
                return
        if self.inputs.block_copies is not None:
            self.step_runner.copy_blocks(self.inputs.block_copies)
        if not every_row and self._decode_tail(input_ids, positions, meta, logits_idx) is not None:
            return
        hidden = self.forward(input_ids, positions, meta, logits_idx)
        if hidden is not None:
            self.model.compute_logits(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_idx: torch.Tensor,
    ) -> torch.Tensor | None:
        """The final hidden states of the rows in `logits_idx`, on the first pipeline stage
        (None elsewhere, or when no row needs logits). With pipeline stages the batch goes
        through them as micro-batches (worker/pipeline.py); the last sends the rows back."""
        p, nl = parallel(), logits_idx.numel()
        if p.pp_size == 1:
            hidden, _ = self._split_aux(self.step_runner.forward(input_ids, positions, meta))
            if nl == 0:
                return None
            return hidden if nl == hidden.shape[0] else hidden[logits_idx]
        # LoRA's token slots describe the whole step: its stages run it as one group
        groups = 1 if self.lora is not None else self.config.pipeline_micro_batches
        return pipeline_forward(self.model, self.backend, input_ids, positions, meta, logits_idx,
                                self.hf_config.hidden_size, self.dtype, groups)  # fmt: skip

    def _split_aux(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states, the aux layers' inputs or None) of a forward's output: a model
        with aux_layers (EAGLE-3's target) returns them concatenated."""
        if not getattr(self.model, "aux_layers", ()):
            return out, None
        h = self.hf_config.hidden_size
        return out[:, :h], out[:, h:]

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.platform.pin_memory)
        return host.copy_(t, non_blocking=True)


def fork_rows(
    logits: torch.Tensor, reqs: list, index: list[int], forks: list
) -> tuple[torch.Tensor, list, list[int]]:
    """Logits, requests and sampled tokens' indices with a copy of each leader's row for
    every sequence forked from it, after the batch's own rows."""
    row = {id(r): i for i, r in enumerate(reqs)}
    idx = [row[id(lead)] for lead, seqs in forks for _ in seqs]
    extra = logits[torch.tensor(idx, device=logits.device)]
    forked = [s for _, seqs in forks for s in seqs]
    return torch.cat([logits, extra]), [*reqs, *forked], [*index, *(index[i] for i in idx)]


def prompt_logprobs(batch: ScheduledBatch, logits: torch.Tensor) -> tuple[list, list]:
    """The prompt_logprobs of a step's prompt rows (in InputBuffers.pack_host's order): per
    request (id, position of its first token here, count, k, the tokens), and on the device
    each token's logprob and rank, then the top-k values and ids (raw logits, as vLLM)."""
    metas, targets = [], []
    for r, n in zip(batch.reqs, batch.num_new):
        if r.params.prompt_logprobs is None:
            continue
        s = r.num_computed_tokens
        m = max(0, min(n, r.num_prompt_tokens - 1 - s))
        if m:
            toks = r.token_ids[s + 1 : s + 1 + m]
            metas.append((r.request_id, s + 1, m, r.params.prompt_logprobs, toks))
            targets += toks
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
    k = max(meta[3] for meta in metas)
    top = list(lp.topk(k, dim=-1)) if k else []
    return metas, [chosen.squeeze(1), (lp > chosen).sum(-1) + 1, *top]


class ProfileRequest:
    """A stand-in request for the profiling forward (a RequestView)."""

    def __init__(
        self, request_id: str, token_ids: list[int], block_ids: list[int], groups: int = 1
    ) -> None:
        self.request_id = request_id
        self.params = SamplingParams(temperature=0)
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.block_ids = block_ids
        self.group_block_ids = [block_ids] * groups  # a throwaway cache: the same in each

    num_tokens = property(lambda self: len(self.token_ids))
    num_output_tokens = property(lambda self: 0)
    output_token_ids = property(lambda self: [])


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
        self.ranks: dict[str, int] = {}  # the sampled token's rank, where logprobs were asked
        self.prompt = None  # prompt_logprobs: (metas, device tensors) of prompt_logprobs()
        self.prompt_host: list[torch.Tensor] = []
        self.pooled = None  # embeddings: (request ids, lengths, vectors concatenated)
        # The sampling still to queue (a deferred structured-outputs mask): finish() runs it.
        self.pending: Callable[[], None] | None = None

    def finish(self) -> None:
        """Queue the step's sampling if it was deferred (its mask being filled)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()

    def embeddings(self) -> dict[str, list[float]]:
        """{request id: vector} of the embedding requests this step completed. Waits for it."""
        if self.pooled is None:
            return {}
        if self.event is not None:
            self.event.synchronize()
        ids, lens, vecs = self.pooled
        flat, out, at = vecs.tolist(), {}, 0
        for rid, n in zip(ids, lens):
            out[rid], at = flat[at : at + n], at + n
        return out

    def prompt_logprobs(self) -> dict[str, tuple[int, list[dict[int, float]], list[int]]]:
        """{request id: (position of the first token, [{token: logprob} with its top-k],
        [rank of each token])} for the prompt rows of this step. Waits for this step."""
        if self.prompt is None:
            return {}
        if self.event is not None:
            self.event.synchronize()
        metas, _ = self.prompt
        chosen, ranks, *top = [h.tolist() for h in self.prompt_host]
        out, row = {}, 0
        for rid, first, m, k, toks in metas:
            entries = []
            for j, tok in zip(range(row, row + m), toks):
                entry = {tok: chosen[j]}
                for t, v in zip(top[1][j][:k], top[0][j][:k]) if k else ():
                    entry.setdefault(t, v)
                entries.append(entry)
            out[rid] = (first, entries, ranks[row : row + m])
            row += m
        return out

    def result(self) -> tuple[list[int], dict[str, dict[int, float]]]:
        """(a sampled token per request, {request id: {token: logprob}} for those that asked
        for logprobs, the sampled token's first). Waits for this step only."""
        if self._result is None:
            self.finish()
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
        chosen, ranks, top_v, top_i = extra[0], extra[1], *(extra[2:] or (None, None))
        out = {}
        for row, (req, w) in enumerate(zip(self.reqs, self.want)):
            if w is None:
                continue
            self.ranks[req.request_id] = ranks[row]
            entry = {tokens[row]: chosen[row]}
            for j in range(w):
                entry.setdefault(top_i[row][j], top_v[row][j])
            out[req.request_id] = entry
        return out


def _module_of(weight: str) -> str:
    """The module path of an expected weight name ("layers.0.mlp.gate_up_proj.weight#1")."""
    return weight.split("#")[0].rsplit(".", 1)[0]
