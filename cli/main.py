"""The ``pdserve`` command line. Each subcommand imports only what it needs (the router never loads torch)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import metadata

from cli import vocab
from common import env


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens whose probability reaches this")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the most likely one")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def _parse_ids(s: str | None) -> list[int] | None:
    if not s:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--token-ids must be comma-separated integers, got {s!r}") from None


def cmd_run(args: argparse.Namespace) -> int:
    from cluster.local import resolve_decode_weights  # lazy: grpc, grpc_health, grpc_reflection
    from cluster.preflight import check_model, check_speculative  # lazy: numpy, safetensors, torch
    from engine.config import ModelConfig  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    from engine.defaults import default_model_dir  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    from engine.headers import checkpoint_tensors  # lazy: safetensors, torch
    from engine.load import load_model, resolve_device  # lazy: numpy, safetensors, torch
    from engine.loader import model_hash  # lazy: numpy, safetensors, torch
    from engine.parallel import SINGLE_RANK  # lazy: torch
    from engine.precision import resolve_dtype  # lazy: safetensors, torch
    from worker.model_proxy import ModelProxy  # lazy: torch
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
    from engine.load import resolve_device  # lazy: numpy, safetensors, torch
    from worker.ranks import FollowerArgs, RankConfig, RankGroup  # lazy: torch
    device = resolve_device(args.device)
    ranks = RankGroup(RankConfig(tp_size=args.tp, moe_parallel=args.moe_parallel, check_outputs=env.rank_check()),
                      device)
    ranks.start(FollowerArgs(weights_dir, args.dtype, str(device), args.moe_impl,
                             log_level="DEBUG" if args.verbose else "WARNING"))
    return ranks


def _generate(args: argparse.Namespace, model_dir: str, weights_dir: str, model, cfg) -> int:
    from engine.offline import Engine  # lazy: numpy, torch
    from engine.quant.prepare import expert_status, model_weight_bytes  # lazy: safetensors, torch, triton
    from engine.sampling import SamplingParams  # lazy: torch
    from engine.tokenizer import Tokenizer  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    model.compile_decode(args.compile)
    tok = Tokenizer.from_model_dir(model_dir)
    ids = _parse_ids(args.token_ids)
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
        from engine.speculative.config import SpecConfig  # lazy: numpy, torch
        from engine.speculative.generate import run_speculative  # lazy: numpy, torch
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
    from engine.checkpoint import (  # lazy: numpy, safetensors, torch
        PRESETS,
        TINY_GLM5,
        init_random_model,
        init_random_model_streaming,
    )
    if args.preset == "tiny":
        init_random_model(TINY_GLM5, args.out, seed=args.seed)
    else:  # big presets: one layer in memory at a time, bf16
        stats = init_random_model_streaming(PRESETS[args.preset], args.out, seed=args.seed)
        print(json.dumps(stats))
    print(args.out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from bench.demo import main as demo_main  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = vocab.OneLineParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.",
                            allow_abbrev=False)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=vocab.OneLineParser)

    r = sub.add_parser("run", help="generate in-process (no servers) and print the result")
    r.add_argument("--model", default=None, help="model directory (default: the shipped default model)")
    r.add_argument("--token-ids", default=None, help="comma-separated prompt token ids")
    r.add_argument("--prompt", default=None, help="prompt text (needs tokenizer.json)")
    r.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: the checkpoint's where the device computes it fast, else float32)")
    r.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "fp8_e4m3"], help="KV cache dtype (default: the compute dtype; alias --kv-cache-dtype)")
    r.add_argument("--device", default="auto", help="torch device: auto (CUDA/ROCm when present, else cpu), cpu, cuda, cuda:1, ...")
    r.add_argument("--moe-impl", default="auto", help="routed-expert kernel (auto: the tuned table's choice for this device and shape)")
    r.add_argument("--decode-weights", default="model",
                   help="routed experts as `serve --decode-weights` takes them: 'model' (the checkpoint as is, the "
                        "default), mxfp4 / mxfp6_e2m3 / mxfp6_e3m2 / mxfp8 (quantized once, cached), or a quantized "
                        "copy's directory; --json reports the experts' resident bytes and the strategies that ran")
    r.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--speculative", default="5/1/6",
                   help="MTP speculation STEPS/TOPK/DRAFT_TOKENS (on when the model has an MTP layer), or 'off'")
    r.add_argument("--no-speculative", action="store_true", help="no MTP speculation (same as --speculative off)")
    r.add_argument("--compile", action="store_true", help="decode / verify steps through compiled graphs (torch.compile)")
    r.add_argument("--moe-parallel", default="tp", choices=["tp", "ep"],
                   help="with --tp > 1: split each routed expert's intermediate dim (tp) or partition the experts (ep)")
    _add_sampling(r)
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("init-model", help="write a random-weight GLM-5-architecture checkpoint")
    i.add_argument("--out", required=True, help="output directory")
    i.add_argument("--preset", default="tiny", choices=["tiny", "medium"],
                   help="tiny: the test model (fp32, one file); medium: the ~3.8 GB bf16 benchmark model, "
                        "written one layer at a time (docs/performance.md)")
    i.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    i.set_defaults(fn=cmd_init_model)

    d = sub.add_parser("demo", help="the main job: answer a real request on the default model, print a table")
    d.add_argument("--model", default=None, help="model directory (default: the shipped default model)")
    d.set_defaults(fn=cmd_demo)

    # Subcommands owned by other parts of the project register themselves here.
    import importlib
    for mod in ("cli.quant", "cli.serve", "cli.bench", "cli.launch"):
        try:
            importlib.import_module(mod).register(sub)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    for cmd in VOCABULARY_COMMANDS:
        vocab.add_vocabulary(sub.choices[cmd], cmd)
        vocab.add_config_flag(sub.choices[cmd])
    vocab.apply_rules(p, sub)
    return p


VOCABULARY_COMMANDS = ("run", "serve", "launch")
"""The commands sharing one flag vocabulary and ``--config`` (``cli.vocab``)."""


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    from engine.defaults import tune_malloc  # lazy: engine (`pdserve bench` builds this CLI and never imports engine)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    try:
        argv = vocab.config_argv(list(sys.argv[1:] if argv is None else argv), sub)
    except ValueError as e:
        parser.error(str(e))  # "pdserve: error: ...", exit 2
    args = parser.parse_args(argv)
    if args.cmd in VOCABULARY_COMMANDS:
        try:
            vocab.resolve_vocabulary(args, args.cmd)
        except ValueError as e:
            parser.error(str(e))
    tune_malloc()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
