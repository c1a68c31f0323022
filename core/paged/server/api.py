"""Entry points for `paged serve`: add_serve_args(parser) and serve_main(args) -> exit code."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from paged.config import EngineConfig, parse_bytes
from paged.engine.gc_pauses import freeze_startup_objects
from paged.logs import LOG_LEVELS, configure_logging
from paged.server.http_options import add_http_args, check_http_args, scheme, uvicorn_options
from paged.server.metrics import PREFIXES
from paged.server.request_log import add_log_args, check_log_args
from paged.server.tracing import add_tracing_args

if TYPE_CHECKING:
    from paged.engine.faults import Faults

log = logging.getLogger("paged.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig flag (from the config class itself) plus the server's own."""
    EngineConfig.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--fleet",
        metavar="FLEET.yaml",
        default=None,
        help="serve replica groups on several platforms, named in this file (docs/fleet.md); "
        "the flags here apply to every replica unless the file says otherwise",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="with --fleet: place each replica as a Ray actor on a node of this cluster that "
        "advertises its platform (an address, or auto; also RAY_ADDRESS; docs/fleet.md)",
    )
    g.add_argument(
        "--router",
        choices=["prefix", "least-load", "round-robin"],
        default="prefix",
        help="how requests are spread over replicas (--data-parallel-size, --fleet): prefix "
        "(shortest expected wait, minus the prefill a replica's cached prefix saves), "
        "least-load (least outstanding tokens) or round-robin (default: %(default)s)",
    )
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API (also PAGED_API_KEY)",
    )
    g.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="with an API key, /metrics needs it too (/health stays open for probes)",
    )
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: info)")
    g.add_argument(
        "--max-request-body",
        type=parse_bytes,
        default=8 << 20,
        help="largest request body accepted, e.g. 8MiB (default); larger ones get 413",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="most characters of text tokenized for one request; longer prompts get 400 "
        "before any work (default: 32 per token of --max-model-len)",
    )
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=15.0,
        help="seconds a connection may stay open without sending a complete request head, "
        "after connecting or after its last response (default: %(default)s)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a whole request body; slower uploads get 408 "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        default=5.0,
        help="/health answers 503 once the engine core has been silent this many seconds "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: %(default)s)",
    )
    g.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="/v1/responses kept in memory for previous_response_id and GET (the least "
        "recently used dropped first; 0: none kept) (default: %(default)s)",
    )
    g.add_argument(
        "--metrics-prefix",
        choices=PREFIXES,
        default="both",
        help="/metrics names: paged:, vllm: (vLLM's, for its dashboards) or both (default)",
    )
    add_parsing_args(parser)
    add_http_args(parser)
    add_log_args(parser)
    add_tracing_args(parser)


def check_server_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag when a server flag is out of range (not read as a default)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port: must be in [0, 65535] (0: any free port), got {args.port}")
    for name in ("idle_timeout", "body_timeout", "health_timeout"):
        if not getattr(args, name) > 0:  # NaN too
            raise ValueError(f"{name}: must be > 0 seconds, got {getattr(args, name)}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_request_body < 1:
        raise ValueError(f"max_request_body: must be at least 1 byte, got {args.max_request_body}")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ValueError(f"max_prompt_chars: must be at least 1 (leave it unset for the "
                         f"default), got {args.max_prompt_chars}")  # fmt: skip
    if args.max_stored_responses < 0:
        raise ValueError(f"max_stored_responses: must be >= 0 (0: none kept), got "
                         f"{args.max_stored_responses}")  # fmt: skip
    key = getattr(args, "api_key", None)
    if key == "":  # vLLM reads it as no key: refused, not served open
        raise ValueError("api_key: empty; give a key, or leave --api-key out to serve openly")
    if getattr(args, "metrics_require_key", False) and not (key or os.environ.get("PAGED_API_KEY")):
        raise ValueError("metrics_require_key: needs an API key (--api-key or PAGED_API_KEY)")


def add_parsing_args(parser: argparse.ArgumentParser) -> None:
    """Tool calling and reasoning (docs/tools.md), in vLLM's spellings."""
    from paged.server.reasoning import REASONING_PARSERS
    from paged.server.tool_parsers import TOOL_PARSERS

    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default when a '
        "request has tools); needs --tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls: hermes (<tool_call> JSON: Qwen2.5, Qwen3, "
        "Hermes, SmolLM), llama3_json (Llama 3.x), mistral ([TOOL_CALLS]), pythonic ([f(a=1)]: "
        "Llama 3.2, Llama 4), qwen3_coder (<function=...> XML: Qwen3-Coder), phi4_mini_json "
        "(functools[...]: Phi-4-mini)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think> reasoning into reasoning_content: deepseek_r1 (the output starts "
        "in the reasoning) or qwen3 (<think> blocks)",
    )


