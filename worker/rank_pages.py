"""The KV page and output helpers of a rank group (``worker.ranks``), run alike on rank 0 and the followers.

- ``page_tensors`` / ``write_pages``: a pool's page bytes, every layer and component (fp8 scales too),
  copied to another rank's pool (replicated KV: MLA).
- ``full_page_tensors``, ``write_head_slices``: whole pages (every KV head) to one rank's heads (GQA, KV that
  landed whole on rank 0); ``gather_heads``, ``write_full_pages``: every rank's heads joined into whole pages
  (GQA, KV leaving a prefill worker).
- ``output_stats`` / ``gather_stats``: the logits fingerprint the ranks compare (``PDSERVE_RANK_CHECK``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.kvcache import KVPool
from engine.parallel import ParallelConfig


def output_stats(logits: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64 fingerprint of a call's logits (sum, absolute sum, argmax sum) that ranks compare."""
    x = logits.detach().double()
    return torch.stack([x.sum(), x.abs().sum(), logits.argmax(-1).double().sum()])


def gather_stats(stats: torch.Tensor, world_size: int, device: torch.device) -> list[torch.Tensor]:
    out = [torch.empty(3, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(out, stats.to(device))
    return out


def page_tensors(pool: KVPool, page_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The bytes of ``page_ids`` in every layer and component of ``pool`` (fp8 scales too), keyed
    ``L<layer>.<name>`` (``L<layer>.<name>.scale``); ``write_pages`` stores them."""
    out = {}
    for layer, bufs in enumerate(pool.buffers):
        for name, buf in bufs.items():
            out[f"L{layer}.{name}"] = buf.view(torch.uint8).index_select(0, page_ids)
            if pool.layout.is_fp8:
                out[f"L{layer}.{name}.scale"] = pool.scales[layer][name].index_select(0, page_ids)
    return out


def write_pages(pool: KVPool, page_ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    for layer, bufs in enumerate(pool.buffers):
        for name, buf in bufs.items():
            buf.view(torch.uint8).index_copy_(0, page_ids, tensors[f"L{layer}.{name}"].to(buf.device))
            if pool.layout.is_fp8:
                pool.scales[layer][name].index_copy_(0, page_ids, tensors[f"L{layer}.{name}.scale"].to(buf.device))


def full_page_tensors(pool: KVPool, page_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The typed values of ``page_ids`` of a full-layout pool (every head), keyed as ``page_tensors``; fp8 as
    its bytes (``[n, page, heads, dim]`` uint8) so that CPU indexing works."""
    out = {}
    for layer, bufs in enumerate(pool.buffers):
        for name, buf in bufs.items():
            src = buf.view(torch.uint8) if pool.layout.is_fp8 else buf
            out[f"L{layer}.{name}"] = src.index_select(0, page_ids)
            if pool.layout.is_fp8:
                out[f"L{layer}.{name}.scale"] = pool.scales[layer][name].index_select(0, page_ids)
    return out


def write_head_slices(pool: KVPool, page_ids: torch.Tensor, tensors: dict[str, torch.Tensor],
                      pc: ParallelConfig) -> None:
    """Store rank ``pc.tp_rank``'s KV heads of full-layout page values (``full_page_tensors``) into its pool
    (GQA: heads ``[r*h, (r+1)*h)`` of ``[n, page, KVH, D]``, scales ``[n, page, KVH]``)."""
    for layer, bufs in enumerate(pool.buffers):
        for name, buf in bufs.items():
            full = tensors[f"L{layer}.{name}"]
            own = pc.split(full.shape[2])
            dst = buf.view(torch.uint8) if pool.layout.is_fp8 else buf
            dst.index_copy_(0, page_ids, full[:, :, own].to(buf.device))
            if pool.layout.is_fp8:
                pool.scales[layer][name].index_copy_(0, page_ids, tensors[f"L{layer}.{name}.scale"][:, :, own]
                                                     .to(buf.device))


def gather_heads(pool: KVPool, page_ids: torch.Tensor, world_size: int, root: bool) -> dict[str, torch.Tensor]:
    """Every rank's values of ``page_ids`` (its KV heads) gathered on rank 0 and joined along the head dim
    (rank order: the full layout); followers (``root`` False) contribute and get {}."""
    out = {}
    for name, mine in full_page_tensors(pool, page_ids).items():
        mine = mine.contiguous()
        if root:
            parts = [torch.empty_like(mine) for _ in range(world_size)]
            dist.gather(mine, parts, dst=0)
            out[name] = torch.cat(parts, dim=2)
        else:
            dist.gather(mine, dst=0)
    return out


def write_full_pages(pool: KVPool, page_ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Store full-layout values (``gather_heads``) into pages of a full-layout pool."""
    for layer, bufs in enumerate(pool.buffers):
        for name, buf in bufs.items():
            dst = buf.view(torch.uint8) if pool.layout.is_fp8 else buf
            dst.index_copy_(0, page_ids, tensors[f"L{layer}.{name}"].to(buf.device))
            if pool.layout.is_fp8:
                pool.scales[layer][name].index_copy_(0, page_ids, tensors[f"L{layer}.{name}.scale"].to(buf.device))
