"""Train pdserve's default model: a small GLM-5-architecture (``glm_moe_dsa``) code model with an MTP layer.

    python -m scripts.train_default_model --out models/glm5-tiny

1. corpus: the CPython 3.11.7 stdlib files pinned in ``corpus/manifest.json``, sha256-verified
   (``scripts.default_model.corpus``); train/held-out split by whole files;
2. tokenizer: byte-level BPE (``tokenizers``) on the train files, ``<|bos|>`` = 0, ``<|eos|>`` = 1;
3. model: MLA + DSA indexer in every layer, a dense layer 0, MoE layers (8 routed experts top-2 + one
   shared), one MTP layer; trained on CPU in fp32 (no bf16 matmul units on these CPUs) with the main LM
   loss, the MTP loss (t+2, plus t+3 through the chained MTP layer), the DSA indexer warm-up KL and
   aux-loss-free router balancing (``scripts.default_model.model``);
4. schedule: AdamW, linear warm-up then cosine decay over ``--max-steps`` or ``--time-budget-min``,
   whichever ends first (the run is time-boxed on shared CPUs; the steps reached are recorded);
   SIGINT/SIGTERM stop training early and still export and evaluate;
5. export (bf16, router and indexer weights fp32) in the GLM Hugging Face layout, a partial
   export every ``--save-every-min`` to ``--work-dir``; then evaluation with pdserve and transformers
   (``scripts.default_model.evaluate``), written to ``training.json`` and ``README.md`` in the output.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time

# Under CPU contention (shared machines) OpenMP threads spinning at barriers while a sibling is descheduled
# make 2 threads ~8x slower than 1; passive waiting avoids that. Must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.defaults import PDSERVE_HOME  # noqa: E402
from scripts.default_model import corpus as corpus_mod  # noqa: E402
from scripts.default_model.data import BOS_ID, EOS_ID, encode_stream, random_windows, train_tokenizer  # noqa: E402
from scripts.default_model.evaluate import evaluate  # noqa: E402
from scripts.default_model.export import export  # noqa: E402
from scripts.default_model.model import TrainModel, balance_router_biases, check_against_transformers, glm_config  # noqa: E402

logger = logging.getLogger("train_default_model")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train pdserve's default glm_moe_dsa model on CPython stdlib sources.")
    a = ap.add_argument
    a("--out", default=os.path.join(REPO, "models", "glm5-tiny"), help="output model directory")
    a("--manifest", default=os.path.join(REPO, "corpus", "manifest.json"))
    a("--stdlib", default=None, help="stdlib directory (default: this interpreter's; or a CPython 3.11.7 Lib/)")
    a("--work-dir", default=os.path.join(PDSERVE_HOME, "train-default-model"), help="partial exports")
    a("--vocab-size", type=int, default=2048)
    a("--hidden", type=int, default=128)
    a("--layers", type=int, default=3, help="main layers (layer 0 dense, the rest MoE)")
    a("--heads", type=int, default=4)
    a("--experts", type=int, default=8)
    a("--top-k", type=int, default=2)
    a("--moe-inter", type=int, default=128)
    a("--dense-inter", type=int, default=384)
    a("--index-topk", type=int, default=128, help="DSA tokens selected per query at inference")
    a("--max-positions", type=int, default=4096)
    a("--seq-len", type=int, default=256)
    a("--batch-size", type=int, default=4)
    a("--lr", type=float, default=3e-3)
    a("--min-lr-ratio", type=float, default=0.1)
    a("--warmup-steps", type=int, default=30)
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0)
    a("--max-steps", type=int, default=100_000)
    a("--time-budget-min", type=float, default=22.0, help="stop (with the LR annealed) after this much training")
    a("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss (DeepSeek-V3: 0.3)")
    a("--mtp-steps", type=int, default=2, help="1 = t+2 only; 2 also trains the chained t+3 draft")
    a("--chain-weight", type=float, default=0.5, help="weight of chained MTP steps relative to the first")
    a("--indexer-every", type=int, default=4, help="DSA indexer KL every N steps (0 = never)")
    a("--bias-rate", type=float, default=1e-2, help="aux-loss-free router bias update per step")
    a("--threads", type=int, default=2)
    a("--seed", type=int, default=0)
    a("--log-every", type=int, default=10)
    a("--save-every-min", type=float, default=5.0)
    a("--no-eval", action="store_true")
    a("--spec-eval", action="store_true", help="also measure speculative accept length with engine.speculative")
    return ap.parse_args(argv)


class StopFlag:
    """Set by SIGINT/SIGTERM: training ends at the next step and the model is still exported."""

    def __init__(self) -> None:
        self.stop = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        logger.warning("signal %d: stopping after this step, then exporting", signum)
        self.stop = True


def lr_at(args, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def make_optimizer(model: TrainModel, args) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def train(model: TrainModel, stream: torch.Tensor, args, stop: StopFlag, tokenizer) -> dict:
    opt = make_optimizer(model, args)
    gates = model.moe_gates()
    gen = torch.Generator().manual_seed(args.seed)
    window = args.seq_len + 1 + args.mtp_steps
    budget_s = args.time_budget_min * 60
    t0 = last_log = last_save = time.perf_counter()
    history, load = [], torch.zeros(len(gates), args.experts)
    step, last_kl = 0, None
    model.train()
    while step < args.max_steps and not stop.stop:
        elapsed = time.perf_counter() - t0
        progress = max(step / args.max_steps, elapsed / budget_s if budget_s > 0 else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(args, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = random_windows(stream, args.batch_size, window, gen)
        use_idx = args.indexer_every > 0 and step % args.indexer_every == 0
        losses, counts = model(batch, args.mtp_steps, args.mtp_weight, args.chain_weight, use_idx)
        opt.zero_grad(set_to_none=True)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        balance_router_biases(gates, counts, args.bias_rate)
        load += torch.stack([c.float() for c in counts])
        if use_idx:
            last_kl = losses.indexer.item()
        step += 1
        if step % args.log_every == 0 or step == 1:
            now = time.perf_counter()
            frac = load / load.sum(-1, keepdim=True)
            rec = {"step": step, "elapsed_s": round(now - t0, 1), "lr": lr, "loss": round(losses.main.item(), 4),
                   "mtp": [round(x.item(), 4) for x in losses.mtp],
                   "indexer_kl": round(last_kl, 4) if last_kl is not None else None,
                   "expert_load_max_over_mean": round((frac.max(-1).values * args.experts).max().item(), 3)}
            history.append(rec)
            tok_s = (args.log_every if step > 1 else 1) * args.batch_size * args.seq_len / max(1e-9, now - last_log)
            logger.info("step %d  %.0fs  %.0f tok/s  lr %.2e  loss %.3f  mtp %s  kl %s  load max/mean %.2f",
                        step, now - t0, tok_s, lr, rec["loss"], rec["mtp"], rec["indexer_kl"],
                        rec["expert_load_max_over_mean"])
            last_log, load = now, torch.zeros_like(load)
        if args.save_every_min > 0 and time.perf_counter() - last_save > args.save_every_min * 60:
            path = export(model, tokenizer, os.path.join(args.work_dir, "partial"))
            logger.info("partial export at step %d: %s", step, path)
            last_save = time.perf_counter()
    model.eval()
    return {"steps": step, "train_seconds": round(time.perf_counter() - t0, 1),
            "tokens_seen": step * args.batch_size * args.seq_len, "history": history,
            "stopped_by": "signal" if stop.stop else ("max_steps" if step >= args.max_steps else "time_budget")}


def model_card_stub(cfg, report: dict, num_params: int, args) -> str:
    ev = report.get("eval", {})
    ppl = f"{ev['heldout_ppl']:.2f}" if "heldout_ppl" in ev else "n/a"
    mtp = f"{ev['mtp_top1']:.3f}" if "mtp_top1" in ev else "n/a"
    return f"""# glm5-tiny: pdserve's default model

