"""EAGLE proposals: a draft head on the target's hidden states: EAGLE-1 (model/eagle.py) on
its final hidden states, EAGLE-3 (model/eagle3.py) on the inputs of three of its layers.

The target's runner hands every step's hidden states to `EagleProposer.record` (its
hidden_tap), which turns them into the head's input (`from_target`: a copy for EAGLE-1, the
head's `fc` of the aux states for EAGLE-3): per request, the rows of the positions it computed,
kept until the head uses them. The head's input at position p is the token at p + 1 with the
target's hidden state at p, so a row is usable once the next token is known: a prompt chunk's
at once, the newest position's once its token is sampled. Each step the head first catches up
on the usable rows of every request in the step (speculating or not, so rows never pile up),
writing its own KV cache there, then proposes k tokens for the decodes given lookahead slots:
its output at the last position gives proposal 1; fed back as the hidden state beside proposal
1 at the next position, proposal 2; and so on (spec_decode/drafting.py).

A verification's rows past the accepted tokens are dropped when the target computes those
positions again. Positions the target never computed for a request (prefix-cache hits, the
prompt of a sequence forked from another) keep the head KV written there by the sequence that
computed them; a preempted request's rows are dropped (the target computes them again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from paged.config import EngineConfig
from paged.model.eagle import EagleLlamaHead
from paged.model.eagle3 import Eagle3LlamaHead, aux_layer_ids
from paged.model.llama import LlamaForCausalLM
from paged.scheduled import ScheduledBatch
from paged.spec_decode.draft import proposer_config
from paged.spec_decode.drafting import DraftView, RunnerProposer
from paged.worker.model_runner import ModelRunner

log = logging.getLogger("paged")


class EagleRunner(ModelRunner):
    """The head's runner: its own KV cache and input buffers; called eagerly (no graphs)."""

    def architecture(self) -> type:
        return EagleLlamaHead


class Eagle3Runner(EagleRunner):
    def architecture(self) -> type:
        return Eagle3LlamaHead


def build_eagle_runner(config: EngineConfig, platform, target_hf_config, target_model):
    """The head's runner (weights loaded, the target's embedding and LM head attached, no KV
    cache yet); for EAGLE-3 the target's forward then also returns its aux layers' inputs.
    Refuses a head that does not fit the target."""
    from paged.model.loader import iter_weights
    from paged.worker.worker import load_model_config

    spec = config.speculative_config
    head_config = proposer_config(config, enforce_eager=True)
    hf, source = load_model_config(head_config)
    eagle3 = spec.method == "eagle3"
    archs = " ".join(getattr(hf, "architectures", None) or [])
    is_eagle3 = "eagle3" in archs.lower() or getattr(hf, "draft_vocab_size", None) is not None
    if is_eagle3 and not eagle3:
        raise ValueError(
            f"speculative_config.model: {spec.model} is an EAGLE-3 head ({archs}): use method "
            "'eagle3' ('eagle' loads EAGLE-1 heads)"
        )
    if type(target_model).forward is not LlamaForCausalLM.forward:
        raise ValueError(
            f"speculative_config.method: {spec.method} needs a Llama-family target (Llama, "
            f"Mistral, Qwen2/3, Mixtral, Phi-3), not {type(target_model).__name__}"
        )
    for key in ("vocab_size", "hidden_size", "target_hidden_size"):
        mine = getattr(hf, key, None)
        theirs = getattr(target_hf_config, key.removeprefix("target_"))
        if mine is not None and mine != theirs:
            raise ValueError(
                f"speculative_config.model: the EAGLE head's {key} ({mine}) is not the "
                f"target's ({theirs}): a head is trained for one target"
            )
    aux = _fit_eagle3(hf, source, target_hf_config) if eagle3 else ()
    weights = None if config.load_format == "dummy" else iter_weights(source, hf)
    runner_cls = Eagle3Runner if eagle3 else EagleRunner
    runner = runner_cls(head_config, platform, hf, config.max_model_len, weights, source,
                        kv_grouping=False)  # fmt: skip
    runner.model.attach(target_model)
    target_model.aux_layers = aux
    log.info("EAGLE%s head %s ready (%d layers%s)", "-3" if eagle3 else "", spec.model,
             hf.num_hidden_layers, f", target layers {aux}" if aux else "")  # fmt: skip
    return runner


