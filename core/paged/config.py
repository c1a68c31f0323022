"""Engine configuration: one dataclass is the single source of CLI flags and API kwargs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

import torch

from paged.quantization.select import CHOICES as QUANTIZATION_CHOICES
from paged.quantization.select import check_flag as check_quantization

if TYPE_CHECKING:
    from paged.platform import PlatformOption

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# --kv-cache-dtype: quantized storage of the paged KV cache (vLLM's spelling); auto = model dtype.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# --chat-template: what makes a value inline Jinja rather than a file path (as vLLM tells them)
JINJA_MARKERS = ("{{", "{%")
# Counts that are None (the platform's or the model's default) or at least 1: 0 is refused,
# not read as unset.
_POSITIVE = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
             "kv_cache_memory")  # fmt: skip
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str | int | None) -> int | None:
    """'4GiB', '512M', '1073741824' -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"invalid size {text!r}: use e.g. 4GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def json_dict(text: str | dict | None) -> dict | None:
    """A JSON object given on the command line (or already a dict)."""
    if text is None or isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON {text[:100]!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text[:100]!r}")
    return value


def _opt(help: str, **kw: Any) -> Any:
    default = kw.pop("default", None)
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    model: str | None = _opt(
        "HF model directory, .gguf file or Hugging Face Hub id (org/name, org/name:Q4_K_M for "
        "a GGUF repo) (default: SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = _opt("tokenizer directory, if not the model's")
    revision: str | None = _opt("Hub model: branch, tag or commit (default: main)")
    download_dir: str | None = _opt("Hub model: cache directory (default: the HF_HUB_CACHE)")
    trust_remote_code: bool = _opt("refused: paged never runs code from a model", default=False)
    dtype: str = _opt("float32 | bfloat16 | float16 | auto (the platform's choice)", default="auto")
    load_format: str = _opt(
        "auto | safetensors | gguf | dummy (random weights; the config is enough)",
        default="auto", choices=("auto", "safetensors", "gguf", "dummy"),
    )
    quantization: str | None = _opt(
        "weight quantization: fp8 (a float checkpoint quantized at load: fp8 weights scaled per "
        "output channel, activations per token) | awq | gptq | compressed-tensors | none "
        "(default: the checkpoint's quantization_config)",
        choices=QUANTIZATION_CHOICES,
    )
    platform: str | None = _opt("force a platform (also PAGED_PLATFORM)")
    max_model_len: int | None = _opt("context length (default: the model's)", type=int)
    block_size: int = _opt("tokens per KV cache block", default=16, type=int)
    kv_cache_dtype: str = _opt(
        "KV cache storage: auto (the model dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2; fp8 "
        "holds twice the tokens, scaled per tensor (1.0, or the checkpoint's k_scale/v_scale)",
        default="auto", choices=tuple(KV_CACHE_DTYPES),
    )
    kv_cache_memory: int | None = _opt("KV cache size, e.g. 2GiB", type=parse_bytes)
    gpu_memory_utilization: float = _opt(
        "fraction of device memory for weights, activations and KV cache", default=0.9, type=float
    )
    num_kv_blocks: int | None = _opt("exact number of KV cache blocks (overrides sizes)", type=int)
    max_num_seqs: int | None = _opt(
        "most requests in one step (default: the platform's: 512 on GPUs, 256 on CPUs)", type=int
    )
    max_num_batched_tokens: int | None = _opt(
        "most tokens in one step (default: the platform's: 8192 on GPUs, 2048 on CPUs)", type=int
    )
    enable_prefix_caching: bool = _opt("reuse KV blocks of shared prefixes", default=True)
    enforce_eager: bool = _opt("disable graph capture", default=False)
    prefill_graphs: bool = _opt(
        "with graphs: also capture steps with prompt chunks (up to 2048 tokens and 64 "
        "requests on GPUs), padded to the nearest captured token count; otherwise they run "
        "eagerly", default=True,
    )
    async_scheduling: bool | None = _opt(
        "schedule and launch each step before the previous step's tokens reach the host, "
        "hiding host work behind the device (default: the platform's choice)"
    )
    late_launch: bool = _opt(
        "with async scheduling, a server schedules each step shortly before the device ends "
        "the one in flight (from measured step times), so that requests arriving meanwhile "
        "join it: a shorter time to first token", default=True,
    )
    kernel_warmup: bool | None = _opt(
        "at start-up, run synthetic requests through the step loop so that kernels compile "
        "before the first request (default: the platform's choice: on for GPUs)"
    )
    seed: int = _opt(
        "seed for weights of --load-format dummy and unseeded sampling", default=0, type=int
    )
    tensor_parallel_size: int = _opt(
        "devices one model is split over, by attention heads and MLP columns (one process "
        "each)", default=1, type=int, aliases=("-tp",)
    )
    pipeline_parallel_size: int = _opt(
        "stages the layers are split into (one process group each)", default=1, type=int,
        aliases=("-pp",),
    )
    pipeline_micro_batches: int = _opt(
        "with pipeline stages: micro-batches a step's requests are split into, so that stages "
        "work at once (0: two per stage; 1: stages one after another)", default=0, type=int
    )
    data_parallel_size: int = _opt(
        "engine replicas behind one server, each with its own devices", default=1, type=int,
        aliases=("-dp",),
    )
    distributed_executor_backend: str = _opt(
        "how worker processes start: mp (this host) | ray (a Ray cluster, across nodes)",
        default="mp",
    )
    served_model_name: list | None = _opt(
        "the model's names in the API: requests may use any, responses report the first "
        "(default: the model's own name)",
        nargs="+",
    )
    chat_template: str | None = _opt(
        "a Jinja chat template: a file path, or the template text itself (which must hold "
        "Jinja tags: a path that cannot be read is refused, not taken for a template)"
    )
    runner: str = _opt(
        "auto | generate | pooling (embeddings: /v1/embeddings, LLM.embed); auto: pooling for "
        "a checkpoint without an LM head or a sentence-transformers model", default="auto",
        choices=("auto", "generate", "pooling"),
    )
    pooler_config: str | dict | None = _opt(
        'pooling override, JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}'
    )
    speculative_config: Any = _opt(
        'speculative decoding, JSON (vLLM\'s): {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}, a draft model {"model": PATH, '
        '"num_speculative_tokens": 4} or an EAGLE head {"method": "eagle" | "eagle3", '
        '"model": PATH, "num_speculative_tokens": 4} (docs/speculative.md)'
    )
    structured_outputs_backend: str = _opt(
        "grammar backend of structured outputs: xgrammar | auto (xgrammar) | llguidance "
        "(when installed)",
        default="auto",
    )
    # vLLM's spellings (docs/cli.md): each is honoured or refused with the reason.
    structured_outputs_config: dict | None = _opt(
        'vLLM\'s JSON form of --structured-outputs-backend: {"backend": "xgrammar"}',
    )
    enable_chunked_prefill: bool = _opt(
        "split prompts longer than --max-num-batched-tokens into chunks (always on: "
        "--no-enable-chunked-prefill is refused)", default=True
    )
    swap_space: float | None = _opt(
        "refused above 0: paged frees a preempted request's KV blocks and recomputes them, it "
        "has no CPU swap space", type=float
    )
    max_logprobs: int = _opt(
        "most logprobs / prompt_logprobs one request may ask for (0-20)", default=20, type=int
    )
    generation_config: str = _opt(
        "sampling defaults for what a request leaves unset: auto (the model's "
        "generation_config.json), vllm (none) or a folder holding a generation_config.json",
        default="auto",
    )
    override_generation_config: dict | None = _opt(
        'JSON generation-config keys applied over --generation-config, e.g. '
        '{"temperature": 0.5, "max_new_tokens": 256}'
    )
    enable_lora: bool = _opt(
        "serve LoRA adapters (PEFT format) on top of the model (docs/lora.md)", default=False
    )
    lora_modules: list | None = _opt(
        "adapters served from the start: name=path ... or vLLM's JSON objects "
        '{"name": "a", "path": "/dir"} (needs --enable-lora)',
        nargs="+",
    )
    max_loras: int = _opt("LoRA adapters one step may use (device slots)", default=1, type=int)
    max_lora_rank: int = _opt("largest LoRA rank accepted (slot size)", default=16, type=int)
    max_cpu_loras: int | None = _opt(
        "LoRA adapters kept in host memory (default: --max-loras)", type=int
    )
    # The platforms' own options set explicitly ({"cpu_native": False}): their flags, LLM
    # keyword arguments; the platform falls back to each option's env variable, then default.
    platform_options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if isinstance(self.dtype, torch.dtype):  # LLM(dtype=torch.float16), as vLLM takes it
            self.dtype = str(self.dtype).removeprefix("torch.")
        _check_numbers(self)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype: must be one of auto, {', '.join(_DTYPES)}, got {self.dtype!r}"
            )
        # the template's text from here on (the engine's processes, on other nodes too, need
        # not see the file); a path that cannot be read is refused now
        self.chat_template = read_chat_template(self.chat_template)
        if self.trust_remote_code:
            raise ValueError(
                "trust_remote_code: paged never runs code from a model repository; "
                "`paged models` lists the architectures it implements"
            )
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}"
            )
        check_quantization(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_parallel(self)
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be mp or ray")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        from paged.model.pooling_config import RUNNERS, parse_pooler_config

        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.runner == "pooling" and self.pipeline_parallel_size > 1:
            raise ValueError("runner: pooling (embeddings) is not supported with "
                             "pipeline_parallel_size > 1")  # fmt: skip
        parse_pooler_config(self.pooler_config)
        from paged.sampling.structured import check_backend

        _check_vllm_flags(self)
        check_backend(self.structured_outputs_backend)
        _check_speculative(self)
        _check_names(self)
        _check_lora(self)
        if self.platform_options:
            known = platform_options()
            for name in self.platform_options:
                if name not in known:
                    raise ValueError(
                        f"unknown engine argument or platform option {name!r} (platform "
                        f"options: {', '.join(sorted(known)) or 'none installed'})"
                    )
            self.platform_options = {
                k: known[k][1].check(v) for k, v in self.platform_options.items()
            }

    @property
    def world_size(self) -> int:
        """Processes one engine replica runs on: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: float32, bfloat16, float16 or auto")
        return _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype the KV cache is stored in: the model dtype unless quantized."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help = f.metadata.get("help", "")
            if not f.metadata.get("cli", True):
                continue
            if f.name == "model" and positional_model:
                parser.add_argument("model", nargs="?", default=None, help=help)
                parser.add_argument(
                    "--model", dest="model_flag", default=None, metavar="MODEL",
                    help="the model as a flag (vLLM's spelling): the same as the argument",
                )
            elif f.type in ("bool", bool, "bool | None"):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help
                )
            else:
                parser.add_argument(
                    flag,
                    *f.metadata.get("aliases", ()),
                    type=f.metadata.get("type", str),
                    choices=f.metadata.get("choices"),
                    nargs=f.metadata.get("nargs"),
                    default=f.default,
                    help=help,
                    dest=f.name,
                )
        groups: dict[str, argparse._ArgumentGroup] = {}
        for name, (platform, opt) in platform_options().items():  # unset: None
            if platform not in groups:
                groups[platform] = parser.add_argument_group(f"{platform} platform options")
            fallback = f"; env fallback {opt.env}" if opt.env else ""
            help = f"{opt.help} (default: {opt.default}{fallback})".replace("%", "%%")
            if isinstance(opt.default, bool):
                action = argparse.BooleanOptionalAction
                groups[platform].add_argument(opt.flag, action=action, default=None, help=help)
            else:
                groups[platform].add_argument(
                    opt.flag, choices=opt.choices, default=None, help=help, dest=name
                )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
        values = vars(args)
        options = {k: values[k] for k in platform_options() if values.get(k) is not None}
        kwargs = {k: v for k, v in values.items() if k in names}
        if values.get("model_flag") is not None:  # --model, vLLM's spelling
            if kwargs.get("model") not in (None, values["model_flag"]):
                raise ValueError("model: given both as the argument and as --model")
            kwargs["model"] = values["model_flag"]
        return cls(**kwargs, platform_options=options)


def read_chat_template(template: str | None) -> str | None:
    """--chat-template: the value itself when it is inline Jinja, else the text of the file it
    names. A value without Jinja syntax that is no readable file, or a file without Jinja
    syntax, is refused (ValueError), as vLLM does."""
    if template is None:
        return None
    if not isinstance(template, str):
        raise ValueError(f"chat_template: expected a file path or Jinja text, got "
                         f"{type(template).__name__}")  # fmt: skip
    if any(m in template for m in JINJA_MARKERS):
        return template
    try:
        with open(template, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as e:  # missing, a folder, unreadable, not UTF-8
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(
            f"chat_template: cannot read the file {template[:200]!r} ({why}); an inline "
            "template needs Jinja syntax ({{ ... }} or {% ... %})"
        ) from None
    if not any(m in text for m in JINJA_MARKERS):
        raise ValueError(f"chat_template: the file {template[:200]!r} holds no Jinja syntax "
                         "({{ ... }} or {% ... %}): not a chat template")  # fmt: skip
    return text


def _check_numbers(c: EngineConfig) -> None:
    """Integer and float fields hold numbers (LLM() passes values as given), the counts of
    _POSITIVE are at least 1 when set, and the seed fits torch's generators."""
    for f in dataclasses.fields(c):
        kind, value = f.metadata.get("type"), getattr(c, f.name)
        optional = f.type == "bool | None" and value is None
        if f.type in ("bool", "bool | None") and not isinstance(value, bool) and not optional:
            raise ValueError(f"{f.name}: must be True or False, got {value!r}")
        if f.type == "str" and not isinstance(value, str):
            raise ValueError(f"{f.name}: must be a string, got {value!r}")
        if kind not in (int, float) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, Integral if kind is int else Real):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{f.name}: must be {what}, got {value!r}")
    for name in _POSITIVE:
        value = getattr(c, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}: must be at least 1 (leave it unset for the default), "
                             f"got {value}")  # fmt: skip
    check_batch(c.max_num_seqs, c.max_num_batched_tokens)
    if not -(1 << 63) <= c.seed < 1 << 64:  # what torch.manual_seed takes
        raise ValueError(f"seed: must fit in 64 bits, got {c.seed}")


