"""Built-in hook implementations, registered through the same hooks as plugins."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_models() -> dict[str, type]:
    from paged.model.gemma import GemmaForCausalLM
    from paged.model.llama import LlamaForCausalLM
    from paged.model.mixtral import MixtralForCausalLM
    from paged.model.phi3 import Phi3ForCausalLM
    from paged.model.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Gemma2ForCausalLM": GemmaForCausalLM,
        "Gemma3ForCausalLM": GemmaForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
    }
