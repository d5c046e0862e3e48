"""pdserve eval-quant: KL, top-1 agreement and perplexity of MX formats against the unquantized model."""
import json

import pytest
import torch

from engine.checkpoint import TINY_GLM5, init_random_model
from engine.quant.evaluate import compare_logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_eval"))
    init_random_model(TINY_GLM5, d, seed=5)
    return d


def test_compare_logits_definitions():
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    kl, kl_max, top1, ppl_ref, ppl_q = compare_logits(ref, ref.clone(), [0, 1, 2])
    assert kl == pytest.approx(0, abs=1e-7) and top1 == 1.0 and ppl_q == pytest.approx(ppl_ref)
    p = ref.log_softmax(-1)
    assert ppl_ref == pytest.approx(torch.exp(-(p[0, 1] + p[1, 2]) / 2).item(), rel=1e-6)
    q = ref.flip(-1)
    kl, kl_max, top1, _, _ = compare_logits(ref, q, [0, 1, 2])
    want = (p.exp() * (p - q.log_softmax(-1))).sum(-1)
    assert kl == pytest.approx(want.mean().item(), rel=1e-5) and kl_max == pytest.approx(want.max().item(), rel=1e-5)
    assert top1 == pytest.approx(1 / 3)


def test_eval_quant_cli_orders_formats(model_dir, capsys):
    from cli.main import main
    assert main(["eval-quant", "--model", model_dir, "--formats", "mxfp4,mxfp8", "--num-tokens", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_tokens"] == 40 and report["token_source"].startswith("pseudo-text")
    fp4, fp8 = report["results"]
    assert fp4["fmt"] == "mxfp4" and fp8["fmt"] == "mxfp8"
    assert 0 < fp8["kl_mean"] < fp4["kl_mean"] and 0 < fp4["top1_agreement"] <= fp8["top1_agreement"] <= 1
    assert fp4["ppl_ref"] == pytest.approx(fp8["ppl_ref"]) and fp4["ppl_delta"] == pytest.approx(
        fp4["ppl_quant"] - fp4["ppl_ref"])
    assert fp4["expert_bytes_ratio"] == pytest.approx(4.25 / 16) and fp8["expert_bytes_ratio"] == pytest.approx(8.25 / 16)
