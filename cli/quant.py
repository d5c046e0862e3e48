"""``pdserve quantize``, ``pdserve tune-moe`` and ``pdserve eval-quant`` (registered by cli.main).

    pdserve quantize --model IN_DIR --out OUT_DIR --format mxfp4 [--scale-mode even|floor]
    pdserve tune-moe [--shapes glm5 glm5-s4 tiny peer 6144,2048,256,8 ...] [--tokens 1,16,4096]
    pdserve eval-quant [--model DIR] [--formats mxfp4,mxfp6_e2m3,...] [--text FILE]

The commands themselves are ``cli.quant_commands``, imported when one runs (the CLI must start fast for the
router and `pdserve bench`, without torch).
"""
from __future__ import annotations

import argparse

MX_FORMAT_NAMES = ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8")


def _command(name: str):
    """``cli.quant_commands.<name>``, imported when the command runs."""
    def run(args: argparse.Namespace) -> int:
        # heavy: torch, triton, safetensors (the commands' engine); registering them must not load it
        from cli import quant_commands
        return getattr(quant_commands, name)(args)
    return run


def register(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("quantize", help="bf16 HF checkpoint -> AMD Quark MX export layout (routed experts)")
    q.add_argument("--model", required=True, help="input model directory (bf16/fp32 safetensors)")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--format", default="mxfp4", choices=MX_FORMAT_NAMES, help="MX format of the routed experts")
    q.add_argument("--scale-mode", default="even", choices=["even", "floor"],
                   help="E8M0 shared exponent: even (Quark's default) or floor (OCP MX spec)")
    q.add_argument("--act-format", default="none", choices=("none",) + MX_FORMAT_NAMES,
                   help="also quantize expert inputs dynamically at run time (Quark's W+A schemes)")
    q.add_argument("--keep-mtp-experts", action="store_true", help="leave the MTP layer's routed experts bf16")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(fn=_command("cmd_quantize"))

    t = sub.add_parser("tune-moe", help="benchmark MX MoE strategies per token count; write tuned tables")
    t.add_argument("--shapes", nargs="+", default=["glm5", "glm5-s4", "tiny", "peer"],
                   help="named shapes (glm5, glm5-s4, tiny, peer) or H,N,E,topk")
    t.add_argument("--dtype", default="mxfp4", choices=MX_FORMAT_NAMES, help="weight format")
    t.add_argument("--tokens", default=None, help="comma-separated token counts (default 1..4096, powers of 2)")
    t.add_argument("--impls", default=None, help="comma-separated strategies (default: all)")
    t.add_argument("--device", default="auto", help="torch device: auto (CUDA/ROCm when present, else cpu), cpu, cuda, cuda:1, ...")
    t.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16", "float16"], help="dtype the kernels compute in (default: bfloat16 on a GPU, float32 on a CPU)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads while timing (default: torch's)")
    t.add_argument("--max-run-s", type=float, default=5.0,
                   help="stop growing the token count once the fastest strategy takes longer than this")
    t.add_argument("--out", default=None, help="table directory (default: engine/moe/tuned, shipped)")
    t.add_argument("--verbose-timings", action="store_true", help="print every candidate's timing, not only the winners")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(fn=_command("cmd_tune_moe"))

    e = sub.add_parser("eval-quant", help="KL / top-1 / perplexity of MX formats against the bf16 model")
    e.add_argument("--model", default=None, help="model directory (default: the default model)")
    e.add_argument("--formats", default=",".join(MX_FORMAT_NAMES), help="comma-separated MX formats to evaluate")
    e.add_argument("--text", default=None, help="held-out text file (needs tokenizer.json in the model dir)")
    e.add_argument("--num-tokens", type=int, default=512, help="tokens of held-out text to evaluate on")
    e.add_argument("--scale-mode", default="even", choices=["even", "floor"], help="MX scale rounding (even: OCP MX round-to-nearest-even; floor: the spec's floor)")
    e.add_argument("--device", default="cpu", help="torch device to evaluate on")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=_command("cmd_eval_quant"))

