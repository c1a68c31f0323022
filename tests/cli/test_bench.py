"""paged bench throughput / latency (offline) and bench serve (against a live server)."""

from __future__ import annotations

import json


def test_bench_throughput_dummy_shape(cli, tmp_path):
    out_json = tmp_path / "tp.json"
    rc, out, err = cli(
        "bench", "throughput", "--load-format", "dummy", "--model", "smollm2-135m",
        "--input-len", "8", "--output-len", "3", "--num-prompts", "3",
        "--kv-cache-memory", "8MiB", "--dtype", "float32", "--save-json", out_json,
    )  # fmt: skip
    assert rc == 0, err
    assert "Output token throughput (tok/s)" in out
    data = json.loads(out_json.read_text())
    assert data["total_output_tokens"] == 9  # ignore_eos: every prompt runs to --output-len
    assert data["total_input_tokens"] == 24
    assert data["output_tokens_per_s"] > 0
    # the command line given to main(), not the process's (here pytest's)
    assert data["command"].startswith("paged bench throughput --load-format dummy --model ")
    assert data["args"]["model"] == "smollm2-135m" and "_argv" not in data["args"]


def test_bench_latency(cli, tiny_llama, tmp_path):
    out_json = tmp_path / "lat.json"
    rc, out, err = cli(
        "bench", "latency", "--model", tiny_llama, "--input-len", "16", "--output-len", "5",
        "--batch-size", "2", "--num-iters", "2", "--kv-cache-memory", "8MiB",
        "--save-json", out_json,
    )  # fmt: skip
    assert rc == 0, err
    assert "TTFT" in out and "Decode Latency per Token" in out
    data = json.loads(out_json.read_text())
    assert 0 < data["mean_ttft_ms"] < data["mean_e2el_ms"]
    assert data["mean_tpot_ms"] > 0 and data["decode_tokens_per_s"] > 0


def test_bench_unknown_baseline_is_an_error(cli, tiny_llama):
    rc, _, err = cli(
        "bench", "throughput", "--model", tiny_llama, "--input-len", "4", "--output-len", "2",
        "--num-prompts", "1", "--kv-cache-memory", "8MiB", "--baseline", "nosuch",
    )  # fmt: skip
    assert rc == 1 and "--baseline: no baseline named 'nosuch'" in err


def test_bench_serve(cli, server_url, tmp_path):
    out_json = tmp_path / "serve.json"
    rc, out, err = cli(
        "bench", "serve", "--url", server_url, "--num-prompts", "6", "--random-input-len", "12",
        "--random-output-len", "4", "--max-concurrency", "3", "--request-rate", "50",
        "--save-json", out_json, "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, err + out
    for label in ("TTFT", "TPOT", "ITL", "Request throughput", "Output token throughput"):
        assert label in out
    data = json.loads(out_json.read_text())
    assert data["completed"] == 6 and data["failed"] == 0
    assert data["total_output_tokens"] == 24  # ignore_eos + max_tokens honoured
    assert data["total_input_tokens"] == 72  # token-id prompts of exactly 12 tokens
    assert data["p99_ttft_ms"] >= data["p50_ttft_ms"] > 0
    # events read together from the socket share one arrival time: an ITL may be 0 on a busy host
    assert data["p99_itl_ms"] >= data["median_itl_ms"] >= 0 and data["model"] == "tiny"


def test_bench_serve_dataset(cli, server_url, tmp_path):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text('{"prompt": "hello world", "output_len": 3}\n"the quick brown fox"\n')
    rc, out, err = cli(
        "bench", "serve", "--url", server_url, "--dataset", ds, "--num-prompts", "3",
        "--random-output-len", "2", "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, err + out
    assert "Successful requests:" in out
