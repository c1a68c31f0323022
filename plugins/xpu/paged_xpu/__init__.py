"""paged-xpu: the Intel GPU (XPU) platform plugin for paged."""
