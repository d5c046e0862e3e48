"""``pdserve run`` end to end as a subprocess (the installed console script)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from tiny import make_hf_model

PDSERVE = os.path.join(os.path.dirname(sys.executable), "pdserve")


def test_run_json_matches_transformers_generate(tiny_dirs):
    hf = make_hf_model("dsa")
    hf.generation_config.eos_token_id = None
    prompt = [3, 17, 99, 42, 7, 64]
    out = subprocess.run([PDSERVE, "run", "--model", tiny_dirs["dsa"], "--token-ids", ",".join(map(str, prompt)),
                          "--max-tokens", "12", "--temperature", "0", "--dtype", "float32", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:]
    assert got["token_ids"] == ref.tolist() and got["finish_reason"] == "length"


def test_run_rejects_bad_token_ids(tiny_dirs):
    out = subprocess.run([PDSERVE, "run", "--model", tiny_dirs["dsa"], "--token-ids", "1,99999", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "[0, 128)" in out.stderr


def test_run_prompt_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from engine.checkpoint import TINY_GLM5, init_random_model
    init_random_model(TINY_GLM5, str(tmp_path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    out = subprocess.run([PDSERVE, "run", "--model", str(tmp_path), "--prompt", "def f(x):", "--max-tokens", "4",
                          "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got["token_ids"]) == 4 and isinstance(got["text"], str) and got["prompt_tokens"] > 0


def test_run_speculative_reports_accept_len_and_matches_plain(tmp_path):
    from engine.checkpoint import TINY_GLM5, init_random_model
    init_random_model(TINY_GLM5, str(tmp_path))  # has an MTP layer
    base = [PDSERVE, "run", "--model", str(tmp_path), "--token-ids", "3,17,99,42,7,64", "--max-tokens", "16",
            "--ignore-eos", "--json", "--dtype", "float32"]
    spec = subprocess.run(base + ["--speculative", "3/1/4"], capture_output=True, text=True, timeout=180)
    plain = subprocess.run(base + ["--no-speculative"], capture_output=True, text=True, timeout=180)
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["token_ids"] == p["token_ids"] and s["accept_len"] >= 1.0 and "accept_len" not in p


def test_run_json_reports_acceptance_per_position_on_the_default_model():
    """``accept_rate_per_position[d-1]`` = P(depth-d draft accepted | depth d tried); every step of
    ``pdserve run`` drafts all 3 depths, so the unconditional rates are the running products and their
    sum is the mean accepted drafts (``accept_len - 1``)."""
    from engine.defaults import SHIPPED_DEFAULT
    base = [PDSERVE, "run", "--model", SHIPPED_DEFAULT, "--prompt", "def main(argv):\n", "--max-tokens", "48",
            "--ignore-eos", "--json", "--dtype", "float32"]  # the shipped model is bf16: compare in float32
    spec = subprocess.run(base + ["--speculative", "3/1/4"], capture_output=True, text=True, timeout=180)
    plain = subprocess.run(base + ["--no-speculative"], capture_output=True, text=True, timeout=180)
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["token_ids"] == p["token_ids"] and s["speculative"] == "3/1/4"
    per_pos, at_least = s["accept_rate_per_position"], s["accept_rate_at_least"]
    assert len(per_pos) == len(at_least) == 3 and all(0 <= r <= 1 for r in per_pos + at_least)
    assert 0 < per_pos[0] < 1 and s["verify_steps"] > 0
    prod = 1.0
    for d in range(3):
        prod *= per_pos[d]
        assert at_least[d] == pytest.approx(prod, abs=2e-3)
    assert sum(at_least) == pytest.approx(s["accept_len"] - 1, abs=2e-3)
    assert not {"accept_len", "accept_rate_per_position", "accept_rate_at_least"} & set(p)
