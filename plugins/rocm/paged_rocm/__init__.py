"""paged-rocm: the AMD ROCm (HIP) platform plugin for paged."""
