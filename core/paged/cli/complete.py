"""``paged complete``: text completions from a running server, streamed."""

from __future__ import annotations

import argparse
import sys

from paged.cli.client import Session, add_client_args, run_session, stream_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "complete", help="complete prompts with a running server (interactive, or --quick TEXT)"
    )
    add_client_args(p)
    p.set_defaults(func=run)


class CompleteSession(Session):
    banner = "completing with {model} at {url}; Ctrl-D to quit"

    def send(self, text: str) -> None:
        stream = self.client.completions.create(
            model=self.model, prompt=text, stream=True, **self.kw
        )
        stream_text(stream, lambda choice: choice.text)

    def ask(self, text: str) -> None:
        print(text, end="")  # the completion continues the prompt on the same line
        self.send(text)

    def error(self, e: Exception) -> None:
        print(f"\nerror: {e}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    return run_session(args, CompleteSession)
