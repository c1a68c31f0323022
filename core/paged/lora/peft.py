"""PEFT LoRA adapters on disk: `adapter_config.json` and `adapter_model.safetensors` (or
`adapter_model.bin`), as `peft.PeftModel.save_pretrained` writes them.

Supported: LoRA on the decoder layers' q/k/v/o and gate/up/down projections, any rank up to
--max-lora-rank, `lora_alpha`, `use_rslora`. Refused with a message naming what: DoRA,
`modules_to_save`, trained biases, embedding / lm_head LoRA, per-module rank or alpha
patterns, other PEFT types and any tensor that is not one of the above.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused projections as some checkpoints hold them (Phi-3): one LoRA over the stacked output
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join((*TARGETS, *FUSED))
    + r")\.lora_([AB])"
    r"(?:\.default)?\.weight"
)
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ValueError):
    """An adapter that cannot be used (the message says why)."""


@dataclass
class AdapterSpec:
    """What an adapter holds, read without its tensor data."""

    path: str
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    weights_file: str
    # (layer, module) -> (A shape [r, in], B shape [out, r])
    shapes: dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict
    )

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.shapes}


def _config(path: str) -> dict:
    if not os.path.isdir(path):
        raise AdapterError(f"lora_path: {path!r} is not a directory")
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise AdapterError(f"lora_path: no adapter_config.json in {path!r} (a PEFT adapter)")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"lora_path: cannot read {cfg_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"lora_path: {cfg_file} is not a JSON object")
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a supported LoRA config; AdapterError naming what is not supported."""
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"adapter: peft_type {kind!r} is not supported (LoRA only)")
    if cfg.get("use_dora"):
        raise AdapterError("adapter: DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"adapter: modules_to_save {cfg['modules_to_save']} is not supported (only LoRA "
            "matrices on the attention and MLP projections)"
        )
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError("adapter: fan_in_fan_out is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"adapter: {key} (per-module ranks or alphas) is not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets] if targets in (*TARGETS, *FUSED, "all-linear") else []
    known = (*TARGETS, *FUSED, "all-linear")
    bad = [t for t in targets if t.split(".")[-1] not in known]
    if bad:
        raise AdapterError(
            f"adapter: target modules {bad} are not supported (supported: "
            f"{', '.join((*TARGETS, *FUSED))}; no embedding or lm_head LoRA)"
        )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"adapter: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"adapter: rank {r} exceeds --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def _weights_file(path: str) -> str:
    for name in WEIGHT_FILES:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    raise AdapterError(f"lora_path: no {' or '.join(WEIGHT_FILES)} in {path!r}")


def _read(file: str, data: bool) -> dict[str, torch.Tensor | tuple[int, ...]]:
    """{name: tensor} (data) or {name: shape}."""
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, "pt") as f:
                if data:
                    return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated or foreign file
        raise AdapterError(f"lora_path: cannot read {file}: {e}") from None
    return state if data else {k: tuple(v.shape) for k, v in state.items()}


def read_spec(path: str, max_rank: int) -> AdapterSpec:
    """The adapter's rank, scale and tensor shapes, checked against what paged supports."""
    path = os.path.abspath(os.path.expanduser(path))
    rank, scale = _check_config(_config(path), max_rank)
    file = _weights_file(path)
    spec = AdapterSpec(path, rank, scale, file)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for name, shape in _read(file, data=False).items():
        if "lora_magnitude_vector" in name:
            raise AdapterError("adapter: DoRA (lora_magnitude_vector) is not supported")
        m = _KEY.fullmatch(name)
        if m is None:
            raise AdapterError(
                f"adapter: tensor {name!r} is not supported (only lora_A/lora_B of "
                f"{', '.join(TARGETS)} in the decoder layers)"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = shape
    if not pairs:
        raise AdapterError(f"adapter: {file} holds no LoRA tensors")
    for layer, mod in pairs:
        if mod in FUSED and any((layer, part) in pairs for part in FUSED[mod]):
            raise AdapterError(f"adapter: layer {layer} has LoRA on {mod} and on its parts")
    for key, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter: layer {key[0]} {key[1]} has lora_A or lora_B only")
        a, b = ab["A"], ab["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterError(
                f"adapter: layer {key[0]} {key[1]}: lora_A {a}, lora_B {b} do not have rank {rank}"
            )
        spec.shapes[key] = (a, b)
    return spec


def check_shapes(spec: AdapterSpec, expected: dict[str, tuple[int, int]], num_layers: int) -> None:
    """AdapterError unless every module is one the model applies LoRA to and has its shape:
    `expected` {module: (in features, out features)} of the whole (unsharded) model."""
    for (layer, mod), (a, b) in sorted(spec.shapes.items()):
        if layer >= num_layers:
            raise AdapterError(f"adapter: layer {layer}, but the model has {num_layers} layers")
        if mod not in expected:
            raise AdapterError(
                f"adapter: LoRA on {mod} is not supported for this model (supported: "
                f"{', '.join(m for m in (*TARGETS, *FUSED) if m in expected)})"
            )
        fin, fout = expected[mod]
        if a[1] != fin or b[0] != fout:
            raise AdapterError(
                f"adapter: layer {layer} {mod}: lora_A {a} / lora_B {b} do not fit the model's "
                f"{fin} -> {fout} projection (an adapter for another model?)"
            )


# projections that read the residual stream (the rest write it: o_proj, down_proj)
READS_HIDDEN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", *FUSED}


def check_fits(spec: AdapterSpec, hidden_size: int, num_layers: int) -> None:
    """AdapterError for an adapter plainly made for another model: a layer the model lacks,
    or a projection whose residual-stream side is not `hidden_size` (what a server checks on
    load; the engine checks every shape, check_shapes, when a request first uses it)."""
    for (layer, mod), (a, b) in sorted(spec.shapes.items()):
        if layer >= num_layers:
            raise AdapterError(f"adapter: layer {layer}, but the model has {num_layers} layers")
        side = a[1] if mod in READS_HIDDEN else b[0]
        if side != hidden_size:
            raise AdapterError(
                f"adapter: layer {layer} {mod}: lora_A {a} / lora_B {b} do not fit the model's "
                f"hidden size {hidden_size} (an adapter for another model?)"
            )


def load_tensors(spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, module): (A [r, in], B [out, r] x scale)} in float32 on the host."""
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in _read(spec.weights_file, data=True).items():
        m = _KEY.fullmatch(name)
        if m is not None:
            out.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    return {
        k: (ab["A"].float().contiguous(), (ab["B"].float() * spec.scale).contiguous())
        for k, ab in out.items()
    }
