"""The ``pdserve`` command line. Each subcommand imports only what it needs (the router never loads torch)."""
from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from cli import vocab


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens whose probability reaches this")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the most likely one")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def cmd_run(args: argparse.Namespace) -> int:
    # heavy: torch, safetensors (the in-process engine); the parser, --help and the serving commands never load it
    from cli import offline
    return offline.cmd_run(args)


def cmd_init_model(args: argparse.Namespace) -> int:
    # heavy: torch, safetensors (the random checkpoint's writer); as cmd_run
    from cli import offline
    return offline.cmd_init_model(args)


def cmd_demo(args: argparse.Namespace) -> int:
    # the demo's cluster and client (router.client, engine): the parser that `pdserve bench` builds must not load
    # them (tests/bench/test_config.py)
    from bench.demo import main as demo_main
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
