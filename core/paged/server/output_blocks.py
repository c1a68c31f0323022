"""What the Anthropic Messages and OpenAI Responses APIs share: a request is translated into a
ChatCompletionRequest and prepared as chat is (template, tool choice, reasoning parser); the
output is an ordered list of blocks (reasoning, text, tool calls) rather than one message."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from paged.engine.async_engine import SeqUpdate
from paged.server.chat_parsing import ChatParsing, ChatStreamer
from paged.server.errors import APIError
from paged.server.protocol import ChatCompletionRequest
from paged.server.serving import Prompt, Serving, Updates, api_error, constraint_field
from paged.server.serving_chat import _adjust


def hex_id(prefix: str) -> str:
    """Ids as Anthropic and OpenAI spell them: msg_..., toolu_..., resp_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def named_sse(kind: str, data: dict[str, Any]) -> str:
    """A server-sent event with an event name (Anthropic's and the Responses API's framing)."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _match(param: str, names: dict[str, str]) -> tuple[re.Match, str] | None:
    """The start of chat's field name `param` that `names` renames, and its new name."""
    for pattern, name in names.items():
        m = re.match(pattern + r"(?=$|[.\[])", param)
        if m:
            return m, m.expand(name)
    return None


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """The error with chat's field names (max_tokens, messages, ...) as this API spells them:
    `names` maps a regular expression matching the start of chat's name to this API's."""
    found = _match(e.param or "", names)
    if found is None:
        return e
    m, name = found
    param = name + e.param[m.end() :]
    message = e.message.replace(m.group(0), name, 1)
    return APIError(e.status, message, param, e.code, e.type)


def renamed_field(param: str | None, names: dict[str, str]) -> str | None:
    """Chat's field name as this API spells it."""
    found = _match(param or "", names)
    if param is None or found is None:
        return param
    m, name = found
    return name + param[m.end() :]


async def prepare(
    sv: Serving, req: ChatCompletionRequest, names: dict[str, str]
) -> tuple[Prompt, ChatParsing]:
    """The fitted prompt and the output parsing of a translated request, as chat prepares
    them; errors name the fields as `names` maps chat's spellings."""
    try:
        params = sv.params(req, req.max_tokens)
        text, ids = await sv.render_chat(
            req.messages, req.add_generation_prompt, req.tool_dicts(), req.template_kwargs()
        )
        parsing = ChatParsing(sv.parsing, req, text)
        params = _adjust(sv, req, parsing, params)
        constraint = renamed_field(constraint_field(req, params), names)
        return sv.fit(text, ids, params, "messages", constraint), parsing
    except APIError as e:
        raise renamed(e, names) from None


@dataclass
class Block:
    kind: str  # "reasoning", "text" or "tool"
    text: str = ""  # a tool's arguments (JSON text)
    name: str = ""  # tool
    call_id: str = ""  # tool

    def tool_input(self) -> Any:
        """The arguments parsed (a call cut short: its text as it is)."""
        try:
            return json.loads(self.text or "{}")
        except ValueError:
            return self.text


def full_blocks(parsing: ChatParsing, text: str, call_prefix: str) -> tuple[list[Block], bool]:
    """The non-streamed output as blocks (reasoning, text, calls; empty ones left out), and
    whether it holds calls."""
    if not parsing.active:
        return ([Block("text", text)] if text else []), False
    msg, called = parsing.message(text)
    blocks = []
    if msg.get("reasoning_content"):
        blocks.append(Block("reasoning", msg["reasoning_content"]))
    if msg.get("content"):
        blocks.append(Block("text", msg["content"]))
    for c in msg.get("tool_calls", []):
        f = c["function"]
        blocks.append(Block("tool", f["arguments"], f["name"], hex_id(call_prefix)))
    return blocks, called


@dataclass
class Event:
    what: str  # "open", "delta" or "close"
    index: int  # the block's position in the output
    block: Block
    delta: str = ""


@dataclass
class BlockStream:
    """Chat stream deltas (content, reasoning_content, tool_calls) in, block events out: a
    block opens when output of another kind (or another call) starts and closes the one
    before."""

    parsing: ChatParsing
    call_prefix: str
    blocks: list[Block] = field(default_factory=list)
    streamer: ChatStreamer | None = None
    open: bool = False
    calls: dict[int, int] = field(default_factory=dict)  # call index -> block index

    def __post_init__(self) -> None:
        self.streamer = self.parsing.streamer() if self.parsing.active else None

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool) -> list[Event]:
        body = self.streamer.feed(delta, final) if self.streamer else {"content": delta}
        events: list[Event] = []
        if body.get("reasoning_content"):
            self._add(events, "reasoning", body["reasoning_content"])
        if body.get("content"):
            self._add(events, "text", body["content"])
        for c in body.get("tool_calls", []):
            f = c.get("function", {})
            if "id" in c:  # a new call
                self._close(events)
                b = Block("tool", "", f["name"], hex_id(self.call_prefix))
                self.calls[c["index"]] = len(self.blocks)
                self.blocks.append(b)
                self.open = True
                events.append(Event("open", len(self.blocks) - 1, b))
            if f.get("arguments"):
                i = self.calls[c["index"]]
                self.blocks[i].text += f["arguments"]
                events.append(Event("delta", i, self.blocks[i], f["arguments"]))
        if final:
            self._close(events)
        return events

    def _add(self, events: list[Event], kind: str, piece: str) -> None:
        if not (self.open and self.blocks[-1].kind == kind):
            self._close(events)
            self.blocks.append(Block(kind))
            self.open = True
            events.append(Event("open", len(self.blocks) - 1, self.blocks[-1]))
        self.blocks[-1].text += piece
        events.append(Event("delta", len(self.blocks) - 1, self.blocks[-1], piece))

    def _close(self, events: list[Event]) -> None:
        if self.open:
            events.append(Event("close", len(self.blocks) - 1, self.blocks[-1]))
            self.open = False


async def final_update(sv: Serving, rid: str, prompt: Prompt) -> tuple[SeqUpdate, int]:
    """Generate to the end: the last update and the prompt's cached tokens."""
    last, cached = None, 0
    try:
        async for _, u in sv.generate(rid, [prompt]):
            last, cached = u, max(cached, u.output.num_cached_tokens)
    except Exception as e:
        raise api_error(e) from None
    assert last is not None
    return last, cached


async def stream_events(
    sv: Serving, rid: str, prompt: Prompt, blocks: BlockStream, updates: Updates | None = None
) -> AsyncIterator[tuple[list[Event], SeqUpdate]]:
    """Each update's block events (the last update closes the open block). `updates`:
    Serving.stream's (default: generated here)."""
    async for _, u in updates or sv.generate(rid, [prompt]):
        yield blocks.feed(u.state.text_delta(), u.state.finished), u
