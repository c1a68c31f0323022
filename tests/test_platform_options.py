"""Platform options: declared by a plugin (`Platform.options`), shown as `paged serve` flags,
accepted as `LLM(...)` arguments, the environment variable only a fallback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged.cli.env import _platform_options
from paged.config import EngineConfig
from paged.platform import PlatformOption
from paged_cpu.linear import PackedLinear, packing_available
from paged_cpu.platform import CpuPlatform

CPU_ENVS = ("PAGED_CPU_NATIVE", "PAGED_CPU_PACKED_WEIGHTS", "PAGED_CPU_GGUF_BLOCKS")


@pytest.fixture(autouse=True)
def no_fallbacks(monkeypatch):
    for name in CPU_ENVS:
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(argv))


def configured(config: EngineConfig) -> CpuPlatform:
    platform = CpuPlatform()
    platform.configure(config.platform_options)
    return platform


def test_serve_help_shows_every_option():
    script = Path(sys.executable).with_name("paged")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "paged.cli.main"]
    out = subprocess.run([*cmd, "serve", "--help"], capture_output=True, text=True, check=True)
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert "cpu platform options:" in out.stdout
    for flag in ("--cpu-native, --no-cpu-native", "--no-cpu-packed-weights",
                 "--no-cpu-gguf-blocks", "--xpu-attention {auto,ipex,triton}",
                 "--tpu-attention {auto,pallas,torch}"):  # fmt: skip
        assert flag in text, flag
    for env in ("PAGED_CPU_NATIVE", "PAGED_CPU_GGUF_BLOCKS", "PAGED_XPU_ATTENTION"):
        assert f"env fallback {env}" in text, env


def test_flag_reaches_the_platform():
    config = parse("--no-cpu-gguf-blocks", "--dtype", "bfloat16")
    assert config.platform_options == {"cpu_gguf_blocks": False}  # only what was given
    platform = configured(config)
    assert platform.option("cpu_gguf_blocks") is False
    assert platform.option("cpu_native") is True  # not given: the default
    assert parse().platform_options == {}
    assert parse("--xpu-attention", "triton").platform_options == {"xpu_attention": "triton"}
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        parse("--xpu-attention", "cuda")


def test_env_fallback_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("PAGED_CPU_GGUF_BLOCKS", "0")
    assert configured(parse()).option("cpu_gguf_blocks") is False  # no flag: the env
    assert configured(parse("--cpu-gguf-blocks")).option("cpu_gguf_blocks") is True
    monkeypatch.setenv("PAGED_CPU_GGUF_BLOCKS", "1")
    assert configured(parse("--no-cpu-gguf-blocks")).option("cpu_gguf_blocks") is False
    assert CpuPlatform().option("cpu_gguf_blocks") is True  # never configured: env, default
    monkeypatch.setenv("PAGED_CPU_NATIVE", "maybe")
    with pytest.raises(ValueError, match="PAGED_CPU_NATIVE='maybe': use 1 or 0"):
        configured(parse())  # a bad fallback fails at start-up
    monkeypatch.setenv("PAGED_CPU_NATIVE", "")  # empty: unset
    assert configured(parse()).option("cpu_native") is True


def test_option_parsing():
    opt = PlatformOption("acme_mode", "a mode", "fast", choices=("fast", "exact"), env="ACME")
    assert opt.flag == "--acme-mode" and opt.check("exact") == "exact"
    with pytest.raises(ValueError, match="expected one of fast, exact"):
        opt.check("slow")
    with pytest.raises(ValueError, match="expected True or False"):
        EngineConfig(platform_options={"cpu_native": "no"})
    with pytest.raises(KeyError, match="no option 'acme_mode'"):
        CpuPlatform().option("acme_mode")


def test_unknown_names_fail(tiny_models):
    from paged import LLM

    with pytest.raises(ValueError, match="unknown engine argument or platform option 'bogus'"):
        EngineConfig(platform_options={"bogus": 1})
    with pytest.raises(ValueError, match="'cpu_nativ'.*cpu_native"):
        LLM(tiny_models["llama"], cpu_nativ=False)


def test_other_platforms_options_are_ignored():
    platform = CpuPlatform()
    platform.configure({"xpu_attention": "triton", "cpu_native": False})
    assert platform.option("cpu_native") is False


def test_llm_arguments_reach_the_engine(tiny_models):
    from paged import LLM, SamplingParams

    cfg = dict(dtype="bfloat16", max_model_len=128, num_kv_blocks=16, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # The default last: paged.model.ops is per process, the last engine built installs its own.
    for kwargs in ({"cpu_packed_weights": False, "cpu_native": False}, {}):
        llm = LLM(tiny_models["llama"], **cfg, **kwargs)
        assert llm.config.platform_options == kwargs
        model, backend = llm.engine.runner.model, llm.engine.runner.backend
        packed = any(isinstance(m, PackedLinear) for m in model.modules())
        assert packed == (packing_available(torch.bfloat16) and not kwargs)
        if kwargs:
            assert not packed and backend.native is None and backend.name == "cpu-torch"
            assert llm.engine.platform.option("cpu_packed_weights") is False
        out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4


def test_paged_env_lists_options(monkeypatch):
    monkeypatch.setenv("PAGED_CPU_PACKED_WEIGHTS", "0")
    rows = _platform_options()
    assert rows["--[no-]cpu-packed-weights"].endswith("env fallback PAGED_CPU_PACKED_WEIGHTS=0")
    assert "PAGED_CPU_NATIVE (unset)" in rows["--[no-]cpu-native"]
    assert rows["--xpu-attention {auto,ipex,triton}"].startswith("xpu, default auto")


def test_gguf_block_layer_follows_the_options_and_the_world():
    """Which platform builds a GGUF's block layers: the cuda plugin on one rank unless
    --no-cuda-gguf-blocks; the cpu plugin for bf16 on one rank with its C++ kernels unless
    --no-cpu-gguf-blocks."""
    from paged.quantization.gguf import int_block_layer
    from paged_cpu.linear import gguf_block_linear, gguf_blocks_available
    from paged_cuda.platform import CudaPlatform

    def cuda(*argv: str):
        config = parse(*argv)
        platform = CudaPlatform()
        platform.configure(config.platform_options)
        return platform.gguf_block_layer(config)

    assert cuda() is int_block_layer
    assert cuda("--no-cuda-gguf-blocks") is None
    assert cuda("--tensor-parallel-size", "2") is None  # the file's blocks are whole layers
    bf16 = parse("--dtype", "bfloat16")
    expected = gguf_block_linear if gguf_blocks_available() else None
    assert configured(bf16).gguf_block_layer(bf16) is expected
    for argv in (("--dtype", "float32"), ("--dtype", "bfloat16", "--no-cpu-gguf-blocks")):
        config = parse(*argv)
        assert configured(config).gguf_block_layer(config) is None
