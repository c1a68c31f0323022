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


def test_bench_latency(cli, tiny_llama, tmp_path, caplog):
    import logging

    out_json = tmp_path / "lat.json"
    try:
        rc, out, err = cli(
            "bench", "latency", "--model", tiny_llama, "--input-len", "16", "--output-len", "5",
            "--batch-size", "2", "--num-iters", "2", "--kv-cache-memory", "8MiB",
            "--save-json", out_json, "--log-level", "info",
        )  # fmt: skip
    finally:
        logging.getLogger("paged").setLevel(logging.NOTSET)
    assert rc == 0, err
    assert any(r.getMessage().startswith("weights ready in") for r in caplog.records)
    assert "TTFT" in out and "Decode Latency per Token" in out
    data = json.loads(out_json.read_text())
    assert 0 < data["mean_ttft_ms"] < data["mean_e2el_ms"]
    assert data["mean_tpot_ms"] > 0 and data["decode_tokens_per_s"] > 0


def test_bench_offline_flags_are_refused_before_loading(cli, tmp_path):
    """Each nonsensical flag: one line naming it, exit 2, before a model loads (none at that
    path); valid edge values (--num-iters-warmup 0) pass the checks."""
    model = ["--model", tmp_path / "no-model-here", "--input-len", "4", "--output-len", "2"]
    cases = [
        ("throughput", ["--num-prompts", "0"], "--num-prompts must be at least 1, not 0"),
        ("throughput", ["--input-len", "0"], "--input-len must be at least 1, not 0"),
        ("latency", ["--output-len", "-1"], "--output-len must be at least 1, not -1"),
        ("latency", ["--batch-size", "0"], "--batch-size must be at least 1, not 0"),
        ("latency", ["--num-iters", "0"], "--num-iters must be at least 1, not 0"),
        ("latency", ["--num-iters-warmup", "-1"], "--num-iters-warmup must be at least 0"),
        ("latency", ["--hf-num-iters", "0"], "--hf-num-iters must be at least 1"),
        ("throughput", ["--hf-batch-size", "0"], "--hf-batch-size must be at least 1"),
        ("throughput", ["--hf-num-prompts", "-2"], "--hf-num-prompts must be at least 1"),
        ("throughput", ["--hf-max-seconds", "0"], "--hf-max-seconds must be more than 0"),
        ("throughput", ["--baseline", "nosuch"], "--baseline: no baseline named 'nosuch' ("),
        ("throughput", ["--max-model-len", "5"], "--max-model-len 5 is below --input-len + "),
        ("latency", ["--max-num-seqs", "0"], "invalid configuration: max_num_seqs: must be"),
        ("latency", ["--save-json", tmp_path / "no" / "x.json"], "--save-json: no directory"),
    ]  # fmt: skip
    for bench, flags, want in cases:
        rc, out, err = cli("bench", bench, *model, *flags)
        assert rc == 2 and err.startswith(f"error: {want}") and err.count("\n") == 1, (flags, err)
    rc, _, err = cli("bench", "latency", *model, "--num-iters-warmup", "0")
    assert rc == 1 and "no-model-here" in err  # past the checks: the model is loaded


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


def test_bench_serve_flags_are_refused_before_connecting(cli, tmp_path):
    """Nothing listens at --url: each nonsensical flag or unusable file is one line naming it
    (and the file's line), exit 2, before any connection."""
    url = ["--url", "http://127.0.0.1:9/v1", "--disable-tqdm"]
    cases = [
        (["--request-rate", "0"], "--request-rate must be more than 0, not 0.0"),
        (["--request-rate", "-1"], "--request-rate must be more than 0, not -1.0"),
        (["--max-concurrency", "-1"], "--max-concurrency must be at least 1, not -1"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1, not 0"),
        (["--num-prompts", "0"], "--num-prompts must be at least 1, not 0"),
        (["--random-input-len", "0"], "--random-input-len must be at least 1, not 0"),
        (["--random-output-len", "0"], "--random-output-len must be at least 1, not 0"),
        (["--random-range-ratio", "1"], "--random-range-ratio must be below 1, not 1.0"),
        (["--random-range-ratio", "-0.5"], "--random-range-ratio must be at least 0"),
        (["--vocab-size", "0"], "--vocab-size must be at least 1, not 0"),
        (["--temperature", "-1"], "--temperature must be at least 0"),
        (["--timeout", "0"], "--timeout must be more than 0, not 0.0"),
        (["--save-json", tmp_path / "no" / "x.json"], f"--save-json: no directory {tmp_path}/no"),
        (["--save-json", tmp_path], f"--save-json: {tmp_path} is a directory"),
    ]  # fmt: skip
    cases.append((["--dataset", tmp_path / "none"], f"--dataset: cannot read {tmp_path}/none: No"))
    for name, text, why in [
        ("json", b'"a"\n\n{"prompt": }\n', "line 3: not valid JSON (Expecting value at column 12)"),
        ("utf8", b'"a"\n"caf\xe9"\n', "line 2: not UTF-8"),
        ("len", b'{"prompt": "a", "output_len": 0}\n', "line 1: output_len / max_tokens must be"),
        ("ids", b'{"prompt": [1, "x"]}\n', "line 1: needs a 'prompt': a non-empty string or"),
    ]:  # fmt: skip
        (tmp_path / name).write_bytes(text)
        cases.append((["--dataset", tmp_path / name], f"--dataset: {tmp_path / name} {why}"))
    for flags, want in cases:
        rc, _, err = cli("bench", "serve", *url, *flags)
        assert rc == 2 and err.startswith(f"error: {want}") and err.count("\n") == 1, (flags, err)
    rc, _, err = cli("bench", "serve", *url, "--request-rate", "inf", "--vocab-size", "9")
    assert rc == 1 and err.count("\n") == 1  # past the checks: all at once is valid
    assert err.startswith("error: cannot reach http://127.0.0.1:9/v1: All connection attempts")


def test_bench_serve_dataset(cli, server_url, tmp_path):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text('{"prompt": "hello world", "output_len": 3}\n"the quick brown fox"\n')
    rc, out, err = cli(
        "bench", "serve", "--url", server_url, "--dataset", ds, "--num-prompts", "3",
        "--random-output-len", "2", "--request-rate", "inf", "--timeout", "inf",
        "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, err + out
    assert "Successful requests:" in out
