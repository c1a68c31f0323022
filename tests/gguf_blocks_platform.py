"""The CPU platform with a GGUF's block layers as the cuda plugin builds them
(paged.quantization.gguf.int_block_layer: torch reference ops, or the Triton kernels
interpreted), for tests that compare them with the dense load of the same file."""

from __future__ import annotations

from collections.abc import Callable


def blocks_platform(ops: Callable[[], dict] | None = None):
    """A CpuPlatform whose GGUF blocks are int_block_layer's, counted in `.replaced`; `ops`:
    the op table to use instead of the CPU plugin's."""
    from paged_cpu.platform import CpuPlatform

    class GgufBlocksOnCpu(CpuPlatform):
        name = "gguf-blocks-on-cpu"
        replaced = 0

        def gguf_block_layer(self, config):
            from paged.quantization.gguf import int_block_layer

            def make(*args):
                layer = int_block_layer(*args)
                self.replaced += layer is not None
                return layer

            return make

        def ops(self):
            return super().ops() if ops is None else ops()

    return GgufBlocksOnCpu()
