"""Quantization: OCP MX formats (mx), Quark checkpoint configs (quark), the offline quantizer
(quantize), quantized-checkpoint loading (prepare) and quality evaluation (evaluate)."""

from engine.quant.mx import (
    MX_FORMATS,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8,
    MXFormat,
    MXTensor,
    dequantize_mx,
    get_mx_format,
    quantize_mx,
)

__all__ = [
    "MX_FORMATS",
    "MXFP4",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8",
    "MXFormat",
    "MXTensor",
    "dequantize_mx",
    "get_mx_format",
    "quantize_mx",
]
