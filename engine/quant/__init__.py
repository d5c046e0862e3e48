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
    "prepare_model_for_checkpoint",
]


def prepare_model_for_checkpoint(model, cfg, model_dir):
    """Swap routed experts to MX where ``model_dir`` is a quantized (Quark-layout) checkpoint and
    return the loader's extra rules ([] for an unquantized one); see engine.quant.prepare.

    Imported lazily: engine.quant.prepare needs engine.moe.mx_experts, which needs engine.quant.mx.
    """
    from engine.quant.prepare import prepare_model_for_checkpoint as prepare  # lazy: safetensors, triton
    return prepare(model, cfg, model_dir)
