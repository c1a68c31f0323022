"""Quantized linears: the Triton kernels run in the interpreter on CPU (as tests/kernels)."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`


@pytest.fixture(scope="session")
def device() -> str:
    if os.environ["TRITON_INTERPRET"] == "1":
        return "cpu"
    import torch

    assert torch.cuda.is_available(), "TRITON_INTERPRET=0 needs a GPU"
    return "cuda"
