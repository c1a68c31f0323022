"""Two PEFT adapters on the session's tiny random Llama, made with peft as users make them,
and HF's reference: the base model with each adapter merged (merge_and_unload)."""

from __future__ import annotations

import pytest
import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, LoraConfig kwargs): every target at rank 8; a partial one at rank 4 with rsLoRA
ADAPTERS = {
    "alpha": dict(r=8, lora_alpha=16, target_modules=ALL),
    "beta": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                 use_rslora=True),
}  # fmt: skip


def make_adapter(base_path: str, out: str, seed: int, **lora_kwargs) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # large enough to change greedy outputs
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def adapter_maker():
    """make_adapter(base path, out dir, seed, **LoraConfig kwargs) -> out dir."""
    return make_adapter


@pytest.fixture(scope="session")
def lora_model(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def adapters(lora_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: make_adapter(lora_model, str(root / name), seed, **kw)
        for seed, (name, kw) in enumerate(ADAPTERS.items(), start=1)
    }


@pytest.fixture(scope="session")
def hf_models(lora_model, adapters):
    """{None: the base model, name: the base with that adapter merged}, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(lora_model, dtype=torch.float32).eval()

    out = {None: base()}
    for name, path in adapters.items():
        out[name] = PeftModel.from_pretrained(base(), path).merge_and_unload().eval()
    return out


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model, prompt ids, n): HF's forward with its KV cache, greedy, n tokens."""
    from test_hf_parity import hf_greedy

    return hf_greedy
