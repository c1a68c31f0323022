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
