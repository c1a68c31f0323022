"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat
machinery (output_blocks.py). Stored responses (store: true, the default) are kept in memory,
the newest `max_stored` of them (least recently used dropped first), with their conversation,
so that previous_response_id can continue it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from paged.engine.async_engine import SeqUpdate
from paged.server.errors import APIError, validation_error
from paged.server.output_blocks import (
    Block,
    BlockStream,
    Event,
    final_update,
    full_blocks,
    hex_id,
    named_sse,
    prepare,
    renamed,
    stream_events,
)
from paged.server.protocol import ChatCompletionRequest
from paged.server.responses_protocol import ResponsesRequest
from paged.server.serving import Prompt, Serving, SSEResponse, Updates, api_error

NAMES = {  # chat's field names (regular expressions) -> this API's
    r"messages": "input",
    r"max_tokens": "max_output_tokens",
    r"response_format\.json_schema\.schema": "text.format.schema",
    r"response_format": "text.format",
    r"tools\[(\d+)\]\.function\.(\w+)": r"tools[\1].\2",
}
ITEM_PREFIX = {"text": "msg", "tool": "fc", "reasoning": "rs"}


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages up to and including this output


class ResponseStore:
    def __init__(self, sv: Serving, max_stored: int) -> None:
        self.sv, self.max_stored = sv, max_stored
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def _find(self, rid: str) -> Stored | None:
        s = self.items.get(rid)
        if s is not None:
            self.items.move_to_end(rid)
        return s

    def get(self, rid: str) -> dict[str, Any]:
        s = self._find(rid)
        if s is None:
            raise APIError(404, f"Response with id '{rid[:100]}' not found.", "response_id")
        return s.response

    def delete(self, rid: str) -> dict[str, Any]:
        if self.items.pop(rid, None) is None:
            raise APIError(404, f"Response with id '{rid[:100]}' not found.", "response_id")
        return {"id": rid, "object": "response", "deleted": True}

    def _keep(self, req: ResponsesRequest, stored: Stored) -> None:
        if req.store and self.max_stored > 0:
            self.items[stored.response["id"]] = stored
            while len(self.items) > self.max_stored:
                self.items.popitem(last=False)

    async def create(self, req: ResponsesRequest) -> dict[str, Any] | SSEResponse:
        sv = self.sv
        sv.check_model(req.model, req.user)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self._find(req.previous_response_id)
            if prev is None:
                msg = f"Previous response with id '{req.previous_response_id[:100]}' not found."
                raise APIError(400, msg, "previous_response_id", "previous_response_not_found")
            history = prev.conversation
        conversation = history + req.input_messages()
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            chat = ChatCompletionRequest(messages=system + conversation, **req.chat_fields())
        except ValidationError as e:  # as a request body's errors, in this API's names
            raise renamed(validation_error(RequestValidationError(e.errors())), NAMES) from None
        prompt, parsing = await prepare(sv, chat, NAMES)
        r = Run(sv, req, hex_id("resp"), conversation)
        if req.stream:  # the engine's first update in: its refusal is a 4xx, not an event
            updates = await sv.stream(r.rid, [prompt])
            blocks = BlockStream(parsing, "call")
            return SSEResponse(self._stream(r, prompt, blocks, updates))
        u, cached = await final_update(sv, r.rid, prompt)
        blocks, _ = full_blocks(parsing, u.state.out.text, "call")
        done = r.response(u, [r.item(i, b, u) for i, b in enumerate(blocks)], prompt, cached)
        self._keep(req, Stored(done, r.conversation_after(blocks)))
        return done

    async def _stream(
        self, r: Run, prompt: Prompt, blocks: BlockStream, updates: Updates | None = None
    ) -> AsyncIterator[str]:
        """`updates`: Serving.stream's (default: generated here)."""
        yield r.event("response.created", {"response": r.response(None, [], prompt, 0)})
        yield r.event("response.in_progress", {"response": r.response(None, [], prompt, 0)})
        items: list[dict[str, Any]] = []
        try:
            async for events, u in stream_events(r.sv, r.rid, prompt, blocks, updates):
                for e in events:
                    for ev in r.block_events(e, u if u.state.finished else None):
                        yield ev
                    if e.what == "close":
                        items.append(r.item(e.index, e.block, u))
                if u.state.finished:
                    done = r.response(u, items, prompt, u.output.num_cached_tokens)
                    self._keep(r.req, Stored(done, r.conversation_after(blocks.blocks)))
                    kind = "completed" if done["status"] == "completed" else "incomplete"
                    yield r.event(f"response.{kind}", {"response": done})
        except Exception as e:
            err = api_error(e)
            yield r.event("error", {"code": err.code, "message": err.message, "param": err.param})


