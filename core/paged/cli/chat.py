"""``paged chat``: an interactive chat with a running server, streaming each reply."""

from __future__ import annotations

import argparse
import os
import sys


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--api-key", default=None, help="API key (default: PAGED_API_KEY or OPENAI_API_KEY)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens per reply")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--quick", metavar="TEXT", default=None, help="send one message, print, exit")


def make_client(args: argparse.Namespace):
    """An openai client for the URL, and the model name to use."""
    from openai import OpenAI

    key = args.api_key or os.environ.get("PAGED_API_KEY") or os.environ.get("OPENAI_API_KEY")
    client = OpenAI(base_url=args.url, api_key=key or "EMPTY", max_retries=0)
    model = args.model or client.models.list().data[0].id
    return client, model


def sampling_kwargs(args: argparse.Namespace) -> dict:
    kw = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {k: v for k, v in kw.items() if v is not None}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running server (interactive, or --quick TEXT)")
    add_client_args(p)
    p.add_argument("--system", default=None, help="a system prompt")
    p.set_defaults(func=run)


def stream_reply(client, model: str, messages: list[dict], **kw) -> str:
    """Stream one assistant reply to stdout; return its text."""
    parts = []
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **kw)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text = chunk.choices[0].delta.content
            parts.append(text)
            print(text, end="", flush=True)
    print()
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    from openai import OpenAIError

    try:
        client, model = make_client(args)
    except OpenAIError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    messages = [{"role": "system", "content": args.system}] if args.system else []
    kw = sampling_kwargs(args)
    if args.quick is not None:
        messages.append({"role": "user", "content": args.quick})
        try:
            stream_reply(client, model, messages, **kw)
        except OpenAIError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    print(f"chatting with {model} at {args.url}; Ctrl-D or 'exit' to quit", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if text.strip() in ("exit", "quit"):
            return 0
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = stream_reply(client, model, messages, **kw)
        except OpenAIError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
