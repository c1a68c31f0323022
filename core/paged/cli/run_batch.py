"""``paged run-batch``: an OpenAI batch file (JSONL) run offline through the server's own
request handling, in process (the app without a socket).

Input lines: {"custom_id", "method": "POST", "url", "body"}, `url` one of URLS. Each body is
handled exactly as `paged serve` handles it (the same validation and fields: sampling,
structured outputs, tools, logprobs, a LoRA adapter named by `model`), so a field is honoured or
refused with a 400 naming it, never ignored. Output lines, in input order: {"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}, `body` the JSON the server answers
and `error` {"code", "message"} when the status is 4xx or 5xx. Every line goes to the engine at
once (at most --max-concurrency in flight), so it batches them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
log = logging.getLogger("paged.run_batch")


def register(sub: argparse._SubParsersAction, load: bool = True) -> None:
    p = sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline through the engine"
    )
    p.add_argument("-i", "--input-file", required=True, help="batch JSONL ('-' for stdin)")
    p.add_argument("-o", "--output-file", required=True, help="results JSONL ('-' for stdout)")
    p.add_argument(
        "--max-concurrency",
        type=_positive,
        default=512,
        help="lines in flight at once (the engine batches them; the rest wait their turn)",
    )
    if load:  # the engine flags import torch: only when this command runs
        from paged.config import EngineConfig
        from paged.logs import LOG_LEVELS
        from paged.server.api import add_parsing_args

        p.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
        EngineConfig.add_cli_args(p)
        add_parsing_args(p)
    p.set_defaults(func=run)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


@dataclass
class Item:
    custom_id: Any = None
    url: str = ""
    body: bytes = b""  # the request body, as sent to the app
    status: int = 0
    answer: dict = field(default_factory=dict)  # the JSON body answered
    request_id: str = field(default_factory=lambda: f"paged-batch-{uuid.uuid4().hex}")

    def refuse(self, message: str, param: str | None = None) -> Item:
        from paged.server.errors import error_body

        self.status, self.answer = 400, error_body(400, message, param)
        return self


def parse_line(index: int, line: str) -> Item:
    """A batch line as a request for the app, or refused (400) before it reaches the app."""
    item = Item()
    try:
        req = json.loads(line)
    except json.JSONDecodeError as e:
        return item.refuse(f"line {index + 1} is not valid JSON: {e}")
    if not isinstance(req, dict):
        return item.refuse("each line must be a JSON object")
    item.custom_id = req.get("custom_id")
    if req.get("method", "POST") != "POST":
        return item.refuse(f"method: only POST is supported, not {req.get('method')!r}", "method")
    if req.get("url") not in URLS:
        return item.refuse(f"url: must be one of {', '.join(URLS)}, not {req.get('url')!r}", "url")
    body = req.get("body")
    if not isinstance(body, dict):
        return item.refuse("body: must be a JSON object", "body")
    if body.get("stream"):
        return item.refuse("stream: a batch line cannot stream; leave stream unset", "stream")
    item.url, item.body = req["url"], json.dumps(body).encode()
    return item


def read_input(path: str) -> str:
    """The batch file's text ('-': stdin); a ValueError naming the file, and the line when it
    is not UTF-8, when it cannot be read."""
    name = "stdin" if path == "-" else path
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--input-file: cannot read {name}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"--input-file: {name} line {line} is not UTF-8 (byte "
                         f"0x{data[e.start]:02x}: {e.reason})") from None  # fmt: skip


def output_line(it: Item) -> dict[str, Any]:
    line: dict[str, Any] = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": it.custom_id,
        "response": {"status_code": it.status, "request_id": it.request_id, "body": it.answer},
        "error": None,
    }
    if it.status >= 400:
        err = it.answer.get("error") if isinstance(it.answer, dict) else None
        err = err if isinstance(err, dict) else {}
        kind = "invalid_request_error" if it.status < 500 else "api_error"
        line["error"] = {"code": err.get("type") or kind, "message": err.get("message") or ""}
    return line


async def send_all(app: Any, items: list[Item], concurrency: int) -> None:
    """POST every item not yet answered to the ASGI `app`, at most `concurrency` at once."""
    import httpx
    from tqdm import tqdm

    from paged.server.errors import error_body

    todo = [it for it in items if not it.status]
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(todo), desc="requests", unit="req", disable=None)
    # an exception in the app answers its line 500 (its handler's JSON), as the server does,
    # instead of being raised here and ending the whole batch
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as c:

        async def one(it: Item) -> None:
            try:
                async with gate:
                    headers = {"content-type": "application/json"}
                    r = await c.post(it.url, content=it.body, headers=headers)
                it.status = r.status_code
                try:
                    it.answer = r.json()
                except ValueError:
                    text = r.text[:500] or f"HTTP {r.status_code} without a body"
                    it.answer = {"error": {"message": text, "type": "api_error"}}
            except Exception as e:  # one line's failure must not end the batch
                log.exception("line %r failed", it.custom_id)
                it.status = 500
                it.answer = error_body(500, f"internal error ({type(e).__name__})")
            bar.update()

        await asyncio.gather(*(one(it) for it in todo))
    bar.close()


async def _run(config: Any, args: argparse.Namespace, items: list[Item], faults: Any) -> int:
    from paged.server.app import ServerState, build_app
    from paged.server.metrics import ServerMetrics
    from paged.server.serving_stack import StartError, build_serving

    try:
        serving = build_serving(config, args, faults)
    except StartError as e:
        log.error("%s", e)
        return 1
    engine = serving.engine
    engine.observer = metrics = ServerMetrics(
        serving.model_name, lambda: engine.stats, getattr(engine, "replicas", None)
    )
    engine.start()
    try:
        if not await engine.wait_ready():
            log.error("the engine did not start: %s", engine.dead)
            return 1
        await send_all(build_app(ServerState(serving, metrics)), items, args.max_concurrency)
    finally:
        await engine.shutdown()
    if engine.dead is not None:
        log.error("the engine died: %s", engine.dead)
        return 1
    return 0


def run(args: argparse.Namespace, faults: Any = None) -> int:
    """Exit code 0 once the results are written, 1 if the engine did not start or died (the
    lines it could not finish answer 5xx), 2 for invalid flags, an input file that cannot be
    read or an output file that cannot be written (before the model loads). `faults`: test-only
    fault injection for the engine (paged/engine/faults.py)."""
    from paged.config import EngineConfig
    from paged.logs import configure_logging
    from paged.server.api import run_loop
    from paged.server.serving_stack import parsing_options

    configure_logging(args.log_level)
    try:
        config = EngineConfig.from_cli_args(args)
        parsing_options(args)
    except ValueError as e:
        log.error("invalid configuration: %s", e)
        return 2
    try:
        text = read_input(args.input_file)
        if args.output_file != "-":  # a path we cannot write fails now, not after the run
            open(args.output_file, "a", encoding="utf-8").close()
    except ValueError as e:
        log.error("%s", e)
        return 2
    except OSError as e:
        log.error("--output-file: cannot write %s: %s", args.output_file, e.strerror or e)
        return 2
    items = [parse_line(i, ln) for i, ln in enumerate(text.split("\n")) if ln.strip()]
    rc = run_loop(_run(config, args, items, faults))
    if rc != 0 and not all(it.status for it in items):
        return rc  # nothing to write: the engine never took the lines
    out = "".join(json.dumps(output_line(it), ensure_ascii=False) + "\n" for it in items)
    if args.output_file == "-":
        sys.stdout.write(out)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(out)
    failed = sum(it.status >= 400 for it in items)
    print(
        f"{len(items)} requests: {len(items) - failed} succeeded, {failed} failed; "
        f"results in {args.output_file}",
        file=sys.stderr,
    )
    return rc
