"""An EAGLE-1 draft head (SafeAILab's layout, as vLLM's llama_eagle.py): `fc` maps the token's
embedding and the target's final hidden state (after its norm), concatenated, to the hidden
size; then Llama decoder layers, the first without its input norm; the output is the last
layer's sum with its residual (no final norm), fed to the target's LM head and, at the next
position, back in as the hidden state. The embedding and the LM head are the target's.

HASS heads (`add_para_norm` in the config) normalize the embedding and the hidden state each
before `fc`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged.model import ops
from paged.model.attention import AttentionBackend, AttentionMetadata
from paged.model.llama import DecoderLayer, LlamaForCausalLM, RMSNorm, sliding_window
from paged.quantization import linear

# Checkpoint tensors the head does not use: the target's (embedding, LM head, a final norm)
# and the first layer's input norm (EAGLE skips it; some checkpoints still carry it).
_UNUSED = ("embed_tokens.", "lm_head.", "norm.", "layers.0.input_layernorm.")


class DraftHead(LlamaForCausalLM):
    """What a speculative head shares of LlamaForCausalLM's fields (one stage, one rank, no
    aux layers), without building the target's parts; the target is attached after loading."""

    def __init__(self, cfg, max_model_len: int) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.start_layer, self.end_layer = 0, cfg.num_hidden_layers
        self.first = self.last = True
        self.vocab_start, self.vocab_end = 0, cfg.vocab_size
        self.tied = False
        self.max_model_len = max_model_len
        self.aux_layers = ()
        self._target: list[nn.Module] = []  # in a list: not a submodule (its weights are not ours)
        self.cos_sin = None

    def attach(self, target: nn.Module) -> None:
        """Share the target's embedding and LM head (where the head has none of its own)."""
        self._target = [target]


class EagleLlamaHead(DraftHead):
    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        super().__init__(cfg, max_model_len)
        self.embed_tokens = self.lm_head = self.norm = None
        h = cfg.hidden_size
        self.fc = linear(2 * h, h, bias=True)  # a checkpoint without fc.bias loads zeros
        self.para_norm = bool(getattr(cfg, "add_para_norm", False))
        if self.para_norm:
            self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, sliding_window(cfg, i, max_model_len))
            for i in range(cfg.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's hidden-state input from the target's final hidden states: a copy (a
        graph's output buffer is overwritten by the next replay)."""
        return hidden.clone()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        target_hidden: torch.Tensor,
    ) -> torch.Tensor:
        """The head's hidden states at `positions`: input_ids[i] is the token after the one
        whose target hidden state is target_hidden[i] (or, past the target's, the head's own
        output at the position before)."""
        embeds = self._target[0].embed_tokens(input_ids)
        if self.para_norm:
            embeds = self.embedding_layernorm(embeds)
            target_hidden = self.hidden_states_layernorm(target_hidden)
        x = self.fc(torch.cat((embeds, target_hidden), dim=-1))
        rope = ops.get("rotary_prepare")(positions, self.cos_sin, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, rope)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self._target[0].compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        used = ((n, t) for n, t in weights if not n.removeprefix("model.").startswith(_UNUSED))
        loaded = super().load_weights(used)
        if "fc.bias" not in loaded:  # EAGLE-LLaMA3 and vLLM's layout: no bias
            with torch.no_grad():
                self.fc.bias.zero_()
            loaded.add("fc.bias")
        return loaded
