"""Quality of quantized checkpoints against the unquantized model on a held-out text.

For each format: quantize the checkpoint (engine.quant.quantize), load it the way ``pdserve run``
does (engine.load.load_model), run the same token ids through both models in one prefill, and
compare next-token distributions at every position:

* KL(P_ref || P_quant), nats, mean (and max) over positions;
* top-1 agreement: fraction of positions whose argmax token is the same;
* perplexity of the text under each model, and the difference (quant - ref).

Token ids: the held-out text encoded with the model's tokenizer.json when there is one (``--text``,
else ``HELD_OUT_TEXT``); without a tokenizer, a deterministic pseudo-text: tokens sampled at
temperature 1 from the reference model with a fixed seed (so its perplexity is meaningful).
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import NamedTuple, Sequence

import torch

from engine.batch import BatchRequest, ForwardBatch
from engine.kvcache import KVLayout, KVPool
from engine.load import load_model
from engine.offline import Engine
from engine.quant.prepare import quantized_experts
from engine.quant.quantize import quantize_checkpoint
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer

HELD_OUT_TEXT = (
    "The lighthouse keeper wrote the weather into the log twice a day, at six in the morning and six in "
    "the evening, whether or not anything had changed. Wind from the south-west, moderate, veering west "
    "later; visibility good; sea slight. In the margins she kept a second record that nobody had asked "
    "for: the number of gulls on the rail, the colour of the water where the current met the bay, the "
    "ships that passed without signalling. After eleven years the two columns had become a kind of "
    "conversation, one written for the office on the mainland and one written for herself.\n\n"
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n"
)
"""Default held-out text (written for this file, so no training set contains it)."""


class QuantEvalResult(NamedTuple):
    fmt: str
    kl_mean: float
    """Mean over positions of KL(P_ref || P_quant), nats."""
    kl_max: float
    top1_agreement: float
    ppl_ref: float
    ppl_quant: float
    expert_bytes_ratio: float
    """MX routed-expert weight bytes / the same weights in bf16."""

    @property
    def ppl_delta(self) -> float:
        return self.ppl_quant - self.ppl_ref


class QuantEvalReport(NamedTuple):
    model_dir: str
    token_source: str
    """"tokenizer:<file>" or "pseudo-text (sampled from the reference model, seed 0)"."""
    num_tokens: int
    results: list[QuantEvalResult]

    def markdown(self) -> str:
        lines = [f"model `{self.model_dir}`, {self.num_tokens} tokens ({self.token_source})", "",
                 "| format | KL mean (nats) | KL max | top-1 agreement | ppl unquantized | ppl quant | ppl delta | "
                 "expert bytes vs bf16 |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in self.results:
            lines.append(f"| {r.fmt} | {r.kl_mean:.5f} | {r.kl_max:.4f} | {r.top1_agreement:.1%} | {r.ppl_ref:.2f} | "
                         f"{r.ppl_quant:.2f} | {r.ppl_delta:+.3f} | {r.expert_bytes_ratio:.3f} |")
        return "\n".join(lines)


def all_logits(model, cfg, ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, V] (fp32) at every position of ``ids`` in one prefill on a fresh KV pool."""
    page = 16
    dev = model.lm_head.weight.device
    pool = KVPool(KVLayout.for_model(cfg, page, "float32"), -(-len(ids) // page) + 1, device=dev)
    pages = pool.allocator.alloc(pool.pages_for(len(ids)), "eval")
    batch = ForwardBatch.build([BatchRequest(pages, 0, list(ids))], page, dev)
    return model(batch, pool, all_logits=True).logits.float()


def compare_logits(ref: torch.Tensor, quant: torch.Tensor, ids: Sequence[int]) -> tuple[float, float, float, float, float]:
    """(kl_mean, kl_max, top1_agreement, ppl_ref, ppl_quant); position i predicts ids[i + 1]."""
    lp_ref, lp_q = ref.log_softmax(-1), quant.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1)  # [T]
    top1 = (ref.argmax(-1) == quant.argmax(-1)).float().mean().item()
    target = torch.as_tensor(list(ids[1:]), device=ref.device)
    nll_ref = -lp_ref[:-1].gather(1, target[:, None]).mean().item()
    nll_q = -lp_q[:-1].gather(1, target[:, None]).mean().item()
    return kl.mean().item(), kl.max().item(), top1, math.exp(nll_ref), math.exp(nll_q)


def eval_token_ids(model_dir: str, model, cfg, text_path: str | None, num_tokens: int) -> tuple[list[int], str]:
    tok = Tokenizer.from_model_dir(model_dir)
    if tok is not None:
        text = HELD_OUT_TEXT
        if text_path is not None:
            with open(text_path, encoding="utf-8") as f:
                text = f.read()
        ids = [i for i in tok.encode(text) if i < cfg.vocab_size][:num_tokens]
        if len(ids) >= 2:
            return ids, f"tokenizer.json on {text_path or 'the built-in held-out text'}"
    if text_path is not None and tok is None:
        raise ValueError(f"--text needs a tokenizer.json in {model_dir}")
    start = cfg.bos_token_id if cfg.bos_token_id is not None else 0
    eng = Engine(model, cfg, num_pages=num_tokens // 16 + 8)
    params = SamplingParams(max_tokens=num_tokens - 1, temperature=1.0, seed=0, ignore_eos=True)
    out = eng.generate([[start]], params)[0]
    return [start] + out.token_ids, "pseudo-text (sampled from the reference model at temperature 1, seed 0)"


def evaluate_quant(model_dir: str, formats: Sequence[str], text_path: str | None = None, num_tokens: int = 512,
                   scale_mode: str = "even", device: str = "cpu", progress: bool = False) -> QuantEvalReport:
    """Quantize ``model_dir`` to each of ``formats`` and compare against the unquantized model."""
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2, got {num_tokens}")
    ref_model, cfg = load_model(model_dir, "float32", device)
    ids, source = eval_token_ids(model_dir, ref_model, cfg, text_path, num_tokens)
    ref = all_logits(ref_model, cfg, ids)
    results = []
    for fmt in formats:
        with tempfile.TemporaryDirectory(prefix=f"pdserve-eval-{fmt}-") as tmp:
            out_dir = os.path.join(tmp, "q")
            quantize_checkpoint(model_dir, out_dir, fmt, scale_mode, progress=progress)
            model, qcfg = load_model(out_dir, "float32", device)
            experts = quantized_experts(model)
            mx_bytes = sum(m.weight_bytes() for m in experts.values())
            bf16_bytes = sum(m.dense_bytes(torch.bfloat16) for m in experts.values())
            kl_mean, kl_max, top1, ppl_ref, ppl_q = compare_logits(ref, all_logits(model, qcfg, ids), ids)
            results.append(QuantEvalResult(fmt, kl_mean, kl_max, top1, ppl_ref, ppl_q,
                                           mx_bytes / bf16_bytes if bf16_bytes else float("nan")))
            del model
    return QuantEvalReport(model_dir, source, len(ids), results)
