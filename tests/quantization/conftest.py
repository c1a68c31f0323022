"""Quantized linears: the Triton kernels run in the interpreter on CPU (as tests/kernels)."""

import pytest
from triton_interpreter import device, interpret_unless_told  # noqa: F401 (device: a fixture)

interpret_unless_told()  # must precede the first `import triton`


@pytest.fixture(scope="session")
def int4_models(tmp_path_factory) -> dict[str, str]:
    """Tiny AWQ and GPTQ checkpoints and their dequantized float references (-ref)."""
    from quant_ckpt import QCONFIG, dequantized_model, quant_int4, rewrite, tiny_int4_llama

    root = tmp_path_factory.mktemp("int4")
    src = tiny_int4_llama(str(root / "float"))
    out = {}
    for kind in ("awq", "gptq"):
        ref = rewrite(src, str(root / kind), quant_int4(kind), QCONFIG[kind])
        out[kind] = str(root / kind)
        out[f"{kind}-ref"] = dequantized_model(src, str(root / f"{kind}-ref"), ref)
    return out
