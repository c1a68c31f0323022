"""EngineConfig and `paged serve` flags: a value out of range is refused at start-up (exit 2,
one `invalid configuration: <field>: ...` line; a ValueError for LLM()), never read as the
default or left to fail late."""

from __future__ import annotations

import dataclasses

import pytest

from paged.config import EngineConfig, read_chat_template

COUNTS = ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
          "kv_cache_memory"]  # fmt: skip


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("value", [0, -5])
def test_counts_refuse_zero_and_negatives(name, value):
    with pytest.raises(ValueError, match=f"^{name}: must be at least 1"):
        EngineConfig(**{name: value})
    assert getattr(EngineConfig(), name) is None  # unset: the platform's or model's default
    assert getattr(EngineConfig(**{name: 64}), name) == 64


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"seed": "abc"}, "seed: must be an integer, got 'abc'"),
        ({"seed": True}, "seed: must be an integer"),
        ({"seed": 1 << 64}, "seed: must fit in 64 bits"),
        ({"max_num_seqs": "8"}, "max_num_seqs: must be an integer"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization: must be a number"),
        ({"dtype": "float8"}, "dtype: must be one of auto, float32, float, bfloat16, float16"),
        ({"dtype": "int32"}, "dtype: must be one of auto"),
    ],
)
def test_types_and_names_checked_in_the_config(kw, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig(**kw)


def test_accepted_numbers_and_dtypes():
    c = EngineConfig(seed=-1, gpu_memory_utilization=1, dtype="half")
    assert (c.seed, c.dtype) == (-1, "half")
    assert EngineConfig(dtype="auto").dtype == "auto"


def test_chat_template_is_a_readable_file_or_jinja(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    assert read_chat_template(None) is None
    config = EngineConfig(chat_template=str(f))
    assert config.chat_template == "{{ messages[0]['content'] }}"  # the text from here on:
    assert dataclasses.replace(config).chat_template == config.chat_template  # other processes
    for bad in ("/no/such/file.jinja", str(tmp_path)):  # missing, a folder
        with pytest.raises(ValueError, match=f"^chat_template: cannot read the file '{bad}'"):
            EngineConfig(chat_template=bad)  # before any model loads (LLM() too)
    (tmp_path / "plain.txt").write_text("You are a helpful assistant.")  # no Jinja: not one
    with pytest.raises(ValueError, match="^chat_template: the file .* holds no Jinja"):
        EngineConfig(chat_template=str(tmp_path / "plain.txt"))


def test_offline_chat_template_names_the_argument():
    from paged.engine.llm import load_chat_template

    with pytest.raises(ValueError, match="^chat_template: .*'no-such.jinja'"):
        load_chat_template("no-such.jinja")


# ---- `paged serve`: exit 2 before anything starts ------------------------------------------


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--port", "99999"], "port"),
        (["--port", "-1"], "port"),
        (["--health-timeout", "0"], "health_timeout"),
        (["--health-timeout", "-1"], "health_timeout"),
        (["--idle-timeout", "nan"], "idle_timeout"),
        (["--body-timeout", "0"], "body_timeout"),
        (["--shutdown-timeout", "-1"], "shutdown_timeout"),
        (["--max-request-body", "0"], "max_request_body"),
        (["--max-prompt-chars", "0"], "max_prompt_chars"),
        (["--max-stored-responses", "-1"], "max_stored_responses"),
        (["--max-model-len", "0"], "max_model_len"),
        (["--max-model-len", "-5"], "max_model_len"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
        (["--dtype", "float8"], "dtype"),
        (["--chat-template", "/no/such/file.jinja"], "chat_template"),
    ],
)
def test_serve_refuses_out_of_range_flags(flags, field, caplog):
    from paged.cli.main import main

    assert main(["serve", *flags]) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and lines[0].startswith(f"invalid configuration: {field}: "), lines
    assert "Traceback" not in caplog.text


def test_serve_refuses_a_seed_that_is_no_integer(capsys):
    from paged.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--seed", "abc"])
    assert e.value.code == 2 and "--seed: invalid int value: 'abc'" in capsys.readouterr().err


def test_server_flags_at_the_edges_are_accepted():
    from paged.cli.main import build_parser
    from paged.server.api import check_server_args

    argv = ["serve", "--port", "0", "--shutdown-timeout", "0", "--max-stored-responses", "0"]
    check_server_args(build_parser(argv).parse_args(argv))
    argv = ["serve", "--port", "65535", "--health-timeout", "0.5", "--max-prompt-chars", "1"]
    check_server_args(build_parser(argv).parse_args(argv))


def test_serve_refuses_a_key_that_does_not_match_the_certificate(tmp_path, caplog):
    """TLS (docs/operating.md): a key and certificate that do not load together exit 2."""
    from tls_cert import self_signed

    from paged.cli.main import main

    k, c = self_signed(tmp_path, mismatched_key=True)
    assert main(["serve", "--ssl-keyfile", k, "--ssl-certfile", c]) == 2
    assert "invalid configuration: ssl_certfile / ssl_keyfile: cannot load them" in caplog.text


# ---- what config.json tells, checked before the engine starts --------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tiny_hf import make_tiny

    return make_tiny("llama", str(tmp_path_factory.mktemp("cfg") / "llama"))  # 512 positions


def _bad_dir(tmp_path, config: dict) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_model_max_len_is_derived_as_vllm_does():
    from transformers import LlamaConfig

    from paged.config import model_max_len

    plain = LlamaConfig(max_position_embeddings=512)
    assert model_max_len(plain) == (512, "max_position_embeddings")
    linear = LlamaConfig(max_position_embeddings=512)
    linear.rope_scaling = {"rope_type": "linear", "factor": 4.0}
    assert model_max_len(linear)[0] == 2048
    llama3 = LlamaConfig(max_position_embeddings=512)
    llama3.rope_scaling = {"rope_type": "llama3", "factor": 8.0}
    assert model_max_len(llama3)[0] == 512  # max_position_embeddings already counts it


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--max-model-len", "100000"], "max_model_len: 100000 is greater than the model's "
         "maximum context length 512 (max_position_embeddings)"),
        (["--quantization", "awq"], "quantization awq"),
        (["--speculative-config", '{"model": "/nonexistent", "num_speculative_tokens": 2}'],
         "speculative_config.model"),
        (["--max-num-seqs", "4096", "--max-num-batched-tokens", "2048"], "max_num_batched_tokens"),
        (["--max-loras", "2"], "max_loras"),
        (["--max-lora-rank", "8"], "max_lora_rank"),
        (["--metrics-require-key"], "metrics_require_key"),
        (["--api-key", ""], "api_key"),
        (["--served-model-name", "a", "a"], "served_model_name"),
        (["--override-generation-config", "[1]"], "override_generation_config: must be a JSON"),
        # the tiny model: 4 query heads over 2 KV heads, 2 layers (model/parallel.py's rules)
        (["--tensor-parallel-size", "3"], "tensor_parallel_size: 3 ranks cannot share 2 KV"),
        (["--tensor-parallel-size", "8"], "tensor_parallel_size: 8 ranks cannot share 2 KV"),
        (["--pipeline-parallel-size", "3"], "pipeline_parallel_size: 3 stages for the model's 2"),
        (["--async-scheduling", "-tp", "2"], "async_scheduling: not supported with more than"),
        (["--async-scheduling", "-pp", "2"], "async_scheduling: not supported with more than"),
        (["--runner", "pooling", "-pp", "2"], "runner: pooling"),
    ],
)
def test_serve_refuses_what_config_json_tells(tiny, flags, field, caplog, monkeypatch):
    from paged.cli.main import main

    monkeypatch.delenv("PAGED_API_KEY", raising=False)
    assert main(["serve", tiny, *flags]) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and lines[0].startswith(f"invalid configuration: {field}"), lines


