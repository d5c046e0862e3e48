"""Speculation statistics over real gRPC: ``pdserve serve --speculative 5/1/6 --no-spec-fallback`` (router +
1 prefill + 1 decode worker processes) on the shipped default model, read back with ``GetClusterStatus``.

The decode worker's per-position acceptance rates travel as ``WorkerStatus.spec`` through the router;
they are checked against their own counts and against the tokens the client received (each verify step
emits its accepted drafts plus one token; the last step of a request may be cut at ``max_tokens``).
"""
import os
import sys

import pytest
import torch

from engine.defaults import SHIPPED_DEFAULT
from engine.load import load_model
from engine.sampling import SamplingParams
from engine.speculative import run_speculative
from engine.tokenizer import Tokenizer
from router.client import GenerationClient
from serve_helpers import ServeProcess, pages_all_free
from shared_helpers import wait_until

NUM_STEPS = 5
PROMPTS = ["import os\n\n\ndef read_lines(path):\n", "class Config:\n    def __init__(self, name):\n"]
MAX_TOKENS = 40

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")),
                                reason="no default model")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-spec")
    sp = ServeProcess(["--port", "0", "--prefill", "1", "--decode", "1", "--decode-weights", "model", "--dtype", "float32",
                       "--speculative", f"{NUM_STEPS}/1/{NUM_STEPS + 1}", "--no-spec-fallback", "--num-pages", "128",
                       "--run-dir", str(d / "run")], str(d / "serve.out"))
    try:
        sp.wait_listening()
        with GenerationClient(sp.address, timeout_s=120) as c:
            yield c
    finally:
        sp.stop()


def decode_status(client):
    return next(w for w in client.cluster_status().workers if w.role == "decode")


def test_cluster_status_reports_per_position_acceptance(client):
    st = client.cluster_status()
    pre = next(w for w in st.workers if w.role == "prefill")
    dec = next(w for w in st.workers if w.role == "decode")
    assert not pre.HasField("spec") and dec.HasField("spec")
    assert dec.info["spec_fallback"] == "off" and dec.info["speculative"] == "5/1/6"  # --no-spec-fallback arrived
    before = dec.spec
    assert before.config == "5/1/6" and list(before.accept_rate_per_position) == [0.0] * NUM_STEPS
    emitted = 0
    for p in PROMPTS:
        out = client.generate(prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        emitted += len(out.token_ids) - 1  # the first token comes from the prefill worker
    s = decode_status(client).spec
    steps, acc = s.verify_steps - before.verify_steps, s.accepted_drafts - before.accepted_drafts
    assert steps + acc - NUM_STEPS * len(PROMPTS) <= emitted <= steps + acc
    assert len(s.accept_rate_per_position) == len(s.accept_rate_at_least) == NUM_STEPS
    assert list(s.accept_rate_per_position) == pytest.approx(
        [a / r for a, r in zip(s.accepted_at_depth, s.reached_at_depth)])
    assert list(s.accept_rate_at_least) == pytest.approx(
        [a / d for a, d in zip(s.accepted_at_depth, s.drafted_at_depth)])
    assert sum(s.accepted_at_depth) == s.accepted_drafts and s.draft_tokens == NUM_STEPS * s.drafted_at_depth[0]
    assert all(r <= d for r, d in zip(s.reached_at_depth, s.drafted_at_depth))
    assert s.reached_at_depth[0] == s.drafted_at_depth[0]  # depth 1 is tried whenever there are drafts
    assert 0 < s.accept_rate_per_position[0] < 1 and s.reached_at_depth[-1] > 0
    assert s.accept_len == pytest.approx(1 + s.accepted_drafts / s.verify_steps)
    wait_until(lambda: pages_all_free(client), what="every page back")


def heldout_prompts(n: int, num_tokens: int, tok) -> list[list[int]]:
    """The default model's held-out files (never trained on), ``num_tokens`` tokens from the start of each."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from scripts.default_model.corpus import CorpusError, load_corpus
    manifest = os.path.join(os.path.dirname(SHIPPED_DEFAULT), os.pardir, "corpus", "manifest.json")
    try:
        texts = [text for _, text in load_corpus(manifest)["heldout"][:n]]
    except CorpusError:  # another CPython's stdlib: our own test sources are not in the corpus either
        here = os.path.dirname(os.path.abspath(__file__))
        texts = [open(os.path.join(here, f)).read() for f in sorted(os.listdir(here)) if f.endswith(".py")][:n]
    return [tok.encode(t)[:num_tokens] for t in texts]


def test_served_accept_length_matches_in_process_run(client):
    """The decode worker's rounds speculate as ``pdserve run`` does: the first round after the transfer has
    the shipped draft state, so the served accept length is the in-process one (within 5%)."""
    model, cfg = load_model(SHIPPED_DEFAULT, "float32", "cpu")
    prompts = heldout_prompts(4, 200, Tokenizer.from_model_dir(SHIPPED_DEFAULT))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    before = decode_status(client).spec
    served = []
    for p in prompts:
        out = client.generate(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
        served.append(out.metrics.accept_len)
    torch.set_num_threads(1)
    local = [run_speculative(model, cfg, [p], params, f"{NUM_STEPS}/1/{NUM_STEPS + 1}").metrics.accept_len
             for p in prompts]
    assert sum(served) / len(served) == pytest.approx(sum(local) / len(local), rel=0.05), (served, local)
    s = decode_status(client).spec
    assert s.verify_steps > before.verify_steps
    # every round of these requests drafted: none waited for a draft state after its transfer
    assert s.drafted_at_depth[0] - before.drafted_at_depth[0] == s.verify_steps - before.verify_steps
    wait_until(lambda: pages_all_free(client), what="every page back")
