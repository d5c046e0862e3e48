"""Build a model from a directory and generate in-process on a paged KV pool.

``Engine`` is the smallest complete generation loop: chunked prefill of each new request,
then one batched decode step per iteration over every running request, pages allocated as
sequences grow and freed when they finish. The prefill and decode workers build their
schedulers from the same pieces (``GlmForCausalLM.forward``, ``KVPool``, ``sample``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.config import ModelConfig
from engine.kvcache import KVLayout, KVPool
from engine.loader import checkpoint_names, detect_mtp_layers, load_weights
from engine.models.glm import GlmForCausalLM
from engine.sampling import SamplerState, SamplingParams, sample

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP32_MODULES = ("mlp.gate", "indexer.weights_proj")
"""Kept in fp32 whatever the model dtype (router logits and DSA weights, as the reference does)."""


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` (NVIDIA or ROCm; both are ``cuda`` in torch) when available, else ``cpu``."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        logger.info("no CUDA/ROCm device available: running on CPU")
        return torch.device("cpu")
    return torch.device(device)


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                moe_impl: str = "auto") -> GlmForCausalLM:
    with torch.device("meta"):
        model = GlmForCausalLM(cfg, moe_impl)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, mod in model.named_modules():
        if name.endswith(FP32_MODULES):
            mod.float()
    return model.eval()


def load_model(model_dir: str, dtype: str = "float32", device: str = "auto",
               moe_impl: str = "auto") -> tuple[GlmForCausalLM, ModelConfig]:
    cfg = ModelConfig.from_model_dir(model_dir)
    cfg = detect_mtp_layers(cfg, checkpoint_names(model_dir))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(DTYPES)}")
    model = build_model(cfg, DTYPES[dtype], resolve_device(device), moe_impl)
    t0 = time.perf_counter()
    from engine.quant import prepare_model_for_checkpoint  # quantized checkpoints: MX experts + rules
    extra_rules = prepare_model_for_checkpoint(model, cfg, model_dir)
    load_weights(model, model_dir, cfg, extra_rules)
    logger.info("loaded %s (%s, %d layers + %d MTP) in %.2fs", model_dir, cfg.model_type,
                cfg.num_hidden_layers, cfg.num_mtp_layers, time.perf_counter() - t0)
    return model, cfg


def warm_up_decode(model: GlmForCausalLM, cfg: ModelConfig, kv_dtype: str, page_size: int = 16,
                   spec: str | None = None) -> float:
    """Compile the decode graphs of ``model`` (``compile_decode``) for the shape classes a decode worker
    meets, before it serves, so no request waits for a compile: one and several requests, one and several
    tokens each (decode, verify, MTP extend) and mixed counts, a batch whose routed experts leave the
    graph, short contexts (every key) and long ones (the DSA top-k); the MTP layer's draft steps too with
    ``spec``; then a few real generations. Runs on a scratch pool; returns the seconds it took."""
    t0 = time.perf_counter()
    long = (cfg.index_topk if cfg.is_mla else 0) + 2 * page_size
    shapes = [(1,), (1, 1), (2,), (2, 2), (1, 2), (1,) * 9]
    per_req = -(-(long + 8) // page_size)
    pool = KVPool(KVLayout.for_model(cfg, page_size, kv_dtype), per_req * 9 + 1,
                  device=model.lm_head.weight.device)
    for ctx in (4, long):
        for qs in shapes:
            reqs = [BatchRequest(list(range(i * per_req, (i + 1) * per_req)), ctx, [3] * q) for i, q in enumerate(qs)]
            batch = ForwardBatch.build(reqs, page_size, pool.device)
            out = model(batch, pool)
            if spec and model.has_mtp:
                model.forward_mtp(batch, pool, out.hidden)
    n = cfg.index_topk + 2 * page_size if cfg.is_mla else 2 * page_size
    prompts = [[2 + i % (cfg.vocab_size - 2) for i in range(n)], [3] * 4]
    eng = Engine(model, cfg, kv_dtype=kv_dtype, page_size=page_size, num_pages=4 * (n // page_size + 4))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.generate(prompts, params)
    eng.generate(prompts[:1], params)
    if spec:
        from engine.spec import SpecConfig, SpecEngine
        for ps in (prompts, prompts[:1]):
            SpecEngine(eng, SpecConfig.parse(spec)).generate(ps, params)
    return time.perf_counter() - t0


@dataclass(slots=True)
class Seq:
    req_id: str
    prompt_ids: list[int]
    sampler: SamplerState
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True, slots=True)
class GenerationResult:
    req_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    """``length`` or ``stop``."""


class Engine:
    """In-process generation over one KV pool (used by ``pdserve run`` and tests)."""

    def __init__(self, model: GlmForCausalLM, cfg: ModelConfig, kv_dtype: str = "float32", page_size: int = 16,
                 num_pages: int = 1024, chunk_size: int = 2048) -> None:
        self.model, self.cfg = model, cfg
        self.layout = KVLayout.for_model(cfg, page_size=page_size, kv_dtype=kv_dtype)
        self.pool = KVPool(self.layout, num_pages, device=model.lm_head.weight.device)
        self.chunk_size = chunk_size

    def _ensure_pages(self, seq: Seq, num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages += self.pool.allocator.alloc(need, seq.req_id)

    def prefill(self, seq: Seq) -> torch.Tensor:
        """Run the prompt in chunks; returns last-token logits [1, V]."""
        ids = seq.prompt_ids
        logits = None
        while seq.cached_len < len(ids):
            chunk = ids[seq.cached_len:seq.cached_len + self.chunk_size]
            self._ensure_pages(seq, seq.cached_len + len(chunk))
            batch = ForwardBatch.build([BatchRequest(seq.pages, seq.cached_len, chunk)], self.pool.page_size,
                                       self.pool.device)
            logits = self.model(batch, self.pool).logits
            seq.cached_len += len(chunk)
        return logits

    def _finished(self, seq: Seq, tok: int) -> str:
        p = seq.sampler.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.cfg.eos_token_ids):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens:
            return "length"
        return ""

    def _append(self, seqs: Sequence[Seq], logits: torch.Tensor) -> None:
        res = sample(logits, [s.sampler for s in seqs])
        for s, tok in zip(seqs, res.token_ids.tolist()):
            s.output_ids.append(tok)
            s.sampler.output_ids.append(tok)
            s.finish_reason = self._finished(s, tok)

    def decode_step(self, seqs: Sequence[Seq]) -> None:
        """One batched decode step: each running request's last token through the model, then sample and
        append the next one (sets ``finish_reason`` when a request ends)."""
        for s in seqs:
            self._ensure_pages(s, s.cached_len + 1)
        reqs = [BatchRequest(s.pages, s.cached_len, [s.output_ids[-1]]) for s in seqs]
        logits = self.model(ForwardBatch.build(reqs, self.pool.page_size, self.pool.device), self.pool).logits
        for s in seqs:
            s.cached_len += 1
        self._append(seqs, logits)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        seqs = [Seq(f"req-{i}", list(p), SamplerState(params, list(p))) for i, p in enumerate(prompts)]
        for s in seqs:
            if not s.prompt_ids:
                raise ValueError("empty prompt")
            if len(s.prompt_ids) + params.max_tokens > self.cfg.max_position_embeddings:
                raise ValueError(f"prompt ({len(s.prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"context ({self.cfg.max_position_embeddings})")
        try:
            for s in seqs:
                self._append([s], self.prefill(s))
            running = [s for s in seqs if not s.finish_reason]
            while running:
                self.decode_step(running)
                running = [s for s in running if not s.finish_reason]
        finally:
            for s in seqs:
                if s.pages:
                    self.pool.allocator.free(s.pages)
                    s.pages = []
        return [GenerationResult(s.req_id, s.prompt_ids, s.output_ids, s.finish_reason) for s in seqs]
