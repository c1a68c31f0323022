"""``paged complete``: text completions from a running server, streamed."""

from __future__ import annotations

import argparse
import sys

from paged.cli.client import Session, add_client_args, is_terminal, run_session


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
        self.stream(stream, lambda choice: choice.text)

    def ask(self, text: str) -> None:
        if is_terminal(sys.stdin):  # the completion continues the prompt on its line; piped
            print(text, end="", flush=True)  # input gets only the completions, as --quick
            self.line_open = True
        self.send(text)


def run(args: argparse.Namespace) -> int:
    return run_session(args, CompleteSession)
