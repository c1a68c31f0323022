"""`paged serve --tensor-parallel-size 2` on CPU answers the OpenAI client like one rank does;
a worker that dies takes the server down cleanly (503s, then exit 1), never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from dist_helpers import TESTS, load_module
from server_helpers import server_helpers

helpers = server_helpers()
rel = load_module(
    "paged_dist_reliability_helpers", TESTS / "reliability" / "reliability_helpers.py"
)

ARGS = ["--max-model-len", "256", "--num-kv-blocks", "64", "--dtype", "float32"]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return out


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> str:
    return rel.make_tiny_model(tmp_path_factory.mktemp("tp-tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def tp_server(tiny_with_tokenizer, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp-serve") / "server.log"
    args = [tiny_with_tokenizer, *ARGS, "--tensor-parallel-size", "2"]
    srv = helpers.start_server(args, log, rel.QUIET_OMP)
    yield srv
    helpers.stop_server(srv)


def test_tp2_server_answers_like_one_rank(tp_server, tiny_with_tokenizer):
    import openai

    from paged import LLM, SamplingParams

    client = openai.OpenAI(base_url=tp_server.url + "/v1", api_key="x", max_retries=0)
    prompts = [[5, 6, 7, 8], list(range(20, 60))]
    got = [client.completions.create(model=None, prompt=p, max_tokens=12, temperature=0,
                                     ) for p in prompts]  # fmt: skip
    llm = LLM(tiny_with_tokenizer, dtype="float32", max_model_len=256, num_kv_blocks=64)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)  # fmt: skip
    for r, o in zip(got, ref):
        assert r.choices[0].text == o.outputs[0].text
        assert r.usage.completion_tokens == len(o.outputs[0].token_ids)


def test_killed_worker_gives_503_and_exit_1(tp_server):
    """Last in this file: it kills the module's server."""
    core = tp_server.core_pid()
    workers = children(core)
    assert workers, "no worker process under the engine core"
    body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True}
    import os
    import signal

    os.kill(workers[0], signal.SIGKILL)
    t0 = time.monotonic()
    statuses = set()
    while tp_server.proc.poll() is None and time.monotonic() - t0 < 30:
        try:
            statuses.add(httpx.post(tp_server.url + "/v1/completions", json=body,
                                    timeout=10).status_code)  # fmt: skip
        except httpx.TransportError:
            break
        time.sleep(0.2)
    assert tp_server.proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 40
    assert statuses <= {200, 503}, statuses
