"""What ``paged chat`` and ``paged complete`` share: the client flags, the connection, the
streaming of one answer to stdout, and the session loop (``--quick TEXT`` or interactive).
Each command supplies a `Session` that says what one line of input does.

Interactive use follows Ollama's and llama.cpp's clients: line editing and history (readline)
at a terminal; Ctrl-C during a reply stops it (the stream is closed, so the server aborts the
request) and the prompt comes back, Ctrl-C or Ctrl-D at the prompt ends the session. With
stdin not a terminal (piped lines) no prompt is printed: stdout holds only the answers."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--api-key", default=None, help="API key (default: PAGED_API_KEY or OPENAI_API_KEY)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens per reply")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--quick", metavar="TEXT", default=None, help="send one message, print, exit")


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("PAGED_API_KEY") or os.environ.get("OPENAI_API_KEY")


def make_client(args: argparse.Namespace):
    """An openai client for the URL, and the model name to use."""
    from openai import OpenAI, OpenAIError

    client = OpenAI(base_url=args.url, api_key=api_key(args) or "EMPTY", max_retries=0)
    if args.model:
        return client, args.model
    models = client.models.list().data
    if not models:
        raise OpenAIError(f"{args.url}/models lists no model; give one with --model")
    return client, models[0].id


def missing_v1(url: str) -> bool:
    return not urlsplit(url).path.rstrip("/").endswith("/v1")


def error_message(e: Exception, args: argparse.Namespace) -> str:
    """One line for a failed request: the server unreachable, the API key refused (the server
    was reached), a 404 from a URL without /v1, else the status and the server's message."""
    from openai import APIConnectionError, APIStatusError

    url = args.url
    if isinstance(e, APIConnectionError):  # also timeouts
        return f"cannot reach {url}: {str(e.__cause__ or '') or e}"
    if not isinstance(e, APIStatusError):
        return str(e)
    body, status = e.body, e.status_code
    msg = body.get("message") if isinstance(body, dict) else body
    msg = str(msg or e.response.reason_phrase or "").strip().splitlines()[:1]
    msg = msg[0][:300] if msg else ""
    if status == 401:
        if not api_key(args):
            return f"{url} needs an API key: give it with --api-key or PAGED_API_KEY"
        return f"{url} refused the API key: {msg}"
    if status == 404 and missing_v1(url):
        return f"{url} answered 404 ({msg}): is the URL missing /v1? (try {url.rstrip('/')}/v1)"
    return f"the server answered {status}: {msg}"


class Session:
    """One command's conversation with the server; the methods raise OpenAIError."""

    banner = "talking to {model} at {url}; Ctrl-D to quit"  # {model} and {url} filled in
    quit_words: tuple[str, ...] = ()  # input lines (stripped) that end the session
    line_open = False  # stdout holds an unfinished line (a reply cut short, an echoed prompt)

    def __init__(self, args: argparse.Namespace, client, model: str) -> None:
        self.args, self.client, self.model = args, client, model
        self.kw = sampling_kwargs(args)

    def send(self, text: str) -> None:
        """Stream the answer to `text` (--quick, and each interactive line by default)."""
        raise NotImplementedError

    def ask(self, text: str) -> None:
        """One interactive line."""
        self.send(text)

    @classmethod
    def skip(cls, text: str) -> bool:
        """Lines that send nothing (interactive: ignored; --quick: refused)."""
        return not text

    def stream(self, chunks: Iterable, text_of: Callable[[Any], str | None]) -> str:
        """Print the text of each streamed chunk's first choice as it comes, then a newline;
        return the whole text. However it ends (Ctrl-C, an error) the stream is closed: the
        server sees the client go and aborts the request."""
        parts = []
        try:
            for chunk in chunks:
                text = text_of(chunk.choices[0]) if chunk.choices else None
                if text:
                    parts.append(text)
                    self.line_open = True
                    print(text, end="", flush=True)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        self.end_line(always=True)
        return "".join(parts)

    def end_line(self, always: bool = False) -> None:
        """End stdout's unfinished line (or, with `always`, print a newline)."""
        if always or self.line_open:
            print(flush=True)
        self.line_open = False

    def error(self, e: Exception) -> None:
        """Report a failed interactive line; the session goes on."""
        self.end_line()
        print(f"error: {error_message(e, self.args)}", file=sys.stderr)


def sampling_kwargs(args: argparse.Namespace) -> dict:
    kw = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {k: v for k, v in kw.items() if v is not None}


def read_line(prompt: str) -> str:
    """One input line; the prompt only at a terminal (on stderr when stdout is not one, so
    that redirected answers hold no prompts)."""
    if not is_terminal(sys.stdin):
        return input()
    if is_terminal(sys.stdout):
        return input(prompt)  # readline knows the prompt: editing redraws it
    print(prompt, end="", file=sys.stderr, flush=True)
    return input()


def is_terminal(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _line_editing() -> None:
    """Arrow keys, history and the rest of readline for input(), where the platform has it."""
    try:
        import readline  # noqa: F401  (importing it is what turns it on for input())
    except ImportError:  # e.g. Windows without pyreadline
        pass


def run_session(args: argparse.Namespace, session_cls: type[Session]) -> int:
    """Connect, then send --quick TEXT and exit, or read lines until EOF or a quit word."""
    from openai import OpenAIError

    if args.quick is not None and session_cls.skip(args.quick):
        print("error: --quick: the text is empty; give something to send", file=sys.stderr)
        return 2
    try:
        client, model = make_client(args)
    except OpenAIError as e:
        print(f"error: {error_message(e, args)}", file=sys.stderr)
        return 1
    session = session_cls(args, client, model)
    if args.quick is not None:
        try:
            session.send(args.quick)
        except OpenAIError as e:
            session.error(e)
            return 1
        except KeyboardInterrupt:
            session.end_line(always=True)
            return 130
        return 0
    if is_terminal(sys.stdin):
        _line_editing()
    print(session.banner.format(model=model, url=args.url), file=sys.stderr)
    while True:
        try:
            text = read_line("> ")
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the session ends
            print(file=sys.stderr)
            return 130
        if text.strip() in session.quit_words:
            return 0
        if session.skip(text):
            continue
        try:
            session.ask(text)
        except OpenAIError as e:
            session.error(e)
        except KeyboardInterrupt:  # Ctrl-C during a reply: stop it, back to the prompt
            session.end_line(always=True)
