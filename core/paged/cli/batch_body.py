"""OpenAI request bodies -> engine inputs: SamplingParams, chat messages, prompts.

Used by ``paged run-batch``; every error names the field it is about.
"""

from __future__ import annotations

from typing import Any

from paged.sampling.params import SamplingParams


class BodyError(ValueError):
    pass


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INTS = ("n", "top_k", "seed", "min_tokens")
_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sampling_params(
    body: dict, default_max_tokens: int | None, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """`defaults`: {SamplingParams field: value} for fields the body leaves unset (the
    generation config, paged.engine.generation_config); its max_tokens caps an unset one."""
    defaults = defaults or {}
    if default_max_tokens is None:
        default_max_tokens = defaults.get("max_tokens")
    kw: dict[str, Any] = {k: v for k, v in defaults.items() if k != "max_tokens"}
    for name in _FLOATS:
        v = body.get(name)
        if v is not None:
            if not (_is_int(v) or isinstance(v, float)):
                raise BodyError(f"{name}: must be a number, not {v!r}")
            kw[name] = float(v)
    for name in _INTS:
        v = body.get(name)
        if v is not None:
            if not _is_int(v):
                raise BodyError(f"{name}: must be an integer, not {v!r}")
            kw[name] = v
    for name in _BOOLS:
        v = body.get(name)
        if v is not None:
            if not isinstance(v, bool):
                raise BodyError(f"{name}: must be true or false, not {v!r}")
            kw[name] = v
    mt_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = body.get(mt_name, default_max_tokens)
    if max_tokens is not None and not _is_int(max_tokens):
        raise BodyError(f"{mt_name}: must be an integer, not {max_tokens!r}")
    kw["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BodyError("stop: must be a string or a list of strings")
        kw["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise BodyError("stop_token_ids: must be a list of integers")
        kw["stop_token_ids"] = ids
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in dict(bias).items()}
        except (TypeError, ValueError):
            raise BodyError("logit_bias: must map token ids to numbers") from None
    if body.get("logprobs") not in (None, False):
        raise BodyError("logprobs: not supported by run-batch yet")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise BodyError(str(e).replace("max_tokens", mt_name, 1)) from None


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BodyError("messages: must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BodyError(f"messages[{i}]: must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            try:
                content = "".join(p["text"] for p in content if p.get("type") == "text")
            except (AttributeError, KeyError, TypeError):
                raise BodyError(f"messages[{i}].content: malformed content parts") from None
        if content is not None and not isinstance(content, str):
            raise BodyError(f"messages[{i}].content: must be a string or a list of parts")
        out.append({**m, "content": content or ""})
    return out


def completion_prompts(body: dict) -> list[str | list[int]]:
    """The prompt field as a list of prompts: text or token ids."""
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise BodyError("prompt: must be a string, a list of strings or token ids")
    for q in p:
        ok = (isinstance(q, str) and q) or (
            isinstance(q, list) and q and all(_is_int(t) for t in q)
        )
        if not ok:
            raise BodyError("prompt: each prompt must be a non-empty string or list of token ids")
    return p
