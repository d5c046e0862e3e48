"""The offline commands, ``pdserve run`` (generate in-process, no servers) and ``pdserve init-model``: they load
torch, so ``cli.main`` imports this module only when one of them runs."""
from __future__ import annotations

import argparse
import json
import logging
import time

from cli.vocab import parse_ids
from cluster.preflight import check_model, check_speculative
from cluster.weights import resolve_decode_weights
from common import env
from engine.checkpoint import PRESETS, TINY_GLM5, init_random_model, init_random_model_streaming
from engine.config import ModelConfig
from engine.defaults import default_model_dir
from engine.fingerprint import model_hash
from engine.headers import checkpoint_tensors
from engine.load import load_model, resolve_device
from engine.offline import Engine
from engine.parallel import SINGLE_RANK
from engine.precision import resolve_dtype
from engine.quant.prepare import expert_status, model_weight_bytes
from engine.sampling import SamplingParams
from engine.speculative.config import SpecConfig
from engine.speculative.generate import run_speculative
from engine.tokenizer import Tokenizer
from worker.model_proxy import ModelProxy
from worker.ranks import FollowerArgs, RankConfig, RankGroup


def cmd_run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    if (args.token_ids is None) == (args.prompt is None):
        raise ValueError("give exactly one of --prompt and --token-ids")
    check_model(model_dir, need_text=args.prompt is not None)  # one line and exit 2 instead of a traceback
    check_speculative(None if args.no_speculative else args.speculative)
    choice = resolve_dtype(args.dtype, checkpoint_tensors(model_dir), resolve_device(args.device),
                           ModelConfig.from_model_dir(model_dir).hidden_size)
    if choice.reason != "given":
        log = logging.getLogger("pdserve")
        (log.warning if choice.widened else log.info)("dtype auto -> %s: %s", choice.dtype, choice.reason)
    args.dtype = choice.dtype
    weights_dir = resolve_decode_weights(model_dir, args.decode_weights) or model_dir
    ranks = start_ranks(args, weights_dir)
    try:
        model, cfg = load_model(weights_dir, args.dtype, args.device, args.moe_impl,
                                parallel=ranks.parallel if ranks is not None else SINGLE_RANK)
        if ranks is not None:
            ranks.wait_ready(model_hash(weights_dir), cfg)
            model = ModelProxy(model, ranks)
        return _generate(args, model_dir, weights_dir, model, cfg)
    finally:
        if ranks is not None:
            ranks.close()


def start_ranks(args: argparse.Namespace, weights_dir: str):
    """With ``--tp N`` > 1: the follower ranks 1..N-1 of the in-process model (``worker.ranks``), else None."""
    if (args.tp or 1) == 1:
        return None
    if args.compile:
        raise ValueError("--compile with --tp > 1 is not supported yet (the followers' graphs are not warmed up)")
    device = resolve_device(args.device)
    ranks = RankGroup(RankConfig(tp_size=args.tp, moe_parallel=args.moe_parallel, check_outputs=env.rank_check()),
                      device)
    ranks.start(FollowerArgs(weights_dir, args.dtype, str(device), args.moe_impl,
                             log_level="DEBUG" if args.verbose else "WARNING"))
    return ranks


def _generate(args: argparse.Namespace, model_dir: str, weights_dir: str, model, cfg) -> int:
    model.compile_decode(args.compile)
    tok = Tokenizer.from_model_dir(model_dir)
    ids = parse_ids(args.token_ids)
    if ids is None:
        if args.prompt is None:
            raise SystemExit("give --token-ids or --prompt")
        if tok is None:
            raise SystemExit(f"--prompt needs a tokenizer.json in {model_dir}; use --token-ids")
        ids = tok.encode(args.prompt)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if not ids or bad:
        raise SystemExit(f"token ids must be non-empty and in [0, {cfg.vocab_size}); bad: {bad[:5]}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)
    spec = None if args.no_speculative or args.speculative in (None, "", "off") else args.speculative
    if spec and not model.has_mtp:
        logging.getLogger("pdserve").warning("model has no MTP layer: running without speculative decoding")
        spec = None
    t0 = time.perf_counter()
    spec_stats = None
    if spec:
        spec = SpecConfig.parse(spec)
        run = run_speculative(model, cfg, [ids], params, spec, kv_dtype=args.kv_dtype or args.dtype,
                              page_size=args.page_size)
        res, spec_stats = run.results[0], run.metrics.snapshot(spec.num_steps)
    else:
        eng = Engine(model, cfg, kv_dtype=args.kv_dtype or args.dtype, page_size=args.page_size,
                     num_pages=max(64, (len(ids) + args.max_tokens) // args.page_size + 8))
        res = eng.generate([ids], params)[0]
    elapsed = time.perf_counter() - t0
    out = {"token_ids": res.token_ids, "finish_reason": res.finish_reason, "prompt_tokens": len(ids),
           "elapsed_s": round(elapsed, 4), "model": model_dir, "speculative": str(spec) if spec else "off",
           "weights": weights_dir, **expert_status(model), "tp": args.tp or 1,
           "rank0_weight_bytes": model_weight_bytes(model)}
    if spec_stats is not None:  # rates per draft depth 1..num_steps: see engine.speculative.metrics
        out["accept_len"] = round(spec_stats.accept_len, 4)
        out["verify_steps"] = spec_stats.num_verify_steps
        out["accept_rate_per_position"] = [round(r, 4) for r in spec_stats.accept_rate_per_position]
        out["accept_rate_at_least"] = [round(r, 4) for r in spec_stats.accept_rate_at_least]
    if tok is not None:
        out["text"] = tok.decode(res.token_ids)
    if args.json:
        print(json.dumps(out))
    else:
        print(out.get("text", res.token_ids))
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    if args.preset == "tiny":
        init_random_model(TINY_GLM5, args.out, seed=args.seed)
    else:  # big presets: one layer in memory at a time, bf16
        stats = init_random_model_streaming(PRESETS[args.preset], args.out, seed=args.seed)
        print(json.dumps(stats))
    print(args.out)
    return 0
