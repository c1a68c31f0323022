"""An EAGLE-3 draft head (SafeAILab's layout, as vLLM's llama_eagle3.py).

`fc` maps the target's aux hidden states (the inputs of a few of its layers, concatenated:
`from_target`) to the hidden size. The first decoder layer (`midlayer.*` in the checkpoint)
attends over the normed token embedding and the normed hidden state concatenated (a 2 x hidden
wide qkv_proj: `input_layernorm` on the embedding, `hidden_norm` on the hidden state, whose
residual is the hidden state before its norm, or after it with `norm_before_residual`); more
layers, where a checkpoint has them, are plain Llama layers. The forward returns the last
layer's sum with its residual: fed back as the next position's hidden state, and through the
final `norm` and the head's `lm_head` (over `draft_vocab_size` tokens) for the logits, which
`d2t` (target id - draft id, per draft id) places in the target's vocabulary, -inf elsewhere.

The embedding and the LM head are the head's own where its checkpoint has them, else the
target's (`own_embed_tokens`, `own_lm_head` on the config, set by spec_decode/eagle.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged.model import ops
from paged.model.attention import AttentionBackend, AttentionMetadata
from paged.model.eagle import DraftHead
from paged.model.llama import DecoderLayer, RMSNorm, sliding_window
from paged.model.parallel import VocabParallelEmbedding
from paged.quantization import linear


def aux_layer_ids(head_cfg, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads, in layer order: the checkpoint's
    `eagle_aux_hidden_state_layer_ids` (in its config or its `eagle_config`), else vLLM's
    default (2, layers // 2, layers - 3)."""
    ids = getattr(head_cfg, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        ids = (getattr(head_cfg, "eagle_config", None) or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
    if not ids:
        ids = (2, target_layers // 2, target_layers - 3)
    return tuple(sorted({int(i) for i in ids}))


class Eagle3FirstLayer(DecoderLayer):
    """The layer over [input_layernorm(embedding), hidden_norm(hidden state)]."""

    def __init__(self, cfg, backend: AttentionBackend, window: int | None) -> None:
        super().__init__(cfg, backend, window)
        attn, h = self.self_attn, cfg.hidden_size
        has_bias = getattr(attn.qkv_proj, "bias", None) is not None
        attn.qkv_proj = linear(2 * h, sum(attn.sizes), bias=has_bias)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, meta, rope):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = self.self_attn(positions, x, meta, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaHead(DraftHead):
    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        super().__init__(cfg, max_model_len)
        h = cfg.hidden_size
        self.draft_vocab = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.embed_tokens = self.lm_head = None
        if getattr(cfg, "own_embed_tokens", False):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h)
        if getattr(cfg, "own_lm_head", True):
            self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
        self.fc = linear(getattr(cfg, "num_aux_layers", 3) * h, h, bias=False)
        self.layers = nn.ModuleList(
            (Eagle3FirstLayer if i == 0 else DecoderLayer)(
                cfg, backend, sliding_window(cfg, i, max_model_len)
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # draft id -> target id (None: the same ids), from the checkpoint's d2t
        self.draft_to_target: torch.Tensor | None = None

    def init_rope(self, device: torch.device) -> None:
        super().init_rope(device)
        if self.draft_vocab != self.config.vocab_size:  # dummy weights: the first ids
            self.draft_to_target = torch.arange(self.draft_vocab, device=device)

    def from_target(self, aux: torch.Tensor) -> torch.Tensor:
        """The head's hidden-state input from the target's aux rows [tokens, n x H]."""
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        target_hidden: torch.Tensor,
    ) -> torch.Tensor:
        """The head's hidden states before its final norm at `positions`: input_ids[i] is
        the token after the one whose hidden state (from_target's, or past the target's the
        head's own output at the position before) is target_hidden[i]."""
        embed = self._target[0].embed_tokens if self.embed_tokens is None else self.embed_tokens
        embeds = embed(input_ids)
        rope = ops.get("rotary_prepare")(positions, self.cos_sin, embeds.dtype)
        x, residual = self.layers[0](positions, embeds, target_hidden, meta, rope)
        for layer in self.layers[1:]:
            x, residual = layer(positions, x, residual, meta, rope)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the target's vocabulary: -inf outside the draft vocabulary."""
        x = self.norm(hidden)
        if self.lm_head is None:
            return self._target[0].compute_logits(x)
        logits = self.lm_head(x).float()
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        d2t: list[torch.Tensor] = []

        def renamed():
            for name, t in weights:
                name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
                if name == "d2t":
                    d2t.append(t)
                elif name != "t2d":  # the target ids the draft vocabulary covers: unused
                    yield name, t

        loaded = super().load_weights(renamed())
        vocab = self.config.vocab_size
        if d2t:
            offsets = d2t[0].long().flatten()
            ids = torch.arange(offsets.numel()) + offsets
            if offsets.numel() != self.draft_vocab or ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(
                    "speculative_config.model: the EAGLE-3 head's d2t does not map its "
                    f"{self.draft_vocab} draft ids into the target's {vocab}"
                )
            same = self.draft_vocab == vocab and not offsets.any()
            self.draft_to_target = None if same else ids.to(self.norm.weight.device)
        elif self.draft_vocab != self.config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's draft vocabulary "
                f"({self.draft_vocab} tokens) needs d2t (draft id -> target id) in its checkpoint"
            )
        return loaded
