"""Per-position acceptance rates of speculative decoding (``engine.speculative.metrics``).

The in-process test runs ``SpecEngine`` on the shipped default model (trained: its MTP drafts are
right about half the time, so every depth sees both outcomes) and recomputes every count from
scratch: it keeps the draft tree of each step and walks it along the plain engine's greedy tokens,
which is what lossless greedy verification must accept.
"""
import os

import pytest
import torch

from engine.defaults import SHIPPED_DEFAULT
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from engine.speculative import SpecConfig, SpecEngine
from engine.speculative.metrics import SpecMetrics, step_depths
from engine.speculative.tree import DraftTree
from engine.tokenizer import Tokenizer

PROMPT = '''import os


def read_lines(path):
    with open(path) as f:
        return [line.rstrip() for line in f]


def main():
'''
MAX_TOKENS = 64


def test_record_counts_by_hand():
    m = SpecMetrics()
    chain = DraftTree.chain(5, [6, 7, 8])
    m.record(1, 3, 2, *step_depths(chain.depths, chain.children, [1]))       # rejected at depth 2
    m.record(3, 3, 4, *step_depths(chain.depths, chain.children, [1, 2, 3]))  # all accepted
    m.record(0, 0, 1, *step_depths([0], [[]], []))                             # a plain step
    # root -> 1 -> 2, root -> 3 (pruned: no grandchild); the path ends at node 3, whose depth-2 child was cut
    tree = DraftTree.from_candidates(5, [10, 11, 12], [-1, 0, -1], [0, 2, 1])
    assert tree.depths == [0, 1, 2, 1] and tree.tokens[3] == 12
    assert step_depths(tree.depths, tree.children, [3]) == (2, 1)
    m.record(1, 3, 2, *step_depths(tree.depths, tree.children, [3]))
    s = m.snapshot(4)
    assert (s.num_verify_steps, s.num_accepted_drafts, s.num_draft_tokens, s.num_emitted_tokens) == (4, 5, 9, 9)
    assert s.drafted_at_depth == [3, 3, 2, 0]
    assert s.reached_at_depth == [3, 2, 1, 0]
    assert s.accepted_at_depth == [3, 1, 1, 0]
    assert s.accept_rate_per_position == [1.0, 0.5, 1.0, 0.0]
    assert s.accept_rate_at_least == [1.0, 1 / 3, 0.5, 0.0]
    assert s.accept_len == 1 + 5 / 4
    with pytest.raises(ValueError, match="inconsistent"):
        m.record(2, 3, 3, 3, 1)  # tested less deep than it accepted
    assert m.snapshot(4) == s


def expected_counts(steps, ref, num_steps):
    """Per step (output length before it, its draft tree or None): walk the tree along ``ref``."""
    drafted, reached, accepted = ([0] * num_steps for _ in range(3))
    num_accepted = 0
    for n, tree in steps:
        if tree is None:
            continue
        node, a = 0, 0
        while True:
            nxt = [c for c in tree.children[node] if tree.tokens[c] == ref[n + a]]
            if not nxt:
                break
            node, a = nxt[0], a + 1
        tested = a + (1 if tree.children[node] else 0)
        for d in range(max(tree.depths)):
            drafted[d] += 1
            reached[d] += d < tested
            accepted[d] += d < a
        num_accepted += a
    return drafted, reached, accepted, num_accepted


@pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")), reason="no default model")
@pytest.mark.parametrize("spec", ["3/1/4", "3/2/6"])
def test_rates_equal_counts_recomputed_from_the_drafts_and_plain_tokens(spec):
    model, cfg = load_model(SHIPPED_DEFAULT, "float32", "cpu")
    ids = Tokenizer.from_model_dir(SHIPPED_DEFAULT).encode(PROMPT)
    conf = SpecConfig.parse(spec)
    assert len(ids) + MAX_TOKENS + conf.num_step_slots < cfg.index_topk  # dense attention: greedy is exact
    ref = Engine(model, cfg, kv_dtype="float32", page_size=16, num_pages=64).generate(
        [ids], SamplingParams(max_tokens=MAX_TOKENS + conf.num_steps + 1, ignore_eos=True))[0].token_ids
    eng = SpecEngine(Engine(model, cfg, kv_dtype="float32", page_size=16, num_pages=64), conf)
    steps, trees = [], []
    propose, step = eng.decoder.proposer.propose, eng.decoder.step

    def keep_trees(seqs, num_drafts=None):
        out = propose(seqs, num_drafts)
        trees.extend(out)
        return out

    def keep_steps(seqs, emit=True):
        trees.clear()
        n = len(seqs[0].output_ids)
        out = step(seqs, emit)
        steps.append((n, trees[0] if trees else None))
        return out

    eng.decoder.proposer.propose, eng.decoder.step = keep_trees, keep_steps
    with torch.inference_mode():
        out = eng.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    assert out == ref[:MAX_TOKENS]
    drafted, reached, accepted, num_accepted = expected_counts(steps, ref, conf.num_steps)
    s = eng.metrics.snapshot(conf.num_steps)
    assert s.num_verify_steps == len(steps) and s.num_accepted_drafts == num_accepted
    assert (s.drafted_at_depth, s.reached_at_depth, s.accepted_at_depth) == (drafted, reached, accepted)
    assert s.accept_rate_per_position == pytest.approx([a / r for a, r in zip(accepted, reached)])
    assert s.accept_rate_at_least == pytest.approx([a / d for a, d in zip(accepted, drafted)])
    assert s.accept_len == pytest.approx(1 + num_accepted / len(steps))
    assert 0 < s.accept_rate_per_position[0] < 1 and reached[-1] > 0  # both outcomes, every depth tested
    assert eng.pool.allocator.num_used == 0