def _check_parallel(c: EngineConfig) -> None:
    """The parallel sizes, and what cannot run on more than one rank of a replica (what the
    model's config.json rules out, serving_stack.check_model and resolve_config refuse)."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(c, name) < 1:
            raise ValueError(f"{name} must be at least 1")
    if c.pipeline_micro_batches < 0:
        raise ValueError("pipeline_micro_batches must be >= 0 (0: two per stage)")
    if c.world_size > 1 and c.async_scheduling:
        raise ValueError(
            f"async_scheduling: not supported with more than one rank yet (tensor_parallel_size "
            f"{c.tensor_parallel_size} x pipeline_parallel_size {c.pipeline_parallel_size}): "
            "the other ranks cannot read the driver's sampled tokens; leave it unset"
        )


def check_batch(max_num_seqs: int | None, max_num_batched_tokens: int | None) -> None:
    """vLLM's rule: a step must fit one token of each of its max_num_seqs requests."""
    if max_num_seqs and max_num_batched_tokens and max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens: {max_num_batched_tokens} is less than max_num_seqs "
            f"({max_num_seqs}): a step cannot hold one token of each request"
        )


# config.json keys of a model's context length (vLLM's): the least of them applies
_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
             "max_sequence_length", "max_seq_length", "seq_len")  # fmt: skip