A {num_params / 1e6:.2f}M-parameter GLM-5-architecture (`glm_moe_dsa`) causal LM with one MTP layer, trained
on CPU in {report['train']['train_seconds'] / 60:.1f} minutes ({report['train']['steps']} steps,
{report['train']['tokens_seen'] / 1e6:.2f}M tokens) on CPython 3.11.7 standard-library sources
(`corpus/manifest.json`) by `python -m scripts.train_default_model`. A test model for serving, speculative
decoding and quantization: it writes Python-looking code, nothing more.

- layers: {cfg.num_hidden_layers} (layer 0 dense, the rest MoE: {cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok}
  + 1 shared) + 1 MTP layer; hidden {cfg.hidden_size}; MLA ({cfg.num_attention_heads} heads, q_lora {cfg.q_lora_rank},
  kv_lora {cfg.kv_lora_rank}); DSA indexer top-{cfg.index_topk}; vocab {cfg.vocab_size} (byte-level BPE); trained on
  {args.seq_len}-token windows.
- held-out perplexity {ppl} (uniform: {cfg.vocab_size}); MTP t+2 top-1 accuracy {mtp}.
- weights bf16; router gate, `e_score_correction_bias` and indexer `weights_proj` fp32.

Full numbers: `training.json`; the model card: `docs/model_card.md`.
"""


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    stop = StopFlag()
    t_start = time.perf_counter()
    docs = corpus_mod.load_corpus(args.manifest, args.stdlib)
    logger.info("corpus verified: %d train / %d held-out files", len(docs["train"]), len(docs["heldout"]))
    texts = [t for _, t in docs["train"]]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    stream = encode_stream(tokenizer, texts)
    logger.info("tokenizer: vocab %d; train stream %d tokens", tokenizer.get_vocab_size(), stream.numel())
    cfg = glm_config(tokenizer.get_vocab_size(), hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                     dense_inter=args.dense_inter, moe_inter=args.moe_inter, num_experts=args.experts,
                     top_k=args.top_k, index_topk=args.index_topk, max_positions=args.max_positions,
                     bos_id=BOS_ID, eos_id=EOS_ID)
    model = TrainModel(cfg, seed=args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    diff = check_against_transformers(model, stream[:2 * args.seq_len].view(2, args.seq_len))
    logger.info("model: %.2fM parameters (MTP layer %.2fM); training forward vs transformers: max |dlogit| %.2e",
                num_params / 1e6, sum(p.numel() for p in model.mtp.parameters()) / 1e6, diff)
    if diff > 1e-3:
        raise RuntimeError(f"training forward disagrees with transformers (max |dlogit| {diff})")
    report = {"command": "python -m scripts.train_default_model " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": vars(args), "num_params": num_params, "torch": torch.__version__,
              "python": corpus_mod.python_version(), "train_tokens_in_corpus": stream.numel()}
    report["train"] = train(model, stream, args, stop, tokenizer)
    logger.info("trained %d steps in %.1f min (%s)", report["train"]["steps"], report["train"]["train_seconds"] / 60,
                report["train"]["stopped_by"])
    out = export(model, tokenizer, args.out)
    report["export_seconds_after_start"] = round(time.perf_counter() - t_start, 1)
    if not args.no_eval:
        report["eval"] = evaluate(out, args.manifest, args.stdlib, spec=args.spec_eval)
        logger.info("eval: %s", json.dumps({k: v for k, v in report["eval"].items() if k != "sample"}))
        logger.info("greedy sample:\n%s", report["eval"]["sample"])
    report["size_bytes"] = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(model_card_stub(model.hf.config, report, num_params, args))
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
