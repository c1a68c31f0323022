"""What tests/kernels and tests/quantization share: the Triton kernels run in the interpreter
on CPU tensors, or with `TRITON_INTERPRET=0` on a CUDA device (`PAGED_TEST_PDL=1` too: launched
with programmatic dependent launch, as the CUDA platform launches them: paged.kernels.pdl).

The interpreter, faster: before every call of a `@triton.jit` helper inside a kernel it patches
`triton.language` again, listing each module's members with `inspect.getmembers` to find the
builtins. The builtins never change, so here each module is listed once and the same members are
patched as before: same patching, same results. On the engine tests that run the GPU kernels
interpreted, the listing was about a quarter of the time (`tests/kernels` and
`tests/quantization`, `-n 2`: 256 s, 217 s with this). Where the interpreter's internals are not
the ones this expects (another Triton), nothing is changed."""

from __future__ import annotations

import inspect
import os

import pytest


def interpret_unless_told() -> None:
    """TRITON_INTERPRET=1 unless set; call before the first `import triton`."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        memoize_builtin_listing()


def memoize_builtin_listing() -> bool:
    """Install the memoized listing; whether it is installed."""
    try:
        from triton.runtime import interpreter as interp

        original, patch_attr = interp._patch_builtin, interp._patch_attr
        is_builtin = interp.tl.core.is_builtin
    except (ImportError, AttributeError):
        return False
    if getattr(original, "memoized", False):
        return True
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False
    builtins: dict[object, list[tuple[str, object]]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        found = builtins.get(pkg)
        if found is None:  # first listed by a kernel's launch, before anything is patched
            found = builtins[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        for name, member in found:
            patch_attr(pkg, name, member, builder, scope)

    patch_builtin.memoized = True
    interp._patch_builtin = patch_builtin
    return True


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernels' tensors live: "cpu" under the interpreter, else "cuda"."""
    if os.environ["TRITON_INTERPRET"] == "1":
        return "cpu"
    import torch

    assert torch.cuda.is_available(), "TRITON_INTERPRET=0 needs a GPU"
    if os.environ.get("PAGED_TEST_PDL") == "1":
        from paged.kernels import pdl

        pdl.enable(True)
    return "cuda"
