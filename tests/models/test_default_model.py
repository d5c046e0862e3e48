"""The shipped default model (models/glm5-tiny): loads with pdserve and transformers with matching logits,
predicts held-out code far better than chance (main head and MTP head), and its corpus manifest verifies."""
import json
import math
import os
import sys

import pytest
import torch
from safetensors import safe_open
from tiny import transformers_ties_by_position

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
MODEL_DIR = os.path.join(ROOT, "models", "glm5-tiny")
MANIFEST = os.path.join(ROOT, "corpus", "manifest.json")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL_DIR, "config.json")),
                                reason="models/glm5-tiny not shipped (train it: python -m scripts.train_default_model)")

# Written for this test (not in the corpus); longer than index_topk, so DSA selects in every layer.
SNIPPET = '''import os
import sys


class Config:
    """A small configuration object read from the environment."""

    def __init__(self, name, default=None):
        self.name = name
        self.default = default

    def get(self):
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        return value

    def __repr__(self):
        return f"{self.__class__.__name__}({self.name!r}, default={self.default!r})"


def parse_args(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    options = {}
    for arg in argv:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            options[key] = value or True
    return options


def main():
    options = parse_args()
    for key, value in sorted(options.items()):
        print("%s = %s" % (key, value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


@pytest.fixture(scope="module")
def shipped():
    from engine.load import load_model
    from engine.tokenizer import Tokenizer
    model, cfg = load_model(MODEL_DIR, "float32", "cpu")
    return model, cfg, Tokenizer.from_model_dir(MODEL_DIR)


def _pdserve_forward(model, cfg, ids):
    """Main logits [T, V] and, with MTP, t+2 logits [T-1, V] for ``ids`` (one request)."""
    from engine.batch import BatchRequest, ForwardBatch
    from engine.kvcache import KVLayout, KVPool
    T = len(ids)
    pool = KVPool(KVLayout.for_model(cfg, 16, "float32"), T // 16 + 4)
    pages = pool.allocator.alloc(pool.pages_for(T), "t")
    with torch.inference_mode():
        out = model(ForwardBatch.build([BatchRequest(pages, 0, ids)], 16), pool, all_logits=True)
        mtp = model.forward_mtp(ForwardBatch.build([BatchRequest(pages, 0, ids[1:])], 16), pool, out.hidden[:-1],
                                all_logits=True)
    return out.logits, mtp.logits


def test_config_and_tensors_are_consistent(shipped):
    model, cfg, tok = shipped
    assert cfg.model_type == "glm_moe_dsa" and cfg.num_mtp_layers == 1 and model.has_mtp
    assert cfg.n_routed_experts >= 8 and cfg.n_shared_experts == 1 and cfg.mlp_layer_types[0] == "dense"
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    assert tok.vocab_size == raw.get_vocab_size() == cfg.vocab_size
    assert raw.id_to_token(cfg.bos_token_id) == "<|bos|>" and raw.id_to_token(cfg.eos_token_ids[0]) == "<|eos|>"
    with safe_open(os.path.join(MODEL_DIR, "model.safetensors"), "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    fp32 = {n for n, d in dtypes.items() if d == "F32"}
    assert fp32 and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight"))
                        for n in fp32)
    assert {d for n, d in dtypes.items() if n not in fp32} == {"BF16"}
    N = cfg.num_hidden_layers
    assert f"model.layers.{N}.eh_proj.weight" in dtypes and f"model.layers.{N}.mlp.experts.7.down_proj.weight" in dtypes


def test_pdserve_matches_transformers(shipped):
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging as hf_logging
    model, cfg, tok = shipped
    ids = tok.encode(SNIPPET)
    assert len(ids) > cfg.index_topk  # the DSA indexer selects a subset in both implementations
    hf_logging.set_verbosity_error()
    hf = GlmMoeDsaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.inference_mode(), transformers_ties_by_position():  # equal indexer scores: the earlier key
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    ours, _ = _pdserve_forward(model, cfg, ids)
    assert (ours - ref).abs().max().item() < 1e-3


def test_snippet_perplexity_far_below_uniform(shipped):
    model, cfg, tok = shipped
    ids = tok.encode(SNIPPET)
    logits, mtp_logits = _pdserve_forward(model, cfg, ids)
    target = torch.tensor(ids)
    ppl = math.exp(torch.nn.functional.cross_entropy(logits[:-1], target[1:]).item())
    assert ppl < cfg.vocab_size / 50, ppl
    mtp_top1 = (mtp_logits[:-1].argmax(-1) == target[2:]).float().mean().item()
    assert mtp_top1 > 0.2, mtp_top1  # the MTP head predicts t+2 far better than chance (1/vocab)


def test_heldout_perplexity_far_below_uniform(shipped):
    from scripts.default_model.corpus import CorpusError, load_corpus
    model, cfg, tok = shipped
    try:
        heldout = load_corpus(MANIFEST)["heldout"]
    except CorpusError as e:
        pytest.skip(f"stdlib is not the pinned CPython 3.11.7: {str(e)[:200]}")
    nll, n = 0.0, 0
    for _path, text in heldout[:4]:
        ids = tok.encode(text)[:256]
        logits, _ = _pdserve_forward(model, cfg, ids)
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        n += len(ids) - 1
    ppl = math.exp(nll / n)
    assert ppl < cfg.vocab_size / 50, ppl


def test_manifest_hashes_verify():
    from scripts.default_model.corpus import PINNED_PYTHON, default_stdlib_dir, python_version, read_manifest, verify
    if python_version() != PINNED_PYTHON:
        pytest.skip(f"corpus pinned to CPython {PINNED_PYTHON}, this is {python_version()}")
    files = read_manifest(MANIFEST)
    with open(MANIFEST) as f:
        meta = json.load(f)
    assert meta["python_version"] == PINNED_PYTHON
    assert {f.split for f in files} == {"train", "heldout"}
    verify(files, default_stdlib_dir())  # raises CorpusError naming any mismatch


def test_manifest_mismatch_fails_clearly(tmp_path):
    from scripts.default_model.corpus import CorpusError, CorpusFile, verify
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(CorpusError, match=r"a\.py: sha256 .* != manifest.*b\.py: missing"):
        verify([CorpusFile("a.py", "0" * 64, 6, "train"), CorpusFile("b.py", "0" * 64, 1, "heldout")], str(tmp_path))