def _fit_eagle3(hf, source, target_hf_config) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads (refused where the target lacks
    them); tells the head (on its config) how many, and whether its checkpoint has its own
    embedding and LM head (else it shares the target's, as vLLM)."""
    layers = target_hf_config.num_hidden_layers
    ids = aux_layer_ids(hf, layers)
    if not all(0 <= i < layers for i in ids):
        raise ValueError(
            f"speculative_config.model: the EAGLE-3 head reads target layers {list(ids)}, the "
            f"target has {layers} (eagle_aux_hidden_state_layer_ids in the head's config sets "
            "them; the default is 2, layers // 2, layers - 3)"
        )
    vocab = target_hf_config.vocab_size
    draft_vocab = getattr(hf, "draft_vocab_size", None) or vocab
    if draft_vocab > vocab:
        raise ValueError(
            f"speculative_config.model: the EAGLE-3 head's draft_vocab_size ({draft_vocab}) "
            f"exceeds the target's vocabulary ({vocab})"
        )
    names = _checkpoint_names(source)
    hf.num_aux_layers = len(ids)
    hf.own_embed_tokens = names is not None and "embed_tokens.weight" in names
    hf.own_lm_head = names is None or "lm_head.weight" in names
    if not hf.own_lm_head and draft_vocab != vocab:
        raise ValueError(
            f"speculative_config.model: the EAGLE-3 head's draft vocabulary ({draft_vocab} "
            "tokens) needs its own lm_head.weight in the checkpoint"
        )
    return ids


def _checkpoint_names(source) -> set[str] | None:
    """The tensor names (without a `model.` prefix) of a safetensors checkpoint, from its
    headers; None for other sources (GGUF, dummy shapes)."""
    if source is None or source.kind != "hf":
        return None
    from safetensors import safe_open

    from paged.model.hf_loader import safetensors_files

    names = set()
    for f in safetensors_files(source.path):
        with safe_open(f, framework="pt") as handle:
            names |= {n.removeprefix("model.") for n in handle.keys()}  # noqa: SIM118
    return names


@dataclass
class _Rows:
    """A request's target hidden states not used by the head yet."""

    start: int  # the position of rows[0]
    rows: torch.Tensor  # [m, H]
    preemptions: int  # the request's preemption count when they were computed

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class _Tail:
    """Token ids from position `offset` on, read by absolute position: the slices the input
    packing takes, without copying the whole sequence."""

    def __init__(self, offset: int, ids: list[int]) -> None:
        self.offset, self.ids = offset, ids

    def __len__(self) -> int:
        return self.offset + len(self.ids)

    def __getitem__(self, span: slice) -> list[int]:
        return self.ids[span.start - self.offset : span.stop - self.offset]

    def append(self, token: int) -> None:
        self.ids.append(token)


class _HeadView(DraftView):
    """A request as the head sees it: token ids shifted by one (position p holds token
    p + 1), and the hidden states its next inputs go with, from position `hidden_start`."""

    hidden: torch.Tensor
    hidden_start: int
    next_index = property(lambda self: len(self.token_ids) + 1)


class EagleProposer(RunnerProposer):
    def __init__(self, runner: EagleRunner, target: ModelRunner) -> None:
        super().__init__(runner)
        self.rows: dict[str, _Rows] = {}
        target.hidden_tap = self.record

    def forget(self, request_ids: list[str]) -> None:
        super().forget(request_ids)
        for rid in request_ids:
            self.rows.pop(rid, None)

    def record(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """The target's step: `hidden` [tokens, H] (EAGLE-3: the aux states, [tokens, n x
        H]), each request's rows in batch order."""
        hidden = self.runner.model.from_target(hidden)  # also a copy of a graph's output
        at = 0
        for r, n in zip(batch.reqs, batch.num_new):
            rows, at = hidden[at : at + n], at + n
            if r.params.pooling is not None:
                continue
            s, pre = r.num_computed_tokens, r.num_preemptions
            old = self.rows.get(r.request_id)
            if old is not None and old.preemptions == pre and old.start < s <= old.end:
                rows = torch.cat((old.rows[: s - old.start], rows))  # still unused: keep
                s = old.start
            self.rows[r.request_id] = _Rows(s, rows, pre)
        for leader, seqs in batch.forks:  # each sequence computes the prompt's end anew
            kept = self.rows.get(leader.request_id)
            for f in seqs if kept is not None else ():
                self.rows[f.request_id] = _Rows(kept.start, kept.rows, f.num_preemptions)

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, items: list) -> dict[str, list[int]]:
        if batch.block_copies:  # copy on write, as the target's cache before its forward
            pairs = torch.tensor(batch.block_copies, dtype=torch.int64).T
            self.runner.step_runner.copy_blocks(pairs.to(self.runner.device))
        return super().propose(batch, items)

    def views(self, batch: ScheduledBatch, items: list) -> list[DraftView]:
        """Every request of the step with usable rows; those in `items` also propose."""
        want = {req.request_id: k for req, k in items}
        views = []
        for r in batch.reqs:
            kept = self.rows.get(r.request_id)
            if kept is None:
                continue
            if kept.preemptions != r.num_preemptions:
                del self.rows[r.request_id]  # its blocks were freed
                continue
            known = r.num_tokens - r.num_pending  # tokens on the host
            end = min(kept.end, known - 1)  # the row at p needs token p + 1
            if end <= kept.start:
                continue
            k = want.get(r.request_id, 0) if end == known - 1 else 0
            tokens = _Tail(kept.start, r.token_ids[kept.start + 1 : end + 1])
            v = _HeadView(r.request_id, tokens, kept.start, r.block_ids, k)
            v.hidden, v.hidden_start = kept.rows[: end - kept.start], kept.start
            views.append(v)
            if end < kept.end:  # the rest waits for its next token
                rest = kept.rows[end - kept.start :]
                self.rows[r.request_id] = _Rows(end, rest, kept.preemptions)
            else:
                del self.rows[r.request_id]
        return views

    def forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        r = self.runner
        input_ids, positions, meta, logits_idx = r.prepare(batch)
        hidden_in = torch.cat([
            v.hidden[v.num_computed_tokens - v.hidden_start :][:n]
            for v, n in zip(batch.reqs, batch.num_new)
        ])  # fmt: skip
        out = r.model(input_ids, positions, r.backend.plan(meta), hidden_in)
        return out[logits_idx] if logits_idx.numel() else None

    def ended(self, views: list[DraftView], hidden: torch.Tensor) -> None:
        for i, v in enumerate(views):  # the next position's input goes with this output
            v.hidden, v.hidden_start = hidden[i : i + 1], v.num_tokens
