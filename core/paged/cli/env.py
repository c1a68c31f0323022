"""``paged env``: what a bug report needs: versions, system, platform, its options, plugins,
env vars."""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import sys
from importlib import metadata

PACKAGES = (
    "paged",
    "torch",
    "transformers",
    "tokenizers",
    "triton",
    "numpy",
    "pluggy",
    "fastapi",
    "uvicorn",
    "pydantic",
    "gguf",
    "safetensors",
    "openai",
)
ENV_PREFIXES = (
    "PAGED_",
    "CUDA_",
    "HIP_",
    "ROCR_",
    "ROCM_",
    "ZE_",
    "ONEAPI_",
    "TPU_",
    "XLA_",
    "PJRT_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "OMP_",
    "MKL_",
    "KMP_",
)
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    "PYTORCH_CUDA_ALLOC_CONF",
)
SECRET_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print versions, platform and settings for a bug report")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _memory() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return f"{total / (1 << 30):.1f} GiB"
    except (ValueError, OSError, AttributeError):
        return "unknown"


def _torch() -> dict[str, str]:
    import torch

    info = {"debug build": str(torch.version.debug)}
    for name in ("cuda", "hip", "xpu"):
        v = getattr(torch.version, name, None)
        if v:
            info[f"torch {name}"] = str(v)
    info["torch threads"] = str(torch.get_num_threads())
    return info


def _platforms() -> dict[str, str]:
    from paged.plugins import probe_platforms, select_platform

    out = {
        r.name: f"priority {r.priority}, "
        + ("available" if r.available else f"unavailable: {r.reason}")
        for r in probe_platforms()
    }
    try:
        plat = select_platform()
        out["selected"] = plat.name
        for k, v in plat.describe().items():
            out[f"{plat.name}.{k}"] = str(v)
    except Exception as e:  # an env report must not fail on the thing it reports
        out["selected"] = f"none ({type(e).__name__}: {e})"
    return out


def _platform_options() -> dict[str, str]:
    """Every platform's options: flag, default, and the environment variable read when the
    flag (or LLM argument) is not given, with its value here."""
    from paged.config import platform_options

    out = {}
    try:
        for platform, opt in platform_options().values():
            if isinstance(opt.default, bool):
                flag = f"--[no-]{opt.flag[2:]}"
            else:
                flag = f"{opt.flag} {{{','.join(opt.choices or ())}}}"
            fallback = "no env fallback"
            if opt.env:
                value = os.environ.get(opt.env)
                fallback = f"env fallback {opt.env}" + ("=" + value if value else " (unset)")
            out[flag] = f"{platform}, default {opt.default}; {fallback}"
    except Exception as e:  # an env report must not fail on the thing it reports
        out["(error)"] = f"{type(e).__name__}: {e}"
    return out or {"(none)": "no platform declares options"}


def _plugins() -> dict[str, str]:
    eps = metadata.entry_points(group="paged")
    out = {}
    for ep in eps:
        dist = ep.dist.name if ep.dist else "?"
        ver = ep.dist.version if ep.dist else "?"
        out[ep.name] = f"{ep.value} ({dist} {ver})"
    return out or {"(none)": "no plugins installed: pip install paged[cpu]"}


def _env_vars() -> dict[str, str]:
    out = {}
    for k, v in sorted(os.environ.items()):
        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES:
            secret = any(h in k for h in SECRET_HINTS)
            out[k] = "<set, hidden>" if secret else v
    return out or {"(none)": ""}


def collect() -> dict[str, dict[str, str]]:
    uname = pyplatform.uname()
    system = {
        "python": sys.version.split()[0] + f" ({sys.executable})",
        "os": f"{uname.system} {uname.release} ({pyplatform.platform()})",
        "machine": uname.machine,
        "cpu count": str(os.cpu_count()),
        "usable cpus": str(len(os.sched_getaffinity(0)))
        if hasattr(os, "sched_getaffinity")
        else "unknown",
        "memory": _memory(),
    }
    return {
        "versions": {p: _version(p) for p in PACKAGES},
        "system": system,
        "torch": _torch(),
        "platforms": _platforms(),
        "platform options (flags; LLM(name=...))": _platform_options(),
        "plugins (entry points 'paged')": _plugins(),
        "environment": _env_vars(),
    }


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for section, items in report.items():
        print(f"{section}:")
        width = max(len(k) for k in items)
        for k, v in items.items():
            print(f"  {k:<{width}}  {v}")
        print()
    return 0
