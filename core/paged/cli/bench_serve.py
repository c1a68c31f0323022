"""``paged bench serve``: a load generator against a running server's /v1/completions.

Like vLLM's benchmark_serving: streamed requests with ``ignore_eos`` and ``max_tokens``,
Poisson arrivals (``--request-rate``) and/or a concurrency cap (``--max-concurrency``);
per request TTFT, TPOT (decode time per output token) and ITL (gaps between chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from paged.cli.bench_common import flag_error, print_metrics, save_json, save_json_error, stats
from paged.cli.bench_prompts import Prompt, dataset_prompts, random_prompts

# bounds of the numeric flags, checked before the server is contacted: the least value of
# each (--random-range-ratio is also below 1), and those that must be above a bound
LEAST = dict(num_prompts=1, max_concurrency=1, random_input_len=1, random_output_len=1,
             random_range_ratio=0, vocab_size=1, temperature=0)  # fmt: skip
ABOVE = dict(request_rate=0, timeout=0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test a running server: TTFT, TPOT, ITL, throughput")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API base URL")
    p.add_argument("--endpoint", default="/completions", help="path under --url")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="bearer token (default: PAGED_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--random-input-len", type=int, default=128, help="prompt tokens")
    p.add_argument(
        "--random-output-len",
        type=int,
        default=64,
        help="output tokens (also the default for --dataset lines without one)",
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="vary lengths uniformly within +-ratio, in [0, 1)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw prompt token ids from [0, V) (default: ids the server's "
        "/tokenize gives for random words, else random words as text)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help='JSONL of prompts: {"prompt": text or ids, "output_len": N} or strings',
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    p.add_argument("--save-json", default=None, help="write all figures and the command here")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="per-request timeout (s; inf: none)"
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


@dataclass
class Result:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""


async def send(session, url: str, payload: dict, headers: dict, prompt: Prompt) -> Result:
    """One streamed request on an aiohttp session (as vLLM's benchmark_serving: a light client,
    so the times are the server's rather than the client's parsing)."""
    res = Result(prompt.prompt_len)
    start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                res.error = "HTTP " + refusal(url, resp.status, await resp.text(errors="replace"))
                return res
            buf = b""
            async for data in resp.content.iter_any():  # whole events, however long
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    event = line[5:].strip()
                    if event == b"[DONE]":
                        break
                    chunk = json.loads(event)
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text"):
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
        finish(res, last - start, chunks, usage)
    except Exception as e:  # record and go on: one failure must not end the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


def finish(res: Result, latency: float, chunks: int, usage: dict | None) -> None:
    """A completed stream's figures into `res`: its latency, output (and prompt) tokens from
    the usage chunk (else the text chunks counted), success when any text came."""
    res.latency = latency
    res.output_len = usage["completion_tokens"] if usage else chunks
    if usage and usage.get("prompt_tokens"):
        res.prompt_len = usage["prompt_tokens"]
    res.success = chunks > 0
    res.error = "" if chunks else "no output"


async def benchmark(args: argparse.Namespace, prompts: list[Prompt], model: str) -> dict:
    import aiohttp
    from tqdm import tqdm

    url = args.url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": args.temperature,
    }
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)  # 0: no limit
    timeout = aiohttp.ClientTimeout(total=args.timeout if math.isfinite(args.timeout) else None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        test = await send(
            session, url, {**base, "prompt": prompts[0].prompt, "max_tokens": 2}, headers,
            prompts[0],
        )  # fmt: skip
        if not test.success:
            raise ServerError(f"the test request to {url} failed: {test.error}")
        bar = tqdm(total=len(prompts), desc="requests", disable=args.disable_tqdm)

        async def one(p: Prompt) -> Result:
            payload = {**base, "prompt": p.prompt, "max_tokens": p.output_len}
            if sem is None:
                r = await send(session, url, payload, headers, p)
            else:
                async with sem:
                    r = await send(session, url, payload, headers, p)
            bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(one(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return summarize(results, duration)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
    }
    m |= stats("ttft", [r.ttft for r in ok]) | stats("tpot", tpots)
    m |= stats("itl", [x for r in ok for x in r.itl]) | stats("e2el", [r.latency for r in ok])
    m["requests"] = [asdict(r) for r in results]
    return m


class ServerError(Exception):
    """The server could not be asked (unreachable, or it refused): one line, no traceback."""


def _error_text(body: str) -> str:
    """The server's message in an error body ({"error": {"message": ...}}), else its text's
    first line."""
    try:
        err = json.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message") if isinstance(err, dict) else None
    except ValueError:
        msg = None
    lines = str(msg or body).strip().splitlines()
    return lines[0][:300] if lines else ""


def refusal(url: str, status: int, body: str) -> str:
    """One line for a non-200 answer from `url`: the status, the server's message, a hint for
    the usual causes (the API key, a --url without /v1)."""
    from http import HTTPStatus

    try:
        phrase = f" {HTTPStatus(status).phrase}"
    except ValueError:
        phrase = ""
    line = f"{status}{phrase}: {_error_text(body)}"
    if status == 401:
        line += " (give the key with --api-key or PAGED_API_KEY)"
    elif status == 404 and "/v1/" not in url:
        line += " (is --url missing /v1?)"
    return line


async def _first_model(args: argparse.Namespace) -> str:
    import httpx

    url = args.url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {args.url}: {str(e) or type(e).__name__}") from None
    if r.status_code != 200:
        raise ServerError(f"{url} answered {refusal(url, r.status_code, r.text)}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{url} lists no model; give one with --model") from None


def run(args: argparse.Namespace) -> int:
    import os

    args.api_key = args.api_key or os.environ.get("PAGED_API_KEY")
    problem = flag_error(args, LEAST, ABOVE) or save_json_error(args.save_json)
    if not problem and not args.random_range_ratio < 1:
        problem = f"--random-range-ratio must be below 1, not {args.random_range_ratio}"
    try:  # a dataset is read before the server is contacted
        prompts = dataset_prompts(args) if args.dataset and not problem else None
    except ValueError as e:
        problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        model = args.model or asyncio.run(_first_model(args))
        prompts = prompts or random_prompts(args)
        metrics = asyncio.run(benchmark(args, prompts, model))
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    metrics["model"] = model
    print_metrics(
        "Serving Benchmark Result",
        metrics,
        [
            ("Successful requests", "completed"),
            ("Failed requests", "failed"),
            ("Benchmark duration (s)", "duration_s"),
            ("Total input tokens", "total_input_tokens"),
            ("Total generated tokens", "total_output_tokens"),
            ("Request throughput (req/s)", "request_throughput"),
            ("Output token throughput (tok/s)", "output_throughput"),
            ("Total token throughput (tok/s)", "total_token_throughput"),
        ],
        sections=[
            ("Time to First Token", "ttft"),
            ("Time per Output Token (excl. 1st token)", "tpot"),
            ("Inter-token Latency", "itl"),
            ("End-to-end Latency", "e2el"),
        ],
    )
    if args.save_json:
        save_json(args.save_json, args, metrics)
    errors = [r["error"] for r in metrics["requests"] if r["error"]]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    return 0 if metrics["completed"] else 1
