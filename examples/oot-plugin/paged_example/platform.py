"""A platform for the host CPU with this plugin's own attention backend.

It ranks below the built-in cpu platform, so installing it changes nothing until it is forced
with `PAGED_PLATFORM=example` (or `--platform example`).
"""

from __future__ import annotations

import os

import torch

from paged.hookspecs import PLUGIN_API_VERSION
from paged.platform import Platform

BUILT_FOR_API = 1  # the PLUGIN_API_VERSION this plugin was written against


class ExamplePlatform(Platform):
    name = "example"
    device_type = "cpu"
    priority = 5  # the built-in cpu platform is 10: never chosen unless forced
    dist_backend = "gloo"
    supported_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def probe(cls) -> str | None:
        if PLUGIN_API_VERSION != BUILT_FOR_API:
            return f"built for plugin API {BUILT_FOR_API}, paged has {PLUGIN_API_VERSION}"
        return None

    def memory(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def check_config(self, config) -> None:
        super().check_config(config)  # refuses dtypes outside supported_dtypes
        if config.max_num_seqs > 64:
            config.max_num_seqs = 64  # adjust: one Python loop per sequence per layer

    def kv_cache_budget(self, config) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        free, _ = self.memory()
        return min(256 << 20, free // 8)  # host RAM is shared with everything else

    def attention_backend(self):
        from paged_example.attention import GatherAttentionBackend

        return GatherAttentionBackend

    def describe(self) -> dict[str, str]:
        return {"threads": str(torch.get_num_threads()), "plugin_api": str(PLUGIN_API_VERSION)}
