"""Served speculation past ``index_topk`` (issue 24): ``pdserve serve --no-spec-fallback`` with a tree (4/2/8)
on a GLM-5-architecture model whose ``index_topk`` is 8, fp32, the checkpoint's weights. Each served
greedy answer equals in-process plain greedy decoding of the same checkpoint, for prompts of 1x-8x
``index_topk`` (prefilled by the prefill worker and shipped with their MTP draft state), a prompt whose
prefix came from the prefix cache, and one short enough to be prefilled on the decode worker itself;
every decode round speculated (none waited for a draft state), and every page comes back.
"""
import pytest
import torch
from test_spec_dsa import DSA, LENS, TOPK, make_predictable

from engine.checkpoint import init_random_model
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from router.client import GenerationClient
from serve_helpers import ServeProcess, pages_all_free
from shared_helpers import wait_until

SPEC = "4/2/8"
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-spec-dsa")
    model = make_predictable(init_random_model(DSA, str(d / "random"), std=0.08), str(d / "model"))
    sp = ServeProcess(["--model", model, "--port", "0", "--prefill", "1", "--decode", "1", "--dtype", "float32",
                       "--decode-weights", "model", "--speculative", SPEC, "--no-spec-fallback",
                       "--num-pages", "256", "--local-prefill-below", str(TOPK),
                       "--run-dir", str(d / "run")], str(d / "serve.out"))
    try:
        sp.wait_listening()
        with GenerationClient(sp.address, timeout_s=120) as c:
            yield c, model
    finally:
        sp.stop()


def test_served_speculation_equals_plain_greedy_past_index_topk(served):
    client, model_dir = served
    model, cfg = load_model(model_dir, "float32", "cpu")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    prompts.append(prompts[-1][:5 * TOPK] + prompts[0])  # its first 40 tokens are in the prefix cache
    prompts.append(prompts[0][:TOPK - 3])  # below --local-prefill-below: prefilled on the decode worker
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    dec = next(w for w in client.cluster_status().workers if w.role == "decode")
    assert dec.info["speculative"] == SPEC and dec.info["spec_fallback"] == "off"
    for i, prompt in enumerate(prompts):
        ref = Engine(model, cfg, kv_dtype="float32", page_size=16, num_pages=64).generate([prompt], params)[0]
        out = client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        first = next((j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), None)
        assert first is None and len(out.token_ids) == MAX_TOKENS, \
            f"prompt {i} ({len(prompt)} tokens) diverges at token {first}"
        if i == len(LENS):
            assert out.usage.cached_tokens >= 32  # whole pages of the shared 40-token prefix
    s = next(w for w in client.cluster_status().workers if w.role == "decode").spec
    # the first round of every request after its transfer (or local prefill) already had a draft state
    assert s.verify_steps > 0 and s.drafted_at_depth[0] == s.verify_steps
    assert s.accept_len > 1.5
    wait_until(lambda: pages_all_free(client), what="every page back")
