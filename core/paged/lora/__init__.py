"""Multi-LoRA serving: PEFT adapters applied per request on top of the base model's linears.

request.py   LoRARequest (vLLM's shape: name, int id, path)
peft.py      reading and checking a PEFT adapter directory (config + safetensors/.bin)
layers.py    LoRALinear: wraps a model's linear (whatever module is there) with stacked slots
manager.py   the worker's device slots and host cache (LRU), and each step's token lists
See docs/lora.md.
"""

from paged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