class Run:
    """One response being made: its id, output item ids, response object and events."""

    def __init__(self, sv: Serving, req: ResponsesRequest, rid: str, conv: list[dict]) -> None:
        self.sv, self.req, self.rid, self.conversation = sv, req, rid, conv
        self.created = int(time.time())
        self.ids: dict[int, str] = {}  # block index -> output item id
        self.seq = 0

    def item_id(self, index: int, b: Block) -> str:
        return self.ids.setdefault(index, hex_id(ITEM_PREFIX[b.kind]))

    def item(self, index: int, b: Block, u: SeqUpdate | None, empty: bool = False) -> dict:
        """An output item; `u` None: still in progress; `empty`: as first announced."""
        status = "in_progress" if u is None else _status(u)
        iid = self.item_id(index, b)
        if b.kind == "tool":
            return {
                "type": "function_call",
                "id": iid,
                "call_id": b.call_id,
                "name": b.name,
                "arguments": "" if empty else b.text,
                "status": status,
            }
        if b.kind == "reasoning":
            content = [] if empty else [{"type": "reasoning_text", "text": b.text}]
            return {
                "type": "reasoning",
                "id": iid,
                "summary": [],
                "content": content,
                "status": status,
            }
        content = [] if empty else [_text_part(b.text)]
        return {
            "type": "message",
            "id": iid,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(
        self, u: SeqUpdate | None, output: list[dict], prompt: Prompt, cached: int
    ) -> dict[str, Any]:
        req, n_prompt = self.req, len(prompt.ids)
        status = "in_progress" if u is None else _status(u)
        n_out = len(u.state.out.token_ids) if u is not None else 0
        fmt = req.text.format if req.text and req.text.format else None
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice or ("auto" if tools else "none")
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.sv.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            # what the sampler uses (the request's, else the generation config's, else 1.0)
            "temperature": prompt.params.temperature,
            "text": {
                "format": fmt.model_dump(exclude_none=True, by_alias=True)
                if fmt
                else {"type": "text"}
            },
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": tools,
            "top_p": prompt.params.top_p,
            "truncation": "disabled",
            "usage": None
            if u is None
            else {
                "input_tokens": n_prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_prompt + n_out,
            },
            "user": req.user,
        }

    def conversation_after(self, blocks: list[Block]) -> list[dict[str, Any]]:
        """The conversation with this output as an assistant turn."""
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        for b in blocks:
            if b.kind == "text":
                turn["content"] += b.text
            elif b.kind == "reasoning":
                turn["reasoning_content"] = turn.get("reasoning_content", "") + b.text
            else:
                call = {
                    "id": b.call_id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": b.text},
                }
                turn.setdefault("tool_calls", []).append(call)
        return [*self.conversation, turn]

    def event(self, kind: str, body: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.seq} | body
        self.seq += 1
        return named_sse(kind, data)

    def block_events(self, e: Event, u: SeqUpdate | None) -> list[str]:
        """The events of one block event (u: the final update, when this is the last one)."""
        b, i = e.block, e.index
        iid = self.item_id(i, b)
        at = {"item_id": iid, "output_index": i}
        if e.what == "open":
            out = [
                self.event(
                    "response.output_item.added",
                    {"output_index": i, "item": self.item(i, b, None, True)},
                )
            ]
            if b.kind != "tool":
                part = (
                    _text_part("") if b.kind == "text" else {"type": "reasoning_text", "text": ""}
                )
                out.append(
                    self.event(
                        "response.content_part.added", at | {"content_index": 0, "part": part}
                    )
                )
            return out
        kind = {"text": "output_text", "reasoning": "reasoning_text"}.get(b.kind)
        if e.what == "delta":
            if kind is None:
                return [
                    self.event("response.function_call_arguments.delta", at | {"delta": e.delta})
                ]
            extra = {"logprobs": []} if b.kind == "text" else {}
            return [
                self.event(
                    f"response.{kind}.delta", at | {"content_index": 0, "delta": e.delta} | extra
                )
            ]
        item = (
            self.item(i, b, u) if u is not None else self.item(i, b, None) | {"status": "completed"}
        )
        if kind is None:
            out = [
                self.event(
                    "response.function_call_arguments.done",
                    at | {"name": b.name, "arguments": b.text},
                )
            ]
        else:
            extra = {"logprobs": []} if b.kind == "text" else {}
            part = item["content"][0]
            out = [
                self.event(
                    f"response.{kind}.done", at | {"content_index": 0, "text": b.text} | extra
                ),
                self.event("response.content_part.done", at | {"content_index": 0, "part": part}),
            ]
        out.append(self.event("response.output_item.done", {"output_index": i, "item": item}))
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(u: SeqUpdate) -> str:
    return "incomplete" if u.state.out.finish_reason == "length" else "completed"
