"""``paged complete``: text completions from a running server, streamed."""

from __future__ import annotations

import argparse
import sys

from paged.cli.chat import add_client_args, make_client, sampling_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "complete", help="complete prompts with a running server (interactive, or --quick TEXT)"
    )
    add_client_args(p)
    p.set_defaults(func=run)


def stream_completion(client, model: str, prompt: str, **kw) -> str:
    parts = []
    for chunk in client.completions.create(model=model, prompt=prompt, stream=True, **kw):
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            print(chunk.choices[0].text, end="", flush=True)
    print()
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    from openai import OpenAIError

    try:
        client, model = make_client(args)
    except OpenAIError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    kw = sampling_kwargs(args)
    if args.quick is not None:
        try:
            stream_completion(client, model, args.quick, **kw)
        except OpenAIError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    print(f"completing with {model} at {args.url}; Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not prompt:
            continue
        try:
            print(prompt, end="")
            stream_completion(client, model, prompt, **kw)
        except OpenAIError as e:
            print(f"\nerror: {e}", file=sys.stderr)
