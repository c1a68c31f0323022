"""``paged run-batch``: an OpenAI batch file run offline through the ``LLM`` class.

Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}. Output lines: {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}, in input order. A bad line gets an error entry; the rest still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from paged.cli.batch_body import BodyError, chat_messages, completion_prompts, sampling_params

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def register(sub: argparse._SubParsersAction, load: bool = True) -> None:
    p = sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline through the engine"
    )
    p.add_argument("-i", "--input-file", required=True, help="batch JSONL ('-' for stdin)")
    p.add_argument("-o", "--output-file", required=True, help="results JSONL ('-' for stdout)")
    if load:  # the engine flags import torch: only when this command runs
        from paged.config import EngineConfig

        EngineConfig.add_cli_args(p)
    p.set_defaults(func=run)


@dataclass
class Item:
    index: int
    custom_id: str | None = None
    kind: str = ""
    body: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)  # chat: [messages]; completion: prompts
    params: Any = None
    result: dict | None = None  # the response body once it ran
    error: tuple[int, str] | None = None  # (status code, message)


def parse_line(index: int, line: str, defaults: dict[str, Any] | None = None) -> Item:
    """`defaults`: the generation config's sampling defaults (--generation-config)."""
    item = Item(index)
    try:
        req = json.loads(line)
        if not isinstance(req, dict):
            raise BodyError("each line must be a JSON object")
        item.custom_id = req.get("custom_id")
        if req.get("method", "POST") != "POST":
            raise BodyError(f"method: only POST is supported, not {req.get('method')!r}")
        if req.get("url") not in URLS:
            raise BodyError(f"url: must be one of {', '.join(URLS)}, not {req.get('url')!r}")
        item.kind, item.body = URLS[req["url"]], req.get("body")
        if not isinstance(item.body, dict):
            raise BodyError("body: must be a JSON object")
        if item.kind == "chat":
            item.inputs = [chat_messages(item.body)]
        else:
            item.inputs = completion_prompts(item.body)
        item.params = sampling_params(
            item.body, 16 if item.kind == "completion" else None, defaults
        )
    except json.JSONDecodeError as e:
        item.error = (400, f"line {index + 1} is not valid JSON: {e}")
    except (BodyError, ValueError, TypeError) as e:
        item.error = (400, str(e))
    return item


def _ids(prompt: str | list[int]) -> str | dict:
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def _execute(llm, items: list[Item], use_tqdm: bool) -> list:
    """All items of one kind in one engine call: one RequestOutput per input."""
    if not items:
        return []
    params = [it.params for it in items for _ in it.inputs]
    if items[0].kind == "chat":
        return llm.chat([it.inputs[0] for it in items], params, use_tqdm=use_tqdm)
    prompts = [_ids(p) for it in items for p in it.inputs]
    return llm.generate(prompts, params, use_tqdm=use_tqdm)


def _abort_all(llm) -> None:
    """Drop requests a failed call may have left in the engine before the next call."""
    llm.engine.abort(list(llm.engine.requests))


def run_items(llm, items: list[Item], model: str) -> None:
    """Run the valid items batched per kind; when a batch fails, one at a time to isolate."""
    for kind in ("chat", "completion"):
        todo = [it for it in items if it.error is None and it.kind == kind]
        if kind == "chat" and llm.tokenizer is None:
            for it in todo:
                it.error = (400, "messages: this model has no tokenizer, so no chat template")
            continue
        try:
            groups = [(todo, _execute(llm, todo, use_tqdm=True))]
        except Exception:
            _abort_all(llm)
            groups = []
            for it in todo:
                try:
                    groups.append(([it], _execute(llm, [it], use_tqdm=False)))
                except Exception as e:  # a request that breaks the engine must not stop us
                    _abort_all(llm)
                    bad_input = isinstance(e, ValueError)
                    it.error = (400, str(e)) if bad_input else (500, f"{type(e).__name__}: {e}")
        for group, outs in groups:
            pos = 0
            for it in group:
                mine = outs[pos : pos + len(it.inputs)]
                pos += len(it.inputs)
                it.result = response_body(llm, it, mine, model)


def response_body(llm, it: Item, outs: list, model: str) -> dict:
    choices = []
    n = it.params.n
    for i, out in enumerate(outs):
        for c in out.outputs:
            choice: dict[str, Any] = {"index": i * n + c.index, "logprobs": None}
            if it.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                prefix = ""
                if it.body.get("echo"):
                    prefix = out.prompt
                    if prefix is None and llm.tokenizer is not None:
                        prefix = llm.tokenizer.decode(out.prompt_token_ids)
                choice["text"] = (prefix or "") + c.text
            choice["finish_reason"] = c.finish_reason
            choices.append(choice)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    chat = it.kind == "chat"
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
        },
    }


def output_line(it: Item) -> dict:
    rid = f"paged-batch-{uuid.uuid4().hex}"
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": it.custom_id}
    if it.error is None:
        line["response"] = {"status_code": 200, "request_id": rid, "body": it.result}
        line["error"] = None
        return line
    status, msg = it.error
    err_type = "invalid_request_error" if status < 500 else "internal_error"
    body = {"error": {"message": msg, "type": err_type, "param": None, "code": status}}
    line["response"] = {"status_code": status, "request_id": rid, "body": body}
    line["error"] = {"code": err_type, "message": msg}
    return line


def model_name(llm) -> str:
    src = llm.engine.source
    return llm.config.served_model_name or (src.name if src else llm.config.model) or "default"


def run(args: argparse.Namespace) -> int:
    from paged.config import EngineConfig
    from paged.engine.generation_config import generation_defaults
    from paged.engine.llm import LLM

    if args.input_file == "-":
        text = sys.stdin.read()
    else:
        with open(args.input_file, encoding="utf-8") as f:
            text = f.read()
    lines = [(i, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    config = EngineConfig.from_cli_args(args)
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(config.model, **kwargs)
    src = llm.engine.source
    defaults = generation_defaults(
        config.generation_config, src.path if src else None, config.override_generation_config
    )
    items = [parse_line(i, ln, defaults) for i, ln in lines]
    run_items(llm, items, model_name(llm))
    text = "".join(json.dumps(output_line(it), ensure_ascii=False) + "\n" for it in items)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    failed = sum(it.error is not None for it in items)
    print(
        f"{len(items)} requests: {len(items) - failed} succeeded, {failed} failed; "
        f"results in {args.output_file}",
        file=sys.stderr,
    )
    return 0
