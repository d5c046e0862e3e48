"""Warm-up of a decode worker's compiled graphs before it serves (``decode.server --compile``)."""
from __future__ import annotations

import time

from engine.batch import BatchRequest, ForwardBatch
from engine.config import ModelConfig
from engine.kvcache import KVLayout, KVPool
from engine.layers.attention import MLA_ABSORB_MAX_Q
from engine.models.glm import GlmForCausalLM
from engine.layers.decode_graph import GRAPH_EXACT_GATHER_MAX_PAIRS, GRAPH_GATHER_MAX_PAIRS
from engine.moe.experts import GATHER_MAX_PAIRS
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig, SpecEngine


def warm_up_decode(model: GlmForCausalLM, cfg: ModelConfig, kv_dtype: str, page_size: int = 16,
                   spec: str | None = None) -> float:
    """Compile the decode graphs of ``model`` (``compile_decode``) for the shape classes a decode worker
    meets, before it serves, so no request waits for a compile: one and several requests, one and several
    tokens each (decode, verify, MTP extend, prompts of up to MLA_ABSORB_MAX_Q tokens) and mixed counts,
    batches whose routed experts leave the graph or change strategy inside it (one request and several), short contexts (every key) and long ones (the DSA top-k); the MTP layer's draft steps too with
    ``spec``; then a few real generations. Runs on a scratch pool; returns the seconds it took."""
    t0 = time.perf_counter()
    long = (cfg.index_topk if cfg.is_mla else 0) + 2 * page_size
    # the routed experts leave the graph above GATHER_MAX_PAIRS token-expert pairs: one request with a few
    # tokens (a short prompt, a long verify) and several requests with several tokens each cross it too
    q_out = min(MLA_ABSORB_MAX_Q, GATHER_MAX_PAIRS // max(1, cfg.num_experts_per_tok) + 1)
    # inside the graph the experts change strategy past GRAPH_GATHER_MAX_PAIRS (models without verify steps) and
    # leave it past GRAPH_EXACT_GATHER_MAX_PAIRS (models that verify): many one-token and two-token requests
    k = max(1, cfg.num_experts_per_tok)
    many = [GRAPH_GATHER_MAX_PAIRS // k + 1, GRAPH_EXACT_GATHER_MAX_PAIRS // k + 1]
    shapes = [(1,), (1, 1), (2,), (2, 2), (1, 2), (1,) * 9, (q_out,), (2,) * 9]
    shapes += [(1,) * n for n in many] + [(2,) * (n // 2 + 1) for n in many]
    per_req = -(-(long + MLA_ABSORB_MAX_Q) // page_size)
    pool = KVPool(KVLayout.for_model(cfg, page_size, kv_dtype, model.parallel), per_req * 9 + 1,
                  device=model.lm_head.weight.device)
    for ctx in (4, long):
        for qs in shapes:
            # past 9 requests the page lists repeat (a scratch pool: only the shapes matter, not the values)
            reqs = [BatchRequest(list(range(i % 9 * per_req, (i % 9 + 1) * per_req)), ctx, [3] * q)
                    for i, q in enumerate(qs)]
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
        for ps in (prompts, prompts[:1]):
            SpecEngine(eng, SpecConfig.parse(spec)).generate(ps, params)
    return time.perf_counter() - t0