def model_max_len(hf_config: Any) -> tuple[int | None, str]:
    """(the model's maximum context length, where it comes from), derived as vLLM does: the
    least length key, times rope scaling's factor (of original_max_position_embeddings for
    yarn) unless the key already counts it (llama3, longrope); (None, "") without a key."""
    found = [(v, k) for k in _LEN_KEYS if isinstance(v := getattr(hf_config, k, None), int)]
    if not found:
        return None, ""
    length, why = min(found)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    if not isinstance(rope, dict):  # none (or per-layer-type parameters)
        return length, why
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    if kind in (None, "default", "su", "longrope", "llama3", "mrope") or not factor:
        return length, why
    if kind == "yarn" and rope.get("original_max_position_embeddings"):
        length, why = rope["original_max_position_embeddings"], "original_max_position_embeddings"
    return int(length * factor), f"{why} x rope_scaling factor {factor}"


def check_max_model_len(max_model_len: int | None, hf_config: Any) -> None:
    """Refuse a max_model_len above the model's (vLLM's message)."""
    limit, why = model_max_len(hf_config)
    if max_model_len is not None and limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len: {max_model_len} is greater than the model's maximum "
                         f"context length {limit} ({why})")  # fmt: skip


def _check_speculative(c: EngineConfig) -> None:
    """Parse --speculative-config (JSON text or a dict) and refuse what cannot combine."""
    from paged.spec_decode.config import SpeculativeConfig

    spec = c.speculative_config = SpeculativeConfig.parse(c.speculative_config)
    if spec is None:
        return
    if spec.method in ("draft_model", "eagle", "eagle3") and c.world_size > 1:
        what = "a draft model" if spec.method == "draft_model" else "an EAGLE head"
        raise ValueError(
            f"speculative_config: {what} needs tensor_parallel_size and "
            "pipeline_parallel_size 1 (n-gram proposals work with any)"
        )


