"""Argument checks of the offline API (paged.engine.llm.LLM): a prompt, sampling params or a
conversation it cannot run is a TypeError / ValueError naming the argument, before any work."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

from paged.sampling.params import SamplingParams

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
        if isinstance(t, bool) or not isinstance(t, Integral):
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


def check_conversations(convs: list[Any], single: bool) -> None:
    """Each message a dict with a role the server takes and content (only an assistant message
    may leave it out, as on the server); errors name messages[i] (messages[c][i] in a batch)."""
    for c, conv in enumerate(convs):
        where = "messages" if single else f"messages[{c}]"
        if not isinstance(conv, list):
            raise TypeError(f"{where}: expected a list of messages (dicts), got "
                            f"{type(conv).__name__}")  # fmt: skip
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
