"""``paged`` entry point: argparse subcommands, each defined in its own small module.

Command modules import nothing heavy at module level, so ``paged --help`` stays fast: the
server package and the engine flags (which import torch) load only for the command being run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from paged import __version__
from paged.cli import (
    bench_offline,
    bench_serve,
    cache,
    chat,
    complete,
    env,
    fleet,
    models,
    platforms,
    run_batch,
)

SERVE_HELP = "serve a model over an OpenAI-compatible HTTP API"


def _add_serve(sub: argparse._SubParsersAction, load: bool) -> None:
    p = sub.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    if not load:  # only `paged serve ...` pays for importing the server
        return
    try:
        from paged.server.api import add_serve_args, serve_main
    except ImportError as e:  # e.g. the server's dependencies are missing
        msg = f"paged serve is unavailable: {e}"
        p.set_defaults(func=lambda _: _fail(msg))
        return
    add_serve_args(p)
    p.set_defaults(func=serve_main)


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged", description="paged: an LLM inference and serving engine."
    )
    parser.add_argument("--version", action="version", version=f"paged {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub, load=argv[:1] == ["serve"])
    chat.register(sub)
    complete.register(sub)
    run_batch.register(sub, load=argv[:1] == ["run-batch"])
    bench = sub.add_parser(
        "bench", help="benchmarks: serve (online load), throughput and latency (offline)"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_serve.register(bench_sub)
    bench_offline.register(bench_sub, load=argv[:1] == ["bench"])
    bench.set_defaults(func=lambda _: bench.print_help() or 2)
    platforms.register(sub)
    models.register(sub)
    env.register(sub)
    cache.register(sub)
    fleet.register(sub)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The innermost (sub)parser the command line chose: `paged bench serve`'s for
    `paged bench serve ...`."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command given (`paged chat: error: ...`), with its usage
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    args._argv = argv  # the command line as given (bench results record it)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from paged.plugins import NoPlatformError

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, NoPlatformError) as e:  # bad input: a message, no traceback
        return _fail(str(e) or type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())
