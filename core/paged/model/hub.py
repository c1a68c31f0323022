"""Hugging Face Hub ids resolved to local files through `huggingface_hub`'s cache.

`org/name` is a safetensors repo (config, tokenizer and weight files only); `org/name:Q4_K_M`
or `org/name:file.gguf` picks one GGUF file of a repo (a repo holding a single GGUF and no
config.json needs no tag). The cache is read first, with no network; a missing model is
downloaded (huggingface_hub's progress bar) unless HF_HUB_OFFLINE is set, which gives one
error naming the id and the cache path. No code from a repository ever runs.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from paged.model.loader import ModelLoadError, _show

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.+-]+))?")
# What an HF model needs besides its weights: config, generation config, tokenizer files.
CONFIG_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
WEIGHT_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]
_TRUTHY = {"1", "on", "yes", "true"}


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, GGUF tag or None) when `model` reads as `org/name[:tag]`, else None."""
    m = _HUB_ID.fullmatch(model)
    if m is None or ".." in m["repo"] or m["repo"].lower().endswith((".gguf", ".safetensors")):
        return None  # a missing file, not a repo
    return m["repo"], m["tag"]


def hub_cache_dir(download_dir: str | None = None) -> str:
    """Where models are cached: --download-dir, else HF_HUB_CACHE / HF_HOME (read now)."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return os.path.expanduser(env)
    if home := os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(home), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY or bool(
        constants.HF_HUB_OFFLINE
    )


def resolve_hub(
    model: str, load_format: str = "auto", revision: str | None = None,
    download_dir: str | None = None,
) -> str:  # fmt: skip
    """The local snapshot directory (HF) or .gguf file (GGUF) of hub id `model`."""
    parsed = parse_hub_id(model)
    if parsed is None:
        raise ModelLoadError(f"{_show(model)} is not a Hugging Face Hub id (org/name)")
    repo, tag = parsed
    cache = hub_cache_dir(download_dir)
    rev = revision or "main"
    gguf = tag is not None or load_format == "gguf"
    snapshot = _cached_snapshot(repo, revision, cache)
    if snapshot is not None:
        found = _usable(snapshot, repo, tag, gguf, load_format)
        if found is not None:
            return found
    if hub_offline():
        where = "is neither a local path nor" if snapshot is None else "is incomplete"
        raise ModelLoadError(
            f"model {_show(model)} (revision {rev}) {where} in the Hugging Face cache at "
            f"{_show(cache)} and HF_HUB_OFFLINE is set: fetch it first where the Hub is "
            f"reachable (`hf download {repo}`), or pass a local directory or .gguf file"
        )
    return _download(model, repo, tag, gguf, load_format, revision, cache)


def _cached_snapshot(repo: str, revision: str | None, cache: str) -> str | None:
    """The cached snapshot folder of the revision (a branch, tag or commit), no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # no patterns: only find the folder; what it holds is checked by _usable
        return snapshot_download(
            repo, revision=revision, cache_dir=cache, local_files_only=True, allow_patterns=[]
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def _usable(snapshot: str, repo: str, tag: str | None, gguf: bool, load_format: str) -> str | None:
    """The path to load from this snapshot, or None when it lacks files the load needs."""
    root = Path(snapshot)
    ggufs = sorted(str(p.relative_to(root)) for p in root.rglob("*.gguf"))
    if not gguf and not (root / "config.json").is_file() and ggufs:
        gguf = True  # a GGUF-only repo
    if gguf:
        if not ggufs:
            return None
        return str(root / pick_gguf(ggufs, repo, tag))
    if not (root / "config.json").is_file():
        return None
    if load_format == "dummy":
        return snapshot
    from paged.model.hf_loader import safetensors_files

    try:
        safetensors_files(snapshot)
    except ModelLoadError:
        return None
    return snapshot


def pick_gguf(names: list[str], repo: str, tag: str | None) -> str:
    """The one GGUF file of `names` that `tag` (a file name or quant type) selects."""
    if tag is None:
        match = names
    elif tag.lower().endswith(".gguf"):
        match = [n for n in names if n == tag or os.path.basename(n) == tag]
    else:
        quant = re.compile(rf"[.-]{re.escape(tag)}\.gguf$", re.IGNORECASE)
        match = [n for n in names if quant.search(os.path.basename(n))]
    if len(match) == 1:
        return match[0]
    choices = ", ".join(names[:12]) or "none"
    if not match:
        what = f"no GGUF file matching {_show(tag)}" if tag else "no GGUF file"
        raise ModelLoadError(f"{_show(repo)} has {what} (GGUF files: {choices})")
    raise ModelLoadError(
        f"{_show(repo)} has several GGUF files{f' matching {_show(tag)}' if tag else ''}: "
        f"choose one as {repo}:FILE or {repo}:QUANT ({choices})"
    )


def _download(
    model: str, repo: str, tag: str | None, gguf: bool, load_format: str,
    revision: str | None, cache: str,
) -> str:  # fmt: skip
    """Fetch what the load needs into the cache (huggingface_hub shows the progress)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    log.info("downloading %s (revision %s) into %s", model, revision or "main", cache)
    try:
        files = HfApi().list_repo_files(repo, revision=revision)
        ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
        if gguf or ("config.json" not in files and ggufs):
            name = pick_gguf(ggufs, repo, tag)
            return hf_hub_download(repo, name, revision=revision, cache_dir=cache)
        if "config.json" not in files:
            raise ModelLoadError(f"Hub repo {_show(repo)} has neither config.json nor GGUF files")
        patterns = CONFIG_PATTERNS + ([] if load_format == "dummy" else WEIGHT_PATTERNS)
        return snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=patterns)
    except RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"model {_show(model)} is neither a local path nor a Hub repo paged can reach "
            f"(private repos need HF_TOKEN)"
        ) from e
    except ModelLoadError:
        raise
    except Exception as e:  # HTTP, network and disk errors alike: name the model and cache
        raise ModelLoadError(
            f"cannot download model {_show(model)} into {_show(cache)}: {str(e)[:300]}"
        ) from e
