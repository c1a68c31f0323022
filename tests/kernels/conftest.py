"""Run the Triton kernels through the interpreter on machines without a GPU.

`TRITON_INTERPRET=0 pytest tests/kernels` runs the same tests on a CUDA device instead
(`PAGED_TEST_PDL=1` too: launched with programmatic dependent launch); tests/triton_interpreter.py.
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from triton_interpreter import device, interpret_unless_told  # noqa: F401 (device: a fixture)

interpret_unless_told()  # must precede the first `import triton`

_CORE = Path(__file__).resolve().parents[2] / "core"
if str(_CORE) not in sys.path:
    sys.path.insert(0, str(_CORE))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the interpreter, the bfloat16 half of a kernel test run in both float32 and
    bfloat16 joins the long checks (`make test-slow`, which CI runs too): `make test` keeps
    the float32 half and every test with no such pair. On a GPU both halves run as asked."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import torch

    here = Path(__file__).parent

    def dtypes(item: pytest.Item) -> set:
        spec = getattr(item, "callspec", None)
        return {v for v in spec.params.values() if isinstance(v, torch.dtype)} if spec else set()

    ours = [i for i in items if i.path.is_relative_to(here)]
    paired = {(i.path, i.originalname) for i in ours if torch.float32 in dtypes(i)}
    for item in ours:
        if torch.bfloat16 in dtypes(item) and (item.path, item.originalname) in paired:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def interpreter_only() -> None:
    """Tests that run the Triton kernels on CPU tensors (the engine on the cpu platform with
    the Triton backend): only under the interpreter; on a GPU, bench/gpu_check.py runs the
    engine with these kernels."""
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("the Triton kernels on CPU tensors: interpreter only")


@pytest.fixture
def reference_ops() -> Iterator[None]:
    """The torch reference op table for one test, whatever an earlier test's engine installed."""
    from paged.model import ops

    with ops.using({}):
        yield
