"""The command channel from rank 0 to the follower ranks of a tensor-parallel worker (no pickle).

One command is two ``torch.distributed.broadcast`` calls from rank 0 on the rank group::

    sizes  int64 [2]        (header bytes, tensor bytes)
    blob   uint8 [h + d]    msgpack header, then every tensor's bytes, each part padded to ALIGN bytes

The header is ``{"op": str, "meta": {...msgpack values...}, "tensors": [[name, dtype, shape], ...]}``;
tensors travel as their raw bytes (any dtype: bool, bf16 and fp8 included, which gloo cannot reduce
but can broadcast as bytes) and are rebuilt with ``view(dtype).reshape(shape)`` on the receiving side.
A tensor argument that is None is simply absent from the list. Nothing is ever unpickled: a follower
only runs the ops of ``worker.follower`` on tensors of the announced dtypes and shapes.
"""
from __future__ import annotations

from typing import NamedTuple

import msgpack
import torch
import torch.distributed as dist

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn)}


ALIGN = 16
"""Every part of the blob starts at a multiple of this (``view(dtype)`` of a slice needs an aligned offset)."""


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Command(NamedTuple):
    op: str
    meta: dict
    tensors: dict[str, torch.Tensor]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class CommandChannel:
    """Rank 0 ``send``s, every other rank ``recv``s, in the same order (the group's one ordered stream).

    ``device`` is where the blob travels: the CPU for gloo, the rank's GPU for nccl."""

    def __init__(self, device: torch.device, group=None) -> None:
        self.device, self.group = device, group

    def send(self, op: str, meta: dict | None = None, tensors: dict[str, torch.Tensor | None] | None = None) -> None:
        present = {k: v for k, v in (tensors or {}).items() if v is not None}
        for name, t in present.items():
            if str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot travel to the follower ranks")
        header = msgpack.packb({"op": op, "meta": meta or {},
                                "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                                            for k, v in present.items()]}, use_bin_type=True)
        h = _padded(len(header))
        parts = [torch.frombuffer(bytearray(header.ljust(h, b"\0")), dtype=torch.uint8).to(self.device)]
        for v in present.values():
            b = _bytes_of(v).to(self.device)
            pad = _padded(b.numel()) - b.numel()
            parts += [b, torch.zeros(pad, dtype=torch.uint8, device=self.device)] if pad else [b]
        blob = torch.cat(parts) if len(parts) > 1 else parts[0]
        sizes = torch.tensor([h, blob.numel() - h], dtype=torch.int64, device=self.device)
        dist.broadcast(sizes, src=0, group=self.group)
        dist.broadcast(blob, src=0, group=self.group)

    def recv(self) -> Command:
        sizes = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(sizes, src=0, group=self.group)
        h, d = (int(x) for x in sizes.tolist())
        blob = torch.empty(h + d, dtype=torch.uint8, device=self.device)
        dist.broadcast(blob, src=0, group=self.group)
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(blob[:h].cpu().numpy().tobytes())
        header = unpacker.unpack()  # the first object; the padding after it is never read
        tensors, off = {}, h
        for name, dtype, shape in header["tensors"]:
            dt = DTYPES[dtype]
            n = torch.empty((), dtype=dt).element_size()
            for s in shape:
                n *= s
            tensors[name] = blob[off:off + n].view(dt).reshape(shape)
            off += _padded(n)
        if off != h + d:
            raise ValueError(f"command {header['op']!r}: {h + d - off} bytes left over")
        return Command(header["op"], header["meta"], tensors)
