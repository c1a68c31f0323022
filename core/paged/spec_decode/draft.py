"""A draft model proposes tokens: a second ModelRunner on the driver with its own paged KV
cache (spec_decode/drafting.py says how proposals are made).

Per step, for each verifying request, the draft first computes the tokens it has not seen
(the whole sequence the first time, the accepted tokens and the one after them later; all
again after a preemption), then decodes k - 1 more steps: k proposals.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from paged.config import EngineConfig
from paged.scheduled import ScheduledBatch
from paged.spec_decode.drafting import DraftView, RunnerProposer

log = logging.getLogger("paged")
# EngineConfig fields that describe the target alone (reset for the draft where present).
# The draft serves no LoRA adapter: the target's LoRA flags would refuse its config.
_TARGET_ONLY = ("tokenizer", "quantization", "enable_lora", "lora_modules", "max_loras",
                "max_lora_rank", "max_cpu_loras", "runner", "pooler_config",
                "served_model_name", "chat_template")  # fmt: skip


def proposer_config(config: EngineConfig, **changes) -> EngineConfig:
    """The config of a proposer's runner: the speculative config's model, the target's own
    options back to their defaults; a dummy target gets a dummy proposer (benchmarks)."""
    spec = config.speculative_config
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    overrides = {k: defaults[k] for k in _TARGET_ONLY if k in defaults}
    overrides.update(model=spec.model, revision=spec.revision, speculative_config=None,
                     load_format="dummy" if config.load_format == "dummy" else "auto")  # fmt: skip
    return dataclasses.replace(config, **overrides, **changes)


def build_draft_runner(config: EngineConfig, platform, target_hf_config, target_source):
    """The draft's ModelRunner (weights loaded, no KV cache yet). Refuses a draft whose
    vocabulary differs from the target's."""
    from paged.model.loader import iter_weights
    from paged.worker.model_runner import ModelRunner
    from paged.worker.worker import load_model_config

    spec = config.speculative_config
    dummy = config.load_format == "dummy"  # a dummy target gets a dummy draft (benchmarks)
    draft_config = proposer_config(config)
    hf, source = load_model_config(draft_config)
    if hf.vocab_size != target_hf_config.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({hf.vocab_size} tokens) is not "
            f"the target's ({target_hf_config.vocab_size}): a draft needs the same tokenizer"
        )
    if not dummy:
        _check_tokenizers(source, target_source)
    draft_len = getattr(hf, "max_position_embeddings", None)
    if draft_len is not None and draft_len < config.max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft's context ({draft_len}) is shorter than "
            f"max_model_len ({config.max_model_len}): lower --max-model-len"
        )
    # One KV-cache group: the draft reads the target's first group's block tables.
    runner = ModelRunner(draft_config, platform, hf, config.max_model_len,
                         None if dummy else iter_weights(source, hf), source,
                         kv_grouping=False)  # fmt: skip
    log.info("draft model %s ready", spec.model)
    return runner


def _check_tokenizers(draft_source, target_source) -> None:
    """Where both models have a tokenizer, their vocabularies must be the same mapping."""
    from paged.model.loader import load_tokenizer

    try:
        a, b = load_tokenizer(draft_source), load_tokenizer(target_source)
    except Exception:  # one has none (token-id models): the vocabulary size was checked
        return
    if a.get_vocab() != b.get_vocab():
        raise ValueError(
            "speculative_config.model: the draft's tokenizer differs from the target's "
            "(a draft needs the same tokenizer)"
        )


class DraftProposer(RunnerProposer):
    def __init__(self, runner) -> None:
        super().__init__(runner)
        # request id -> (tokens whose draft KV is written, the request's preemption count)
        self.done: dict[str, tuple[int, int]] = {}

    def forget(self, request_ids: list[str]) -> None:
        super().forget(request_ids)
        for rid in request_ids:
            self.done.pop(rid, None)

    def views(self, batch: ScheduledBatch, items: list) -> list[DraftView]:
        """The requests that propose, from the first token the draft has not seen."""
        views = []
        for req, k in items:
            done, pre = self.done.get(req.request_id, (0, -1))
            if pre != req.num_preemptions:  # its blocks were freed: all again
                done = 0
            views.append(DraftView(req.request_id, list(req.token_ids), done, req.block_ids, k))
            self.done[req.request_id] = (req.num_tokens, req.num_preemptions)
        return views

    def forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        r = self.runner
        input_ids, positions, meta, logits_idx = r.prepare(batch)
        return r.forward(input_ids, positions, meta, logits_idx)
