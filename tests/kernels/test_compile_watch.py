"""paged.kernels.compile_watch: Triton compilations after the warm-up are logged, with any
hooks installed before it still called, and stop() puts those back. Triton calls the hooks
on a GPU; here they are called as Triton's JIT calls them (keyword arguments only)."""

from __future__ import annotations

import logging

import pytest

from paged.kernels import compile_watch

knobs = pytest.importorskip("triton").knobs


def triton_compiles(name: str) -> bool:
    """What JITFunction._do_compile does around a compilation: the cache hook (true: skip),
    then the post-compile hook. Returns whether it compiled."""
    kw = dict(key=("k",), repr=f"{name}[num_warps=4]()", fn=None, compile={},
              is_manual_warmup=False, already_compiled=False)  # fmt: skip
    if knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook(**kw):
        return False
    if knobs.runtime.jit_post_compile_hook is not None:
        knobs.runtime.jit_post_compile_hook(**kw)
    return True


def test_compilations_after_the_warm_up_are_logged(caplog):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("cache", kw["repr"])) and False
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["repr"]))
    try:
        watch = compile_watch.watch_compiles()
        assert watch is not None
        with caplog.at_level(logging.WARNING, logger="paged"):
            assert triton_compiles("_varlen_kernel")
        assert watch.compiled == 1
        assert "Triton compiled _varlen_kernel[num_warps=4]() while serving" in caplog.text
        assert seen == [("cache", "_varlen_kernel[num_warps=4]()"),
                        ("post", "_varlen_kernel[num_warps=4]()")]  # fmt: skip
        watch.stop()
        assert knobs.runtime.jit_post_compile_hook is not watch._compiled
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paged"):
            assert triton_compiles("_other")
        assert watch.compiled == 1 and not caplog.text
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def test_reports_stop_after_max(caplog, monkeypatch):
    monkeypatch.setattr(compile_watch, "MAX_REPORTS", 2)
    watch = compile_watch.watch_compiles()
    try:
        with caplog.at_level(logging.WARNING, logger="paged"):
            for i in range(4):
                triton_compiles(f"k{i}")
        assert watch.compiled == 4
        assert [r.getMessage().split()[2] for r in caplog.records] == ["k0[num_warps=4]()",
                                                                        "k1[num_warps=4]()"]
        assert "further compilations are not logged" in caplog.records[-1].getMessage()
    finally:
        watch.stop()


def test_engine_counts_compilations_in_its_metrics(tiny_models):
    """/metrics' paged:kernel_compiles: the engine's watch's count (0 without a watch)."""
    from paged import LLM

    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="16MiB")
    engine = llm.engine
    assert engine.metrics()["kernel_compiles"] == 0
    engine.compile_watch = compile_watch.watch_compiles()
    try:
        triton_compiles("_rotary_kernel")
        assert engine.metrics()["kernel_compiles"] == 1
    finally:
        engine.shutdown()
    assert engine.compile_watch is None and knobs.runtime.jit_post_compile_hook is None
