"""Safetensors headers read without loading a weight: what the checkpoint holds, how big it is, and which
file is broken. The CLI checks a model with them before any process starts; workers size their KV pool
from them before the model is loaded.

A safetensors file is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` plus ``__metadata__``), then the tensor bytes (safetensors format, "Format" section).
"""
from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple

from engine.fingerprint import CheckpointError, checkpoint_files

MAX_HEADER_BYTES = 100 << 20
"""The safetensors library's own limit on a header (100 MB)."""
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
"""Safetensors float dtypes -> torch dtype names (fp8 and integer tensors are quantized payloads)."""


class TensorInfo(NamedTuple):
    name: str
    dtype: str
    """Safetensors dtype tag (``BF16``, ``F32``, ``U8``, ...)."""
    numel: int


def read_header(path: str) -> list[TensorInfo]:
    """The tensors of one safetensors file; ``CheckpointError`` naming the file when it is not one, or is
    shorter than its header says (a truncated download)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file or truncated (header of {n} bytes, file of "
                                      f"{size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    out, end = [], 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (_, hi), dtype = t["shape"], t["data_offsets"], t["dtype"]
            numel = 1
            for s in shape:
                numel *= int(s)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({e!r})") from e
        out.append(TensorInfo(name, dtype, numel))
        end = max(end, int(hi))
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return out


def checkpoint_tensors(model_dir: str) -> list[TensorInfo]:
    """Every tensor of a checkpoint directory (all its safetensors files), from the headers only."""
    out = []
    for path in checkpoint_files(model_dir):
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: listed in model.safetensors.index.json but missing")
        out.extend(read_header(path))
    return out


def weights_bytes(tensors: list[TensorInfo], dtype_bytes: int) -> int:
    """Bytes the loaded weights take: float tensors in the compute dtype (``dtype_bytes`` each), quantized
    payloads (integer / fp8) as stored."""
    return sum(t.numel * (dtype_bytes if t.dtype in FLOAT_DTYPES else DTYPE_BYTES.get(t.dtype, 4))
               for t in tensors)


def stored_float_dtype(tensors: list[TensorInfo]) -> str | None:
    """The float dtype holding most of the checkpoint's float bytes (torch name), or None without floats."""
    by_dtype: dict[str, int] = {}
    for t in tensors:
        if t.dtype in FLOAT_DTYPES:
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel * DTYPE_BYTES[t.dtype]
    if not by_dtype:
        return None
    return FLOAT_DTYPES[max(by_dtype, key=by_dtype.__getitem__)]
