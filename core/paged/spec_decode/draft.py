"""A draft model proposes tokens: a second ModelRunner on the driver with its own paged KV
cache of the same number of blocks as the target's, addressed by the target's block tables
(the scheduler's allocations, lookahead slots included), so it needs no allocator of its own.

Per step, for each verifying request, the draft first computes the tokens it has not seen
(the whole sequence the first time, the accepted tokens and the one after them later; all
again after a preemption), then decodes k - 1 more steps: k proposals. For a greedy request
the draft's argmax (a point mass for the verification); for a sampling request a draw from the
draft's distribution under the request's own temperature / top-k / top-p / min-p / logit bias,
which is kept as q for the rejection sampler (a draft like the target is then mostly
accepted). Its KV at a rejected proposal's position is overwritten when the sequence gets
there, as the target's.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from paged.config import EngineConfig
from paged.sampling.params import SamplingParams
from paged.sampling.rejection import apply_logit_bias, sampling_probs
from paged.sampling.sampler import build_sampling_batch
from paged.scheduled import ScheduledBatch

log = logging.getLogger("paged")
# EngineConfig fields that describe the target alone (reset for the draft where present).
_TARGET_ONLY = ("tokenizer", "quantization", "enable_lora", "runner", "pooler_config",
                "served_model_name", "chat_template")  # fmt: skip


def build_draft_runner(config: EngineConfig, platform, target_hf_config, target_source):
    """The draft's ModelRunner (weights loaded, no KV cache yet). Refuses a draft whose
    vocabulary differs from the target's."""
    from paged.model.loader import iter_weights
    from paged.worker.model_runner import ModelRunner
    from paged.worker.worker import load_model_config

    spec = config.speculative_config
    # The target's own options go back to their defaults for the draft.
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    overrides = {k: defaults[k] for k in _TARGET_ONLY if k in defaults}
    dummy = config.load_format == "dummy"  # a dummy target gets a dummy draft (benchmarks)
    overrides.update(model=spec.model, revision=spec.revision, speculative_config=None,
                     load_format="dummy" if dummy else "auto")  # fmt: skip
    draft_config = dataclasses.replace(config, **overrides)
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


class _View:
    """A request as the draft runner sees it (a RequestView): the token ids it computes."""

    params = SamplingParams(temperature=0)
    num_pending = 0
    lora_int_id = 0

    def __init__(self, request_id: str, token_ids: list[int], done: int, block_ids) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = done
        self.block_ids = block_ids

    num_tokens = property(lambda self: len(self.token_ids))
    num_output_tokens = property(lambda self: 0)
    output_token_ids = property(lambda self: [])


class DraftProposer:
    def __init__(self, runner) -> None:
        self.runner = runner
        # request id -> (tokens whose draft KV is written, the request's preemption count)
        self.done: dict[str, tuple[int, int]] = {}
        self.reqs: dict[str, object] = {}  # the requests of the current propose()
        # the last propose()'s distributions of sampled proposals: {request id: [k, V]}
        self.probs: dict[str, list[torch.Tensor]] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.done.pop(rid, None)
            self.runner.generators.pop(rid, None)

    @torch.inference_mode()
    def propose(self, items: list) -> dict[str, list[int]]:
        """{request id: k proposals} for (request, k) pairs (decodes with lookahead slots)."""
        views, want = [], {}
        self.reqs = {req.request_id: req for req, _ in items}
        self.probs = {}
        for req, k in items:
            done, pre = self.done.get(req.request_id, (0, -1))
            if pre != req.num_preemptions:  # its blocks were freed: all again
                done = 0
            views.append(_View(req.request_id, list(req.token_ids), done, req.block_ids))
            want[req.request_id] = k
            self.done[req.request_id] = (req.num_tokens, req.num_preemptions)
        props: dict[str, list[int]] = {v.request_id: [] for v in views}
        # Catch up: what the draft has not seen, in chunks within the token budget.
        budget_max = self.runner.config.max_num_batched_tokens
        todo = views
        while todo:
            batch, budget = ScheduledBatch(), budget_max
            for v in todo:
                n = min(v.num_tokens - v.num_computed_tokens, budget)
                if n <= 0:
                    break
                batch.reqs.append(v)
                batch.num_new.append(n)
                budget -= n
            self._run(batch, props)
            todo = [v for v in todo if v.num_computed_tokens < v.num_tokens]
        # Then one token at a time: each request's newest proposal in, the next out.
        for _ in range(max(want.values(), default=0) - 1):
            batch = ScheduledBatch()
            for v in views:
                if len(props[v.request_id]) < want[v.request_id]:
                    v.token_ids.append(props[v.request_id][-1])
                    batch.reqs.append(v)
                    batch.num_new.append(1)
            if not batch.reqs:
                break
            batch.num_decodes = len(batch.reqs)
            self._run(batch, props)
        return props

    def _run(self, batch: ScheduledBatch, props: dict[str, list[int]]) -> None:
        """One draft forward; the greedy token of each request whose input ends its tokens."""
        r = self.runner
        input_ids, positions, meta, logits_idx = r.prepare(batch)
        hidden = r.forward(input_ids, positions, meta, logits_idx)
        ends = [v for v, n in zip(batch.reqs, batch.num_new)
                if v.num_computed_tokens + n >= v.num_tokens]  # fmt: skip
        for v, n in zip(batch.reqs, batch.num_new):
            v.num_computed_tokens += n
        if hidden is None or not ends:
            return
        logits = r.model.compute_logits(hidden)
        tokens = logits.argmax(-1)
        sampled = [i for i, v in enumerate(ends) if not self.reqs[v.request_id].params.greedy]
        if sampled:  # draws from the draft's distribution, kept for the verification
            reqs = [self.reqs[ends[i].request_id] for i in sampled]
            rows = logits[torch.tensor(sampled, device=logits.device)]
            sb = build_sampling_batch(reqs, logits.device, r.vocab_size, r.generators)
            apply_logit_bias(rows, sb)
            q = sampling_probs(rows, sb)
            noise = torch.empty_like(q).exponential_()
            for row, gen in sb.generators.items():
                noise[row].exponential_(generator=gen)
            tokens[torch.tensor(sampled, device=logits.device)] = (q / noise).argmax(-1)
            for j, i in enumerate(sampled):
                self.probs.setdefault(ends[i].request_id, []).append(q[j])
        for v, t in zip(ends, tokens.tolist()):
            props[v.request_id].append(t)
