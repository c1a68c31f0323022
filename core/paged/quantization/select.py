"""Which QuantMethod an engine uses: `--quantization` and the checkpoint's quantization_config
(config.json), checked against each other at start-up."""

from __future__ import annotations

from typing import Any

from paged.quantization.base import QuantMethod

# --quantization values (vLLM's spelling); None: whatever the checkpoint says.
CHOICES = ("none", "fp8", "awq", "gptq", "compressed-tensors")


def check_flag(value: str | None) -> None:
    if value is not None and value not in CHOICES:
        raise ValueError(f"quantization {value!r} is not supported; use one of "
                         f"{', '.join(CHOICES)} (or leave it unset)")  # fmt: skip


def checkpoint_config(hf_config: Any) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return qc


def quant_method(flag: str | None, hf_config: Any, dummy: bool = False) -> QuantMethod | None:
    """The method for `--quantization flag` and this model's config (None: dense); a
    ValueError naming what is unsupported. `dummy` (random weights): awq/gptq need no
    checkpoint (group size 128)."""
    check_flag(flag)
    qc = checkpoint_config(hf_config)
    if qc is None:
        if flag in (None, "none"):
            return None
        if flag == "fp8":
            from paged.quantization.fp8 import Fp8Method

            return Fp8Method()
        if dummy and flag in ("awq", "gptq"):
            from paged.quantization.int4 import Int4Method

            return Int4Method(flag, 128)
        raise ValueError(f"quantization {flag}: the checkpoint has no quantization_config; only "
                         "fp8 quantizes a float checkpoint at load")  # fmt: skip
    method = from_checkpoint(qc)
    if flag == "none":
        raise ValueError(f"quantization none: the checkpoint is quantized ({method.describe()}); "
                         "paged cannot load it as float weights")  # fmt: skip
    fp8_ct = flag == "compressed-tensors" and method.name == "fp8"
    if flag is not None and flag != method.name and not fp8_ct:
        raise ValueError(f"quantization {flag}: the checkpoint is quantized as "
                         f"{method.describe()}; drop --quantization or pass "
                         f"{method.name}")  # fmt: skip
    return method


def from_checkpoint(qc: dict) -> QuantMethod:
    kind = str(qc.get("quant_method", "")).lower()
    if kind == "fp8":  # transformers' FineGrainedFP8Config layout
        from paged.quantization.fp8 import Fp8Method

        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"fp8 checkpoint: activation_scheme {qc['activation_scheme']!r} is "
                             "not supported (dynamic)")  # fmt: skip
        block = qc.get("weight_block_size")
        return Fp8Method(tuple(block) if block else None, source="fp8")
    if kind == "compressed-tensors":
        return _compressed_tensors(qc)
    if kind in ("awq", "gptq"):
        from paged.quantization.int4 import Int4Method

        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"{kind} checkpoint: {bits}-bit weights are not supported (4)")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if group == -1:
            raise ValueError(f"{kind} checkpoint: group_size -1 (per channel) is not supported")
        if kind == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or not qc.get("zero_point", True):
                raise ValueError(f"awq checkpoint: version {version!r} / zero_point "
                                 f"{qc.get('zero_point')} is not supported (gemm with zero "
                                 "points)")  # fmt: skip
            return Int4Method("awq", group)
        if qc.get("desc_act"):
            raise ValueError("gptq checkpoint: desc_act=true (act-order) is not supported")
        v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return Int4Method("gptq", group, zero_offset=0 if v2 else 1)
    raise ValueError(f"checkpoint quantization {kind or qc!r} is not supported (fp8, "
                     "compressed-tensors fp8, awq, gptq)")  # fmt: skip


def _compressed_tensors(qc: dict) -> QuantMethod:
    from paged.quantization.fp8 import Fp8Method

    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint: {len(groups)} config groups (one "
                         "supported)")  # fmt: skip
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        bits, kind = weights.get("num_bits"), weights.get("type")
        raise ValueError(f"compressed-tensors checkpoint: {bits}-bit {kind} weights are not "
                         "supported (8-bit float)")  # fmt: skip
    strategy = weights.get("strategy", "tensor")
    if strategy in ("tensor", "channel"):
        return Fp8Method(None, source="compressed-tensors")
    if strategy == "block" and weights.get("block_structure"):
        return Fp8Method(tuple(weights["block_structure"]), source="compressed-tensors")
    raise ValueError(f"compressed-tensors checkpoint: weight strategy {strategy!r} is not "
                     "supported (tensor, channel, block)")  # fmt: skip
