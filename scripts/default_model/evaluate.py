"""Evaluate an exported default model with pdserve's engine and with transformers.

``python -m scripts.default_model.evaluate models/glm5-tiny [--spec]`` prints a JSON report:

* ``logits_max_abs_diff``: pdserve (fp32) vs transformers (fp32) on a held-out window longer than
  ``index_topk`` (so both run DSA's sparse selection);
* ``heldout_ppl`` vs ``uniform_ppl`` (= vocab size), ``main_top1`` (t+1 accuracy);
* ``mtp_top1``: the MTP head's top-1 accuracy for t+2 given the true t+1 and the main hidden state
  (a proxy for draft acceptance), ``mtp_chain_top1``: t+3 from the MTP layer chained on its own output;
* ``dsa_ppl``: transformers' held-out perplexity at several ``index_topk`` (the dense value = no selection);
* ``sample``: a greedy continuation of a held-out prompt;
* ``accept_len`` (with ``--spec``): mean accept length of greedy MTP speculative decoding at 5/1/6 and 3/1/4
  (``engine.speculative.run_speculative``).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import run_speculative
from scripts.default_model.corpus import load_corpus
from scripts.default_model.data import encode_stream, strided_windows


def heldout_stream(model_dir: str, manifest: str, stdlib_dir: str | None = None) -> torch.Tensor:
    from tokenizers import Tokenizer  # lazy: tokenizers

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    return encode_stream(tok, [t for _, t in load_corpus(manifest, stdlib_dir)["heldout"]])


def _pool(cfg, num_tokens: int):
    return KVPool(KVLayout.for_model(cfg, 16, "float32"), num_tokens // 16 + 8)


@torch.inference_mode()
def pdserve_metrics(model, cfg, windows: torch.Tensor) -> dict:
    """Main NLL / t+1 accuracy, MTP t+2 and chained t+3 accuracy over ``windows`` [n, T + 3], one at a time."""
    T = windows.shape[1] - 3
    pool = _pool(cfg, T)
    pages = pool.allocator.alloc(pool.pages_for(T), "eval")
    nll, n, hit1, hit2, hit3 = 0.0, 0, 0, 0, 0
    for w in windows:
        ids = w.tolist()
        out = model(ForwardBatch.build([BatchRequest(pages, 0, ids[:T])], 16), pool, all_logits=True)
        nll += torch.nn.functional.cross_entropy(out.logits, w[1:T + 1], reduction="sum").item()
        hit1 += (out.logits.argmax(-1) == w[1:T + 1]).sum().item()
        n += T
        if model.has_mtp:
            m1 = model.forward_mtp(ForwardBatch.build([BatchRequest(pages, 0, ids[1:T + 1])], 16), pool,
                                   out.hidden, all_logits=True)
            hit2 += (m1.logits.argmax(-1) == w[2:T + 2]).sum().item()
            m2 = model.forward_mtp(ForwardBatch.build([BatchRequest(pages, 0, ids[2:T + 2])], 16), pool,
                                   m1.hidden, all_logits=True)
            hit3 += (m2.logits.argmax(-1) == w[3:T + 3]).sum().item()
    return {"heldout_nll": nll / n, "heldout_ppl": math.exp(nll / n), "main_top1": hit1 / n,
            "mtp_top1": hit2 / n, "mtp_chain_top1": hit3 / n, "num_tokens": n}


@torch.inference_mode()
def transformers_ppl(hf, windows: torch.Tensor, topks: list[int]) -> dict[int, float]:
    """Held-out perplexity of the transformers model at each DSA ``index_topk``."""
    out = {}
    T = windows.shape[1] - 1
    indexers = [layer.self_attn.indexer for layer in hf.model.layers if layer.self_attn.indexer is not None]
    saved = [i.index_topk for i in indexers]
    for k in topks:
        for i in indexers:
            i.index_topk = k
        nll = 0.0
        for chunk in windows.split(8):
            logits = hf(input_ids=chunk[:, :T]).logits
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                                     reduction="sum").item()
        out[k] = math.exp(nll / (windows.shape[0] * T))
    for i, k in zip(indexers, saved):
        i.index_topk = k
    return out


def greedy_sample(model, cfg, tok, prompt_ids: list[int], max_tokens: int) -> str:
    res = Engine(model, cfg, num_pages=64).generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
    return tok.decode(prompt_ids) + "⟨▶⟩" + tok.decode(res[0].token_ids)


def accept_lengths(model, cfg, prompts: list[list[int]], max_tokens: int) -> dict:
    out = {}
    for spec in ("5/1/6", "3/1/4"):
        t0 = time.perf_counter()
        r = run_speculative(model, cfg, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), spec)
        out[spec] = {"accept_len": r.metrics.accept_len, "verify_steps": r.metrics.num_verify_steps,
                     "accepted_at_depth": list(r.metrics.accepted_at_depth), "seconds": time.perf_counter() - t0}
    return out


def evaluate(model_dir: str, manifest: str = "corpus/manifest.json", stdlib_dir: str | None = None,
             num_windows: int = 48, window_len: int = 256, spec: bool = False, num_spec_prompts: int = 8) -> dict:
    from tokenizers import Tokenizer  # lazy: tokenizers
    from transformers import GlmMoeDsaForCausalLM  # lazy: transformers
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    stream = heldout_stream(model_dir, manifest, stdlib_dir)
    model, cfg = load_model(model_dir, "float32", "cpu")
    hf = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    report: dict = {"model_dir": model_dir, "vocab_size": cfg.vocab_size, "uniform_ppl": float(cfg.vocab_size),
                    "index_topk": cfg.index_topk, "window_len": window_len}
    # pdserve vs transformers on one window longer than index_topk (DSA active in both)
    L = max(window_len, cfg.index_topk + 64)
    ids = stream[1000:1000 + L]
    pool = _pool(cfg, L)
    with torch.inference_mode():
        ours = model(ForwardBatch.build([BatchRequest(pool.allocator.alloc(pool.pages_for(L), "x"), 0, ids.tolist())],
                                        16), pool, all_logits=True).logits
        ref = hf(input_ids=ids[None]).logits[0].float()
    report["logits_max_abs_diff"] = (ours - ref).abs().max().item()
    report["logits_compare_len"] = L
    windows = strided_windows(stream, window_len + 3, num_windows)
    report.update(pdserve_metrics(model, cfg, windows))
    topks = sorted({window_len, cfg.index_topk, cfg.index_topk // 2})
    report["dsa_ppl"] = {str(k): v for k, v in transformers_ppl(hf, windows[:, :window_len + 1], topks).items()}
    prompt = stream[5000:5000 + 48].tolist()
    report["sample"] = greedy_sample(model, cfg, tok, prompt, 96)
    if spec:
        prompts = [stream[s:s + 64].tolist() for s in range(0, 64 * 97 * num_spec_prompts, 64 * 97)]
        report["accept_len"] = accept_lengths(model, cfg, prompts[:num_spec_prompts], 96)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--manifest", default="corpus/manifest.json")
    ap.add_argument("--stdlib", default=None)
    ap.add_argument("--spec", action="store_true", help="also measure speculative accept length (engine.speculative)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(evaluate(args.model_dir, args.manifest, args.stdlib, spec=args.spec), indent=2))


if __name__ == "__main__":
    main()
