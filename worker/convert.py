"""Proto <-> engine conversions shared by the prefill and decode workers (the only place both meet)."""
from __future__ import annotations

import math
import os
import socket

from engine.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
from engine.speculative.metrics import SpecStats
from protos.pdserve.v1 import generation_pb2


def model_info(cfg, model_dir: str, page_size: int) -> generation_pb2.ModelInfo:
    """The model contract a worker reports in ``WorkerStatus.model`` (``cfg``: the engine's ``ModelConfig``)."""
    return generation_pb2.ModelInfo(
        vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings, page_size=page_size,
        eos_token_ids=list(cfg.eos_token_ids), model_dir=os.path.abspath(model_dir), model_type=cfg.model_type,
        has_tokenizer=os.path.exists(os.path.join(model_dir, "tokenizer.json")),
        num_mtp_layers=cfg.num_mtp_layers, pid=os.getpid(), host=socket.gethostname())


def model_info_strings(m: generation_pb2.ModelInfo) -> dict[str, str]:
    """``m`` as the ``WorkerStatus.info`` keys a router that predates ``WorkerStatus.model`` parses (the same
    keys and formats as before the typed message)."""
    return {"pid": str(m.pid), "host": m.host, "vocab_size": str(m.vocab_size), "max_context": str(m.max_context),
            "page_size": str(m.page_size), "eos_token_ids": ",".join(map(str, m.eos_token_ids)),
            "model_dir": m.model_dir, "model_type": m.model_type, "has_tokenizer": "1" if m.has_tokenizer else "0",
            "num_mtp_layers": str(m.num_mtp_layers)}


def sampling_from_proto(sp: generation_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (-> INVALID_ARGUMENT) with the offending value."""
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before building a set of them
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(sp.stop_token_ids)}")
    temp = sp.temperature if sp.HasField("temperature") else 0.0
    if math.isnan(temp):
        raise ValueError("temperature is NaN")
    return SamplingParams(
        max_tokens=sp.max_tokens or 16,
        temperature=float(temp),
        top_p=float(sp.top_p) if sp.HasField("top_p") else 1.0,
        top_k=int(sp.top_k),
        min_p=float(sp.min_p),
        seed=int(sp.seed) if sp.HasField("seed") else None,
        repetition_penalty=float(sp.repetition_penalty) if sp.HasField("repetition_penalty") else 1.0,
        frequency_penalty=float(sp.frequency_penalty),
        presence_penalty=float(sp.presence_penalty),
        stop_token_ids=frozenset(sp.stop_token_ids),
        stop=tuple(sp.stop),
        ignore_eos=bool(sp.ignore_eos),
        logprobs=int(sp.logprobs),
    )


def logprob_to_proto(entry: tuple[int, float, list[int], list[float]]) -> generation_pb2.TokenLogprob:
    tok, lp, top_ids, top_lps = entry
    return generation_pb2.TokenLogprob(token_id=tok, logprob=lp, top_ids=top_ids, top_logprobs=top_lps)


def spec_stats_to_proto(stats: SpecStats, config: str) -> generation_pb2.SpecStats:
    """A decode worker's speculation counters and rates (``engine.speculative.metrics``) for ``WorkerStatus.spec``."""
    return generation_pb2.SpecStats(
        config=config, verify_steps=stats.num_verify_steps, accepted_drafts=stats.num_accepted_drafts,
        draft_tokens=stats.num_draft_tokens, accept_len=stats.accept_len,
        accept_rate_per_position=stats.accept_rate_per_position, accept_rate_at_least=stats.accept_rate_at_least,
        drafted_at_depth=stats.drafted_at_depth, reached_at_depth=stats.reached_at_depth,
        accepted_at_depth=stats.accepted_at_depth)
