"""Programmatic dependent launch (PDL, NVIDIA compute capability 9.0 and later).

Launched with PDL, a kernel's programs may start while the kernel before it in the stream is
still finishing, once every program of that one has called `griddepcontrol.launch_dependents`.
Until its `griddepcontrol.wait` returns, a program may read only what the kernel just before
it does not write (a weight; and what kernels two or more launches back wrote: in every
kernel here at least one program signals only after its own wait, so those completed before
this one could start; a program that exits early without waiting must leave another that
waits);
after it, everything earlier in the stream is complete and visible. This hides the launch gap
and the tail of each kernel in a chain of small decode kernels.

The kernels here take a `PDL` constexpr: `enter(PDL)` first (the wait, then the signal that
lets the next kernel start), and the launch passes `**launch()`. The CUDA platform turns it on
(`--cuda-pdl`) on GPUs that have it; elsewhere (the interpreter, ROCm, XPU) `PDL` is False and
nothing of this is compiled in. Every kernel launched with PDL waits before it writes or reads
anything another kernel writes, so it is safe after any kernel, with PDL or without.
"""

from __future__ import annotations

import triton
import triton.language as tl

_enabled = False
_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}


def enable(on: bool) -> None:
    """Launch the kernels of this package with PDL from now on (`on`), or without."""
    global _enabled
    _enabled = on


def launch() -> dict:
    """The keyword arguments of a launch: the kernel's PDL constexpr and Triton's launch option."""
    return _ON if _enabled else _OFF


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernels before this one, then let the next one start launching."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
