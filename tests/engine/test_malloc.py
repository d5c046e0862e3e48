"""``tune_malloc``: a batched decode step stops page-faulting its temporaries (measured in subprocesses,
since malloc thresholds are process-wide and cannot be unset)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, resource, torch
torch.set_num_threads(1)
from engine.load import load_model
from engine.offline import Engine, Seq
from engine.defaults import default_model_dir, tune_malloc
from engine.sampling import SamplerState, SamplingParams
tuned = tune_malloc()
model, cfg = load_model(default_model_dir(), "float32", "cpu")
B = 32
prompts = torch.randint(2, cfg.vocab_size, (B, 256), generator=torch.Generator().manual_seed(0)).tolist()
eng = Engine(model, cfg, page_size=16, num_pages=B * 20 + 8)
params = SamplingParams(max_tokens=100, ignore_eos=True)
seqs = [Seq(f"r{i}", p, SamplerState(params, p)) for i, p in enumerate(prompts)]
for s in seqs:
    eng._append([s], eng.prefill(s))
for _ in range(3):
    eng.decode_step(seqs)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    eng.decode_step(seqs)
print(json.dumps({"tuned": tuned, "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10}))
"""


def _faults(tune: bool) -> dict:
    env = {**os.environ, "PDSERVE_TUNE_MALLOC": "1" if tune else "0", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_batched_decode_does_not_refault_its_temporaries():
    base, tuned = _faults(False), _faults(True)
    assert tuned["tuned"] and not base["tuned"]
    if base["faults_per_step"] < 50:
        pytest.skip(f"this C library does not re-fault decode temporaries ({base['faults_per_step']}/step)")
    assert tuned["faults_per_step"] < base["faults_per_step"] / 10, (base, tuned)
