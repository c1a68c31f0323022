"""``paged chat``: an interactive chat with a running server, streaming each reply."""

from __future__ import annotations

import argparse

from paged.cli.client import Session, add_client_args, run_session


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running server (interactive, or --quick TEXT)")
    add_client_args(p)
    p.add_argument("--system", default=None, help="a system prompt")
    p.set_defaults(func=run)


class ChatSession(Session):
    banner = "chatting with {model} at {url}; Ctrl-D or 'exit' to quit"
    quit_words = ("exit", "quit")

    def __init__(self, args: argparse.Namespace, client, model: str) -> None:
        super().__init__(args, client, model)
        self.messages = [{"role": "system", "content": args.system}] if args.system else []

    def send(self, text: str) -> None:
        """Stream the assistant's reply to `text`; keep both in the history, or neither (an
        error, or Ctrl-C cutting the reply short: the turn is dropped)."""
        self.messages.append({"role": "user", "content": text})
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=self.messages, stream=True, **self.kw
            )
            reply = self.stream(stream, lambda choice: choice.delta.content)
        except BaseException:  # KeyboardInterrupt too
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": reply})

    @classmethod
    def skip(cls, text: str) -> bool:
        return not text.strip()


def run(args: argparse.Namespace) -> int:
    return run_session(args, ChatSession)
