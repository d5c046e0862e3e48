"""``pdserve run --tp 2`` (rank 0 in the command's process, rank 1 a child, gloo on CPU) gives the tokens of
``--tp 1``, speculation on (the shipped default model has an MTP layer: ``forward_mtp``, ``logits`` and
``move_kv`` go through the ranks) and off, with ``PDSERVE_RANK_CHECK=1`` (the ranks compare their logits after
every model call, so a pool write not mirrored to rank 1 fails the run); no rank process outlives it. A checkpoint
whose vocabulary does not split 2 ways (311 ids: padded to 312) runs too, with the ``--tp 1`` tokens."""
import json
import os
import subprocess
import sys

import pytest

from engine.checkpoint import TINY_GLM5, init_random_model
from engine.defaults import SHIPPED_DEFAULT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "3,5,7,9,11,13,17,19,23"

needs_default = pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")),
                                   reason="no default model")


def run(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "cli", "run", "--token-ids", PROMPT, "--max-tokens", "40",
                          "--ignore-eos", "--dtype", "float32", "--decode-weights", "model", "--json", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
                         env={**os.environ, "PDSERVE_RANK_CHECK": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def followers() -> set[int]:
    """Live ``worker.follower`` processes on this machine."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"worker.follower" in f.read():
                    pids.add(int(entry))
        except (OSError, ValueError):
            continue
    return pids


@needs_default
@pytest.mark.parametrize("spec", ["3/2/6", "off"])
def test_run_tp2_gives_the_tp1_tokens(spec):
    before = followers()
    one = run("--speculative", spec)
    two = run("--speculative", spec, "--tp", "2")
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 40
    assert not followers() - before, "the follower rank exits with the command"


def test_run_tp2_on_an_odd_vocabulary(tmp_path):
    """Formerly refused (``cannot split the model 2 ways: vocab_size=311``): the tiny GLM-5 (MTP layer, so
    speculation on) with 311 ids gives the ``--tp 1`` tokens, every one a real id."""
    d = init_random_model(dict(TINY_GLM5, vocab_size=311, num_hidden_layers=2), str(tmp_path / "odd"), seed=5)
    one = run("--model", d, "--max-tokens", "16")  # the later flag wins: 16 tokens keep the test short
    two = run("--model", d, "--max-tokens", "16", "--tp", "2")
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 16
    assert max(one["token_ids"]) < 311 and one["speculative"] != "off"