def platform_options() -> dict[str, tuple[str, PlatformOption]]:
    """{option name: (platform name, option)} of every installed platform, in plugin order."""
    from paged.plugins import all_platforms

    out: dict[str, tuple[str, PlatformOption]] = {}
    for cls in all_platforms():
        for opt in cls.options:
            out.setdefault(opt.name, (cls.name, opt))
    return out


# vLLM's structured_outputs_config backends -> ours (check_backend refuses what paged lacks)
_SO_BACKENDS = {"auto": "auto", "xgrammar": "xgrammar", "guidance": "llguidance"}


def _check_vllm_flags(c: EngineConfig) -> None:
    """vLLM's flags: honoured (mapped onto ours), or a ValueError saying why not."""
    if not c.enable_chunked_prefill:
        raise ValueError(
            "enable_chunked_prefill: paged always splits prompts longer than "
            "max_num_batched_tokens into chunks; it cannot be turned off"
        )
    if c.swap_space:
        raise ValueError(
            "swap_space: paged has no CPU swap space: a preempted request's KV blocks are freed "
            "and recomputed when it resumes (its output is unchanged); leave it unset or 0"
        )
    if not 0 <= c.max_logprobs <= 20:
        raise ValueError(f"max_logprobs: must be in [0, 20] (paged returns at most 20 "
                         f"logprobs per token), got {c.max_logprobs}")  # fmt: skip
    c.structured_outputs_config = _json_field(c, "structured_outputs_config")
    so = dict(c.structured_outputs_config or {})
    if "backend" in so:
        backend = so.pop("backend")
        if backend not in _SO_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend: {backend!r} is not one of "
                f"{', '.join(_SO_BACKENDS)} (outlines and lm-format-enforcer are not supported)"
            )
        c.structured_outputs_backend = _SO_BACKENDS[backend]
    if so:
        raise ValueError(
            f"structured_outputs_config: {', '.join(sorted(so))}: not supported (only "
            "backend; disable_any_whitespace is a per-request field of structured_outputs)"
        )
    from paged.engine.generation_config import check_generation_flags

    c.override_generation_config = _json_field(c, "override_generation_config")
    check_generation_flags(c.generation_config, c.override_generation_config)


