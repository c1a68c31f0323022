"""Quantized linear layers: the interface (base.py), fp8 and int4 methods, the torch
reference arithmetic, and the choice of method (select.py). docs/plugins.md section
"Quantized linears" describes how a platform supplies kernels."""

from paged.quantization.base import (
    QuantLinear,
    QuantMethod,
    building,
    convert_checkpoint,
    linear,
    narrow_in,
    quant_targets,
)
from paged.quantization.load import init_dummy, quantized_weights
from paged.quantization.select import CHOICES, check_flag, quant_method

__all__ = [
    "CHOICES",
    "QuantLinear",
    "QuantMethod",
    "building",
    "check_flag",
    "convert_checkpoint",
    "init_dummy",
    "linear",
    "narrow_in",
    "quant_method",
    "quant_targets",
    "quantized_weights",
]
