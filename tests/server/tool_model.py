"""A tiny random Qwen2 with the default model's tokenizer and a Qwen2.5-style chat template that
renders tools, tool calls and tool results (and Qwen3's enable_thinking switch)."""

from __future__ import annotations

import os
import random

# The tags are added as ordinary (not special) tokens, as in Qwen's tokenizers: each is one
# token, and skip_special_tokens keeps them in the text.
TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" + (tool | tojson) }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and " }}
{{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
""".strip()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["utc_offset"],
            "additionalProperties": False,
        },
    },
}


def make_tool_model(path: str) -> str:
    """Save the model and its tokenizer (with TAGS and TEMPLATE) to `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from paged.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    tok.add_tokens(TAGS)
    tok.chat_template = TEMPLATE
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    assert os.path.exists(os.path.join(path, "tokenizer_config.json"))
    return path


MODEL_ARGS = [
    "--served-model-name",
    "tiny-qwen",
    "--max-model-len",
    "1024",
    "--kv-cache-memory",
    "32MiB",
    "--dtype",
    "float32",
]


def chunkings(text: str, rounds: int = 25):
    """The text whole, a character at a time, and in random pieces (seeded by the text)."""
    rng = random.Random(text)
    yield [text]
    yield list(text)
    for _ in range(rounds):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
