"""paged-cuda: the NVIDIA CUDA platform plugin for paged."""
