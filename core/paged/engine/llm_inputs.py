"""Argument checks of the offline API (paged.engine.llm.LLM): a prompt, sampling params or a
conversation it cannot run is a TypeError / ValueError naming the argument, before any work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams, is_int

# The roles the server's chat route takes (paged.server.protocol.ChatMessage.role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_prompts(prompts: list[Any]) -> None:
    """TypeError/ValueError naming prompts[i] for a prompt generate() cannot run."""
    for i, p in enumerate(prompts):
        if isinstance(p, dict) and "prompt_token_ids" in p:
            if why := _not_token_ids(p["prompt_token_ids"]):
                raise TypeError(f"prompts[{i}].prompt_token_ids: expected a list of integer "
                                f"token ids, {why}")  # fmt: skip
        elif isinstance(p, dict):
            if not isinstance(p.get("prompt"), str):
                raise ValueError(f"prompts[{i}]: a dict prompt needs 'prompt' (text) or "
                                 f"'prompt_token_ids', got keys {list(p)}")  # fmt: skip
        elif not isinstance(p, str) and (why := _not_token_ids(p)):
            raise TypeError(f"prompts[{i}]: expected a string, a list of integer token ids or a "
                            f"dict with 'prompt' or 'prompt_token_ids', {why}")  # fmt: skip


def _not_token_ids(ids: Any) -> str | None:
    """Why `ids` is not a sequence of token ids ('got dict', '[1] is str'), or None."""
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
        return f"got {type(ids).__name__}"
    for j, t in enumerate(ids):
        if not is_int(t):
            return f"[{j}] is {type(t).__name__} {t!r:.40}"
    return None


def check_sampling_params(params: Any) -> None:
    """TypeError naming sampling_params unless it is SamplingParams, a list of them or None."""
    if params is None or isinstance(params, SamplingParams):
        return
    items = params if isinstance(params, list | tuple) else [params]
    for i, p in enumerate(items):
        if not isinstance(p, SamplingParams):
            where = f"sampling_params[{i}]" if items is params else "sampling_params"
            hint = " (build SamplingParams(**d) from a dict)" if isinstance(p, dict) else ""
            raise TypeError(f"{where}: expected SamplingParams or a list of them, one per "
                            f"prompt, got {type(p).__name__}{hint}")  # fmt: skip


def check_conversations(convs: list[Any], single: bool) -> list[list[dict]]:
    """Each message a dict with a role the server takes and content (only an assistant message
    may leave it out, as on the server); errors name messages[i] (messages[c][i] in a batch).
    Returns the conversations as the template takes them: text parts joined into a string."""
    out = []
    for c, conv in enumerate(convs):
        where = "messages" if single else f"messages[{c}]"
        if not isinstance(conv, list):
            raise TypeError(f"{where}: expected a list of messages (dicts), got "
                            f"{type(conv).__name__}")  # fmt: skip
        if not conv:
            raise ValueError(f"{where}: an empty conversation (expected at least one message)")
        msgs = []
        for i, m in enumerate(conv):
            if not isinstance(m, dict):
                raise TypeError(f"{where}[{i}]: expected a dict with role and content, got "
                                f"{type(m).__name__}")  # fmt: skip
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"{where}[{i}].role: must be one of {', '.join(CHAT_ROLES)}, "
                                 f"got {m.get('role')!r}")  # fmt: skip
            content = m.get("content")
            if content is None and m["role"] != "assistant":
                raise ValueError(f"{where}[{i}].content: missing (a string or a list of parts)")
            if content is not None and not isinstance(content, str | list):
                raise TypeError(f"{where}[{i}].content: expected a string or a list of parts, "
                                f"got {type(content).__name__}")  # fmt: skip
            if isinstance(content, list):  # as the server's ChatMessage.as_template_input
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):  # fmt: skip
                    raise ValueError(f"{where}[{i}].content: only text parts are supported "
                                     f"({{'type': 'text', 'text': ...}})")  # fmt: skip
                m = {**m, "content": "\n".join(p["text"] for p in content)}
            msgs.append(m)
        out.append(msgs)
    return out


def check_tools(tools: Any) -> None:
    """TypeError/ValueError naming tools[i] unless `tools` is None or a list of OpenAI-style
    function tools: {"type": "function", "function": {"name": str, ...}}."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise TypeError(f"tools: expected a list of tool definitions, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': "
                             f"...}}}}, got {t!r:.60}")  # fmt: skip
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}].function: expected a dict with a non-empty 'name', "
                             f"got {f!r:.60}")  # fmt: skip


def check_mapping(value: Any, name: str) -> dict:
    """`value` as a dict (None: empty); TypeError naming `name` unless it is a mapping."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a dict, got {type(value).__name__}")
    return dict(value)


def lora_requests(lora_request: Any, count: int) -> list[Any]:
    """One adapter (or None) per prompt from one for all or a list of them; TypeError naming
    lora_request for anything but LoRARequest / None."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, list | tuple):
        raise TypeError(f"lora_request: expected a LoRARequest, a list of them (one per "
                        f"prompt) or None, got {type(lora_request).__name__}")  # fmt: skip
    for i, r in enumerate(lora_request):
        if r is not None and not isinstance(r, LoRARequest):
            raise TypeError(f"lora_request[{i}]: expected a LoRARequest or None, got "
                            f"{type(r).__name__}")  # fmt: skip
    if len(lora_request) != count:
        raise ValueError("lora_request: one per prompt, or a single one for all")
    return list(lora_request)
