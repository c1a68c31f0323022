"""The CUDA plugin's measured choice between cuBLAS and the split-K GEMV for one-row dense
linears (paged_cuda.gemv_select): the candidate configs, the choice under given timings, and
the installed forward (the GEMV at one row, F.linear otherwise) on the interpreter. On a GPU
the timings are real: `paged bench latency` logs each shape's choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

gemv_select = pytest.importorskip("paged_cuda.gemv_select")


@pytest.mark.parametrize("n, k", [(2048, 4096), (128, 2048), (4096, 14336), (128256, 4096)])
def test_candidates_fill_the_gpu_without_tiny_slices(n, k):
    got = gemv_select.candidates(n, k)
    for block_n, block_k, split, _ in got:
        assert 128 <= -(-n // block_n) * split <= 2048 and k // split >= block_k
    assert (got == []) == (n == 128256)  # a head this wide is cuBLAS's already


def test_a_shape_takes_the_fastest_gemv_only_when_it_beats_cublas():
    shapes = {(2048, 4096): ["o"] * 3, (128, 2048): ["gate"] * 3, (8192, 4096): ["up"],
              (128256, 4096): ["head"]}  # fmt: skip
    cublas = {"o": 9e-6, "gate": 5e-6, "up": 20e-6}
    timed = []

    def time_cublas(mods):
        timed.append(mods[0])
        return cublas[mods[0]]

    def time_gemv(mods, config):
        if mods[0] == "up":  # never faster enough
            return 19.9e-6
        return {"o": 5e-6, "gate": 2e-6}[mods[0]] * (1 + config[2] / 100)  # split 1 fastest

    chosen = gemv_select.choose(shapes, time_cublas, time_gemv)
    assert set(chosen) == {(2048, 4096), (128, 2048)}
    assert timed == ["o", "gate", "up"]  # a shape with no candidate is not timed at all
    config, best, base = chosen[(2048, 4096)]
    assert base == 9e-6 and best == min(time_gemv(["o"], c)
                                        for c in gemv_select.candidates(2048, 4096))  # fmt: skip


def test_the_installed_forward_runs_the_gemv_at_one_row(device, monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(64, 40, bias=True).to(device)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    calls = []
    real = gemv_select.gemv_split_k
    monkeypatch.setattr(gemv_select, "gemv_split_k", lambda *a: calls.append(1) or real(*a))
    lin.forward = gemv_select.OneRowGemv(lin, (8, 32, 2, 4), counters)
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 64, device=device)
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            assert torch.allclose(lin(x), want, atol=1e-5, rtol=1e-5)
    assert calls == [1]  # the one-row call only
