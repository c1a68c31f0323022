"""500 concurrent streaming clients against the default model, a fifth of them going away at
random points; three rounds. Every other request gets the greedy reference output, the block
pool is full again after each round, and host memory after round three is within 10% of
after round one. Bounded: the whole test must end within DEADLINE seconds."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from reliability_helpers import metric, start_server, stop_server

CLIENTS, ROUNDS, MAX_TOKENS = 500, 3, 8
DEADLINE = 380.0  # the whole test's own hang guard, inside pytest's 420 s (AVX2 2-core: ~180 s)
# float32 keeps greedy decoding independent of how requests are batched
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "256MiB"]
PROMPTS = ["Hello, my", "The sky is", "Once upon", "I like", "Paris is", "def f(", "1, 2, 3,"]
PROMPTS += ["Water is", "My dog", "Today we", "The best", "Why do"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


async def client(c: httpx.AsyncClient, prompt: str, cut: int | None) -> tuple[str, str] | None:
    """Stream one completion: (text, finish_reason), or None when it hung up after `cut`
    chunks (cut < 0: the task is cancelled at a random moment instead)."""
    text, reason, chunks = "", None, 0
    async with c.stream("POST", "/v1/completions", json=body(prompt, True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if cut is not None and chunks >= cut >= 0:
                return None  # leaving the block closes the connection mid-stream
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            chunks += 1
            text += ev["choices"][0]["text"]
            reason = ev["choices"][0]["finish_reason"] or reason
    return text, reason


async def hang_up_later(c: httpx.AsyncClient, prompt: str, rng: random.Random) -> None:
    task = asyncio.ensure_future(client(c, prompt, -1))
    await asyncio.sleep(rng.uniform(0, 2))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def one_round(url: str, rng: random.Random) -> list[tuple[str, tuple[str, str] | None]]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        jobs, prompts = [], []
        for i in range(CLIENTS):
            p = PROMPTS[i % len(PROMPTS)]
            if i % 5 == 4:  # a fifth go away: after 0..7 chunks, or at a random moment
                cut = rng.randint(-1, MAX_TOKENS - 1)
                jobs.append(hang_up_later(c, p, rng) if cut < 0 else client(c, p, cut))
                prompts.append(None)
            else:
                jobs.append(client(c, p, None))
                prompts.append(p)
        results = await asyncio.gather(*jobs)
    return [(p, r) for p, r in zip(prompts, results) if p is not None]


def settled(http: httpx.Client, deadline: float = 30.0) -> str:
    """/metrics once nothing runs or waits and the KV pool is full again."""
    end = time.monotonic() + deadline
    while True:
        text = http.get("/metrics").text
        busy = [
            metric(text, f"paged:{k}") for k in ("num_requests_running", "num_requests_waiting")
        ]
        usage = metric(text, "paged:kv_cache_usage_perc")
        if busy == [0, 0] and usage == 0:
            return text
        assert time.monotonic() < end, f"not settled: running/waiting {busy}, KV usage {usage}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_500_streaming_clients_with_disconnects(tmp_path):
    t0 = time.monotonic()
    srv = start_server(ARGS, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            ref = {}  # greedy reference: each prompt alone
            for p in PROMPTS:
                ch = http.post("/v1/completions", json=body(p, False)).json()["choices"][0]
                ref[p] = (ch["text"], ch["finish_reason"])
            pids = [srv.proc.pid, srv.core_pid()]
            rng, rss = random.Random(6), []
            for k in range(ROUNDS):
                left = DEADLINE - (time.monotonic() - t0)
                assert left > 0, f"out of time before round {k}"
                got = asyncio.run(asyncio.wait_for(one_round(srv.url, rng), left))
                assert len(got) == CLIENTS * 4 // 5
                wrong = [(p, r, ref[p]) for p, r in got if r != ref[p]]
                assert not wrong, f"round {k}: {len(wrong)} wrong, e.g. {wrong[:3]}"
                settled(http)
                rss.append(sum(rss_kib(pid) for pid in pids))
                print(f"round {k}: {time.monotonic() - t0:.1f} s, RSS {rss[-1] / 1024:.0f} MiB")
            assert rss[-1] <= rss[0] * 1.10, f"host memory grew: {rss} KiB"
            text = http.get("/metrics").text
            assert metric(text, "paged:num_kv_blocks") > 0
            ch = http.post("/v1/completions", json=body(PROMPTS[0], False)).json()["choices"][0]
            assert (ch["text"], ch["finish_reason"]) == ref[PROMPTS[0]]
    finally:
        stop_server(srv)