def serve_main(args: argparse.Namespace, faults: Faults | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (0) or until the engine dies (1). `faults`: test-only
    fault injection for the engine (tests/fault_server.py)."""
    configure_logging(args.log_level)
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        log.error("invalid configuration: %s", e)
        return 2
    from paged.server.serving_stack import check_model, parsing_options

    fleet = None
    if getattr(args, "fleet", None):
        fleet = _check_fleet(args, config, check_model)
        if fleet is None:
            return 2
        config.model = fleet.model or config.model
    elif getattr(args, "ray_address", None):
        log.error("--ray-address places the replicas of a --fleet file (docs/fleet.md)")
        return 2
    elif config.data_parallel_size > 1:
        from paged.engine.placement import check_local_replicas
        from paged.plugins import platform_class

        try:  # before anything starts: a count this host cannot run is refused at once
            cls = platform_class(config.platform)
            name = cls.name if cls else config.platform or "?"
            check_local_replicas([(name, cls, config.world_size, config.data_parallel_size)])
        except ValueError as e:
            log.error("invalid configuration: data_parallel_size: %s", e)
            return 2
    try:
        parsing_options(args)
        check_server_args(args)
        if fleet is None:  # a fleet's groups were checked each with its own arguments
            check_model(config)
        check_http_args(args)
        check_log_args(args)
    except ValueError as e:
        log.error("invalid configuration: %s", e)
        return 2
    api_key = args.api_key or os.environ.get("PAGED_API_KEY") or None
    try:
        return run_loop(_serve(config, args, api_key, faults, fleet))
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        return e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        return 130


def _check_fleet(args: argparse.Namespace, config: EngineConfig, check_model: Any) -> Any:
    """The --fleet file, checked before anything starts (None: refused, logged as `invalid
    fleet file: ...`): its fields; with replicas on this host (no Ray), platforms that are
    installed and a size the host can run; each group's engine configuration and what the
    model's config.json allows it (check_model)."""
    from paged.engine.fleet import (
        FleetError,
        check_groups,
        check_platforms,
        check_size,
        group_configs,
        load_fleet,
    )

    local = not (getattr(args, "ray_address", None) or os.environ.get("RAY_ADDRESS"))
    try:
        fleet = load_fleet(args.fleet)
        if config.data_parallel_size != 1:
            raise FleetError("--fleet and --data-parallel-size: the fleet file sets counts")
        if local:
            check_platforms(fleet)
        configs = group_configs(fleet, config, args.fleet)  # the engine's own checks, now
        if local:
            check_size(fleet, configs)
        check_groups(fleet, configs, check_model)
    except FleetError as e:
        log.error("invalid fleet file: %s", e)
        return None
    return fleet


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run `main` on uvloop's event loop when installed (as vLLM does), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _make_server(uv_config: Any, on_signal: Callable[[], bool]) -> Any:
    """A uvicorn.Server whose first SIGINT/SIGTERM/SIGHUP calls on_signal() (which drains,
    then sets should_exit) and whose second one exits at once; no signal is re-raised after."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not on_signal():
                self.force_exit = self.should_exit
                self.should_exit = True

    return Server(uv_config)


async def _serve(
    config: EngineConfig,
    args: argparse.Namespace,
    api_key: str | None,
    faults: Faults | None,
    fleet: Any = None,
) -> int:
    import uvicorn

    from paged.server.app import ServerState, build_app
    from paged.server.http_options import with_cors
    from paged.server.limits import raise_fd_limit, timed_protocol
    from paged.server.metrics import ServerMetrics, cache_config_labels
    from paged.server.request_log import StatsLogger, request_logger
    from paged.server.serving_stack import StartError, build_serving
    from paged.server.tracing import with_trace_context

    t0 = time.perf_counter()
    try:
        serving = build_serving(config, args, faults, fleet)
    except StartError as e:
        log.error("%s", e)
        return 1
    engine, name = serving.engine, serving.model_name
    if hasattr(engine, "wedge_timeout"):  # replicas: one silent this long is restarted
        engine.wedge_timeout = args.health_timeout
    cache_info = lambda: cache_config_labels(config, engine.info)  # noqa: E731
    metrics = ServerMetrics(name, lambda: engine.stats, getattr(engine, "replicas", None),
                            args.metrics_prefix, cache_info)  # fmt: skip
    requests_log = request_logger(args, lambda: engine.tokenizer)
    if requests_log is not None:
        metrics.listeners.append(requests_log)
    tracer = None
    if args.otlp_traces_endpoint:
        from paged.server.tracing import RequestTracer

        try:
            tracer = RequestTracer(name, args.otlp_traces_endpoint)
        except ValueError as e:
            log.error("invalid configuration: %s", e)
            return 2
        metrics.listeners.append(tracer)
    engine.observer = metrics
    state = ServerState(serving, metrics, api_key)
    state.max_body = args.max_request_body
    state.metrics_require_key = args.metrics_require_key
    state.body_timeout, state.health_timeout = args.body_timeout, args.health_timeout
    state.max_stored_responses = args.max_stored_responses
    raise_fd_limit()
    http = timed_protocol(args.idle_timeout)  # httptools when installed, else h11
    loop = asyncio.get_running_loop()
    log.info("HTTP: %s on %s", http.__name__, type(loop).__module__.split(".")[0])
    uv = uvicorn.Config(
        with_cors(with_trace_context(build_app(state), tracer), args),
        host=args.host,
        port=args.port,
        http=http,
        timeout_graceful_shutdown=1,  # after our own drain (see on_signal): then cut
        lifespan="off",
        **uvicorn_options(args),  # log level, root path, TLS
    )
    tasks: list[asyncio.Task] = []  # keeps the drain task referenced

    async def drain() -> None:
        state.draining = True
        log.info("shutting down: finishing %d in-flight requests", state.inflight)
        deadline = time.monotonic() + args.shutdown_timeout
        while state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True

    def on_signal() -> bool:  # runs in the signal handler: only schedule work
        if state.draining:
            return False
        state.draining = True
        loop.call_soon_threadsafe(lambda: tasks.append(loop.create_task(drain())))
        return True

    server = _make_server(uv, on_signal)
    engine.on_dead = lambda: setattr(server, "should_exit", True)
    log.info("starting the engine for %s (%s)", name, "API key required" if api_key else "open")
    engine.start()

    async def announce() -> None:
        if await engine.wait_ready():
            freeze_startup_objects()  # this process's start-up objects too
            i = engine.info or {}
            dp = i.get("data_parallel_size", 1)
            if fleet is not None:
                i = dict(i, platform="+".join(sorted(set(i.get("platforms") or []))))
            log.info(
                "ready in %.1f s: %s on %s%s (%s), max_model_len %d, KV cache %d blocks "
                "(%d tokens); serving at %s://%s:%d%s/v1",
                time.perf_counter() - t0,
                name,
                i.get("platform"),
                f" x {dp} replicas" if dp > 1 else "",
                i.get("dtype"),
                i.get("max_model_len", 0),
                i.get("num_blocks", 0),
                i.get("num_blocks", 0) * i.get("block_size", 0),
                scheme(args),
                args.host,
                args.port,
                args.root_path or "",
            )

    task = asyncio.create_task(announce())
    if not args.disable_log_stats:
        stats = StatsLogger(lambda: engine.stats, args.log_stats_interval)
        tasks.append(asyncio.create_task(stats.run()))
    try:
        await server.serve()
    finally:
        state.draining = True
        task.cancel()
        for t in tasks:
            t.cancel()
        await engine.shutdown()
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)  # send the spans still queued
    if engine.dead is not None:
        log.error("exiting: %s", engine.dead)
        return 1
    return 0 if server.started else 1
