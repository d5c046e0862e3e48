"""The KV page layout: what one page of one layer holds, in which dtype.

Shared by the pool (``pool.py``), the model's attention (which reads and writes it)
and ``kvtransfer`` (which ships it and checks both peers agree on it).

glm_moe_dsa (MLA + DSA), per token per layer::

    latent [kv_lora_rank]      normalised compressed KV (c_kv)
    rope   [qk_rope_head_dim]  the shared rotary key, RoPE already applied
    index  [index_head_dim]    the DSA indexer key, RoPE already applied

glm4_moe (GQA), per token per layer::

    k [num_kv_heads, head_dim]  RoPE already applied
    v [num_kv_heads, head_dim]

Tensor parallelism (``engine.parallel``): a rank's pool has the layout ``for_model(cfg, ..., parallel)``
gives. MLA keeps the whole latent / rope / index components on every rank (replicated: every rank writes the
same values; the reasoning is in ``engine.parallel.layers``); GQA splits the KV heads, rank r holding heads
``[r*h, (r+1)*h)`` with ``h = num_key_value_heads / tp_size``. ``shard_kv`` / ``gather_kv`` map a component's
full-layout values to a rank's and back (KV transfer between workers of different TP sizes).

With ``kv_dtype="fp8_e4m3"`` each component is stored as ``float8_e4m3fn`` with one
fp32 scale per token (per head for GQA): ``scale = amax / 448``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.parallel.config import SINGLE_RANK, ParallelConfig

KV_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
             "fp8_e4m3": torch.float8_e4m3fn}
FP8_MAX = 448.0


@dataclass(frozen=True, slots=True)
class KVComponent:
    name: str
    """``latent``, ``rope``, ``index`` (MLA) or ``k``, ``v`` (GQA)."""
    shape: tuple[int, ...]
    """Per-token shape."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Per-token shape of the fp8 scales: one per token (per head for 2-D components)."""
        return self.shape[:-1]


@dataclass(frozen=True, slots=True)
class KVLayout:
    model_type: str
    num_layers: int
    """Main layers plus MTP layers (the draft KV lives in the same pool)."""
    page_size: int
    """Tokens per page."""
    kv_dtype: str
    """Key of ``KV_DTYPES``."""
    components: tuple[KVComponent, ...]

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} not in {sorted(KV_DTYPES)}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    def bytes_per_token_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        total = sum(c.numel * elem for c in self.components)
        if self.is_fp8:
            total += sum(max(1, _prod(c.scale_shape)) * 4 for c in self.components)
        return total

    def bytes_per_page(self) -> int:
        return self.bytes_per_token_per_layer() * self.page_size * self.num_layers

    def to_dict(self) -> dict:
        """Plain dict for handshakes (msgpack) and logs."""
        return {"model_type": self.model_type, "num_layers": self.num_layers, "page_size": self.page_size,
                "kv_dtype": self.kv_dtype,
                "components": [[c.name, list(c.shape)] for c in self.components]}

    def layout_hash(self) -> int:
        """64-bit digest of ``to_dict()``: the fields the KV handshake compares (``kvtransfer.protocol.
        check_compatible``), so two pools with equal hashes read each other's page bytes alike. Tags every page a
        prefix-cache tier stores (``engine.kvcache.host_pool``)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(model_type=d["model_type"], num_layers=int(d["num_layers"]), page_size=int(d["page_size"]),
                   kv_dtype=d["kv_dtype"],
                   components=tuple(KVComponent(n, tuple(int(x) for x in s)) for n, s in d["components"]))

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int = 16, kv_dtype: str = "bfloat16",
                  parallel: ParallelConfig = SINGLE_RANK) -> "KVLayout":
        """The layout of ``cfg``'s pool; with ``parallel`` the pool of that rank (module docstring)."""
        if cfg.is_mla:
            comps = (KVComponent("latent", (cfg.kv_lora_rank,)), KVComponent("rope", (cfg.qk_rope_head_dim,)),
                     KVComponent("index", (cfg.index_head_dim,)))
        else:
            kvh = (cfg.num_key_value_heads // parallel.tp_size, cfg.head_dim)
            comps = (KVComponent("k", kvh), KVComponent("v", kvh))
        return cls(model_type=cfg.model_type, num_layers=cfg.num_layers_total, page_size=page_size,
                   kv_dtype=kv_dtype, components=comps)


def kv_is_split(cfg: ModelConfig) -> bool:
    """Whether a rank's pool holds a slice of each token's KV (GQA heads) rather than all of it (MLA)."""
    return not cfg.is_mla


def shard_kv(cfg: ModelConfig, parallel: ParallelConfig, full: torch.Tensor, scales: bool = False) -> torch.Tensor:
    """A component's full-layout values ``[..., KVH, D]`` (fp8 scales: ``[..., KVH]``, ``scales=True``) -> rank
    ``parallel.tp_rank``'s ``[..., KVH / tp, D]``; MLA components (replicated) come back as they are."""
    if not kv_is_split(cfg) or parallel.tp_size == 1:
        return full
    dim = full.dim() - (1 if scales else 2)
    own = parallel.split(full.shape[dim])
    return full.narrow(dim, own.start, own.stop - own.start)


def gather_kv(cfg: ModelConfig, shards: list[torch.Tensor], scales: bool = False) -> torch.Tensor:
    """The inverse of ``shard_kv``: every rank's values, in rank order -> the full layout's (MLA: rank 0's)."""
    if not kv_is_split(cfg) or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=shards[0].dim() - (1 if scales else 2))


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
