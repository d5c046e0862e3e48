"""A real AMD Quark (amd-quark 0.13, CPU) MXFP4 export of a tiny GLM-4.5 model, served by pdserve.

Quark's ``mxfp4`` scheme quantizes the routed experts' weights (static) and their inputs (dynamic
MXFP4); pdserve must read its layout and reproduce Quark's own fake-quantized forward.
The export runs in a subprocess: ``import quark.torch`` takes ~35 s (it imports every transformers
MoE model), and TORCHDYNAMO_DISABLE=1 keeps its fake-quant kernels eager (no inductor compile).
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from tiny import make_hf_model

from engine.moe.mx_experts import MXRoutedExperts
from engine.quant.evaluate import all_logits
from engine.quant.mx import quantize_mx
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("quark") is None,
                                reason="amd-quark not installed (pip install 'amd-quark==0.13.*')")

EXPORT = r"""
import os, sys
import torch
sys.path.insert(0, sys.argv[2])
from tiny import make_hf_model
from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
from quark.torch.utils.llm import preprocess_for_quantization

hf = make_hf_model("gqa")
ids = torch.randint(2, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
preprocess_for_quantization(hf)  # transformers >= 5: fused 3-D experts -> per-expert Linear
quantizer = ModelQuantizer(LLMTemplate.get("glm4_moe").get_config(scheme="mxfp4"))
hf = quantizer.quantize_model(hf, [ids])
with torch.no_grad():
    logits = hf(ids).logits[0]
hf = quantizer.freeze(hf)
export_safetensors(hf, sys.argv[1])
torch.save({"ids": ids[0], "logits": logits}, os.path.join(sys.argv[1], "quark_reference.pt"))
"""


@pytest.fixture(scope="module")
def quark_export(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("quark_mxfp4"))
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    r = subprocess.run([sys.executable, "-c", EXPORT, out, os.path.dirname(__file__)], env=env,
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_quark_export_serves_and_matches_quarks_forward(quark_export):
    ref = torch.load(os.path.join(quark_export, "quark_reference.pt"))
    model, cfg = load_model(quark_export, "float32", "cpu")
    for layer in model.model.layers[1:]:
        m = layer.mlp.experts
        assert isinstance(m, MXRoutedExperts) and m.spec.fmt.name == "mxfp4" and m.spec.scale_mode == "even"
        assert m.act_spec is not None and m.act_spec.fmt.name == "mxfp4"  # Quark's dynamic input quantization
    assert type(model.model.layers[1].mlp.shared_experts.gate_proj.weight) is torch.nn.Parameter
    ids = ref["ids"].tolist()
    got = all_logits(model, cfg, ids)
    torch.testing.assert_close(got, ref["logits"].float(), rtol=1e-4, atol=1e-4)
    out = Engine(model, cfg).generate([ids[:6]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


def test_quark_codes_and_scales_are_ours(quark_export):
    hf = make_hf_model("gqa")
    experts = hf.model.layers[2].mlp.experts
    I = hf.config.moe_intermediate_size
    with safe_open(os.path.join(quark_export, "model.safetensors"), "pt") as f:
        for name, w in (("gate_proj", experts.gate_up_proj[3, :I]), ("up_proj", experts.gate_up_proj[3, I:]),
                        ("down_proj", experts.down_proj[3])):
            q = quantize_mx(w.detach(), "mxfp4", "even")
            codes = f.get_tensor(f"model.layers.2.mlp.experts.3.{name}.weight")
            scales = f.get_tensor(f"model.layers.2.mlp.experts.3.{name}.weight_scale")
            assert torch.equal(scales, q.scales), name

            def plus_zero(c):  # Quark writes +0 where we (and torchao) keep -0
                lo, hi = c & 0x0F, c >> 4
                return torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)
            assert torch.equal(plus_zero(codes), plus_zero(q.codes)), name
