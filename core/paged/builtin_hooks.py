"""Built-in hook implementations, registered through the same hooks as plugins."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_models() -> dict[str, type]:
    from paged.model.llama import LlamaForCausalLM

    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
    }