def test_serve_refuses_a_model_it_cannot_run(tiny, tmp_path, caplog):
    import json
    from pathlib import Path

    from paged.cli.main import main

    cfg = json.loads((Path(tiny) / "config.json").read_text())
    for d in ("gpt2", "untyped", "draft", "heads", "moe", "embed"):
        (tmp_path / d).mkdir()
    gpt2 = _bad_dir(tmp_path / "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    untyped = _bad_dir(tmp_path / "untyped", {k: v for k, v in cfg.items() if k != "model_type"})
    draft = _bad_dir(tmp_path / "draft", {**cfg, "vocab_size": cfg["vocab_size"] * 2})
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 2})
    heads = _bad_dir(tmp_path / "heads", {**cfg, "num_key_value_heads": 3})
    moe = _bad_dir(tmp_path / "moe", {**cfg, "model_type": "mixtral", "num_local_experts": 2,
                                      "architectures": ["MixtralForCausalLM"],
                                      "num_experts_per_tok": 3})  # fmt: skip
    embed = _bad_dir(tmp_path / "embed", {**cfg, "architectures": ["LlamaModel"]})
    for argv, field in [([gpt2, "--load-format", "dummy"], "model: unsupported"),
                        ([untyped, "--load-format", "dummy"], "model: "),
                        ([tiny, "--load-format", "dummy", "--speculative-config", spec],
                         "speculative_config.model: the draft's vocabulary"),
                        ([heads, "--load-format", "dummy"], "model: 4 attention heads do not "
                         "share 3 KV heads"),
                        ([moe, "--load-format", "dummy"], "model: num_experts_per_tok 3 exceeds"),
                        ([embed, "--load-format", "dummy", "-pp", "2"],
                         "runner: this checkpoint runs as an embedding model")]:  # fmt: skip
        caplog.clear()
        assert main(["serve", *argv]) == 2, argv
        lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(lines) == 1 and lines[0].startswith(f"invalid configuration: {field}"), lines


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching: must be True or False"),
        ({"async_scheduling": 1}, "async_scheduling: must be True or False"),
        ({"load_format": 3}, "load_format: must be a string"),
        ({"max_loras": 2}, "max_loras: applies to LoRA adapters only"),
    ],
)
def test_offline_options_are_type_checked(kw, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig(**kw)


def test_torch_dtype_and_llm_max_model_len():
    import torch
    from transformers import LlamaConfig

    from paged.worker.worker import resolve_config
    from paged_cpu.platform import CpuPlatform

    assert EngineConfig(dtype=torch.float16).dtype == "float16"
    hf = LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=512)
    with pytest.raises(ValueError, match="^max_model_len: 100000 is greater"):
        resolve_config(EngineConfig(max_model_len=100000), CpuPlatform(), hf)
    small = resolve_config(EngineConfig(max_num_batched_tokens=64), CpuPlatform(), hf)
    assert small.max_num_seqs == 64  # the platform's 256, at most one a batched token
