"""What ``paged chat`` and ``paged complete`` share: the client flags, the connection, the
streaming of one answer to stdout, and the session loop (``--quick TEXT`` or interactive).
Each command supplies a `Session` that says what one line of input does."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any


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


def stream_text(chunks: Iterable, text_of: Callable[[Any], str | None]) -> str:
    """Print the text of each streamed chunk's first choice as it comes, then a newline;
    return the whole text."""
    parts = []
    for chunk in chunks:
        text = text_of(chunk.choices[0]) if chunk.choices else None
        if text:
            parts.append(text)
            print(text, end="", flush=True)
    print()
    return "".join(parts)


class Session:
    """One command's conversation with the server; the methods raise OpenAIError."""

    banner = "talking to {model} at {url}; Ctrl-D to quit"  # {model} and {url} filled in
    quit_words: tuple[str, ...] = ()  # input lines (stripped) that end the session

    def __init__(self, args: argparse.Namespace, client, model: str) -> None:
        self.args, self.client, self.model = args, client, model
        self.kw = sampling_kwargs(args)

    def send(self, text: str) -> None:
        """Stream the answer to `text` (--quick, and each interactive line by default)."""
        raise NotImplementedError

    def ask(self, text: str) -> None:
        """One interactive line."""
        self.send(text)

    def skip(self, text: str) -> bool:
        """Interactive lines that send nothing."""
        return not text

    def error(self, e: Exception) -> None:
        """Report a failed interactive line; the session goes on."""
        print(f"error: {e}", file=sys.stderr)


def run_session(args: argparse.Namespace, session_cls: type[Session]) -> int:
    """Connect, then send --quick TEXT and exit, or read lines until EOF or a quit word."""
    from openai import OpenAIError

    try:
        client, model = make_client(args)
    except OpenAIError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    session = session_cls(args, client, model)
    if args.quick is not None:
        try:
            session.send(args.quick)
        except OpenAIError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    print(session.banner.format(model=model, url=args.url), file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if text.strip() in session.quit_words:
            return 0
        if session.skip(text):
            continue
        try:
            session.ask(text)
        except OpenAIError as e:
            session.error(e)