def _json_field(c: EngineConfig, name: str) -> dict | None:
    """A JSON-object field (text from the command line, or a dict); ValueError naming it."""
    try:
        return json_dict(getattr(c, name))
    except (ValueError, TypeError) as e:
        why = "must be a JSON object" if "expected a JSON object" in str(e) else str(e)
        raise ValueError(f"{name}: {why}") from None


def _check_names(c: EngineConfig) -> None:
    """--served-model-name: one name (a string, as LLM() takes it) or several, none empty."""
    names = c.served_model_name
    if isinstance(names, str):
        names = [names]
    if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
        raise ValueError("served_model_name: names must be non-empty strings")
    if names and len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"served_model_name: {dup!r} is given more than once")
    c.served_model_name = list(names) if names else None


def _check_lora(c: EngineConfig) -> None:
    """The LoRA flags: consistent, and on an engine that can serve them."""
    from paged.lora.request import parse_lora_modules

    if c.max_loras < 1 or c.max_lora_rank < 1:
        raise ValueError("max_loras and max_lora_rank must be at least 1")
    if c.max_cpu_loras is not None and c.max_cpu_loras < c.max_loras:
        raise ValueError(f"max_cpu_loras ({c.max_cpu_loras}) must be >= max_loras ({c.max_loras})")
    if c.enable_lora and c.pipeline_parallel_size > 1 and c.pipeline_micro_batches > 1:
        raise ValueError(
            "pipeline_micro_batches: with --enable-lora a step goes through the pipeline stages "
            "as one group (its LoRA token slots describe the whole step); leave it 0 or 1"
        )
    c.lora_modules = parse_lora_modules(c.lora_modules)
    if c.lora_modules and not c.enable_lora:
        raise ValueError("lora_modules: LoRA adapters need --enable-lora")
    if not c.enable_lora:  # set without LoRA: not silently ignored
        defaults = {f.name: f.default for f in dataclasses.fields(c)}
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(c, name) != defaults[name]:
                raise ValueError(f"{name}: applies to LoRA adapters only: it needs --enable-lora")
