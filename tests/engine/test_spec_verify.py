"""Speculative decoding without a model: config parsing, draft trees, and the verification rules
checked against exact distributions (chi-square, fixed seeds)."""
import pytest
import torch

from engine.speculative.config import SpecConfig
from engine.speculative.tree import DraftTree
from engine.speculative.verify import verify_chain_sampling, verify_greedy, verify_tree_sampling

P_VALUE_MIN = 1e-3
"""Chi-square tests fail below this p-value: a correct sampler fails with probability 0.1% per test
for a fresh seed; with the fixed seeds used here the outcome is deterministic."""


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed ``counts`` against ``probs``; bins expecting < 5 are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0  # a token the target can never produce
    exp = probs * n
    small = exp < 5
    obs_b = torch.cat([counts[~small], counts[small].sum()[None]])
    exp_b = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    df = obs_b.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


@pytest.mark.parametrize("text,chain", [("5/1/6", True), ("3/1/4", True), ("3/2/6", False), ("1/1/2", True)])
def test_parse(text, chain):
    c = SpecConfig.parse(text)
    assert str(c) == text and c.is_chain == chain
    assert c.num_drafts == c.num_draft_tokens - 1


@pytest.mark.parametrize("text,msg", [
    ("3/1/5", "chain"), ("0/1/1", "num_steps"), ("3/0/4", "eagle_topk"), ("3/2/1", "num_draft_tokens"),
    ("2/2/8", "propose only 6"), ("3/1", "steps/topk/draft_tokens"), ("a/b/c", "three integers"),
])
def test_parse_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        SpecConfig.parse(text)


def test_tree_from_candidates_dfs_order_and_mask():
    # candidates: 0:a(root child) 1:b(root child) 2:a->c 3:a->d 4:b->e ; kept best first: a, c, b, d
    tree = DraftTree.from_candidates(9, [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1], [0, 2, 1, 3])
    assert tree.tokens == [9, 10, 12, 13, 11]  # DFS: a, a's best child c, then d, then b
    assert tree.parents == [-1, 0, 1, 1, 0] and tree.depths == [0, 1, 2, 2, 1]
    assert tree.children == [[1, 4], [2, 3], [], [], []]
    m = tree.mask()
    assert m.tolist()[3] == [True, True, False, True, False]
    assert tree.path_tokens(3) == [10, 13] and not tree.is_chain
    with pytest.raises(ValueError, match="without its parent"):
        DraftTree.from_candidates(9, [10, 11], [-1, 0], [1])


def test_greedy_walks_tree():
    tree = DraftTree.from_candidates(9, [10, 11, 12], [-1, -1, 1], [0, 1, 2])  # 10 | 11 -> 12
    assert verify_greedy(tree, [11, 0, 12, 5]) == ([2, 3], [11, 12, 5])  # second child, then bonus
    assert verify_greedy(tree, [7, 0, 0, 0]) == ([], [7])
    chain = DraftTree.chain(9, [1, 2, 3])
    assert verify_greedy(chain, [1, 2, 4, 0]) == ([1, 2], [1, 2, 4])


def _position_targets(V, n, seed):
    """Target distributions that depend only on the position (so the emitted sequence is a product)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, V, generator=g) ** 2
    p[:, 0] = 0.0  # a token the target never emits...
    q = torch.rand(n, V, generator=g) ** 2
    q[:, 0] = 0.3  # ...but the draft likes
    q[:, 1] = 0.0  # and one the draft never proposes
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _joint_of_first_two(step, n_trials, V):
    counts = torch.zeros(V, V)
    for _ in range(n_trials):
        out, pos = [], 0
        while len(out) < 2:
            toks = step(pos)
            out += toks
            pos += len(toks)
        counts[out[0], out[1]] += 1
    return counts


def test_chain_sampling_is_exact():
    V, K, N = 5, 3, 4000
    p, q = _position_targets(V, 8, seed=1)
    gen = torch.Generator().manual_seed(123)
    # drafts x ~ q[position], drawn up front: one independent stream per position
    pool = [iter(torch.multinomial(q[j], 2 * N, replacement=True, generator=gen).tolist()) for j in range(6)]

    def step(pos):
        drafts = [next(pool[pos + i]) for i in range(K)]
        tree = DraftTree.chain(0, drafts, q[pos:pos + K])
        res = verify_chain_sampling(tree, p[pos:pos + K + 1], gen)
        assert res.token_ids[:len(res.path)] == drafts[:len(res.path)]
        return res.token_ids

    counts = _joint_of_first_two(step, N, V)
    assert chi_square_p_value(counts, p[0][:, None] * p[1][None, :]) > P_VALUE_MIN
    assert counts[0].sum() == 0 and counts[:, 0].sum() == 0


def test_tree_sampling_is_exact():
    V, N = 5, 4000
    p, _ = _position_targets(V, 8, seed=2)
    gen = torch.Generator().manual_seed(321)
    # root -> {2 -> {3, 0}, 4 -> {4}, 0}: deterministic proposals, one the target never emits
    tree = DraftTree.from_candidates(1, [2, 4, 0, 3, 0, 4], [-1, -1, -1, 0, 0, 1], [0, 1, 2, 3, 4, 5])

    def step(pos):
        rows = torch.stack([p[pos + d] for d in tree.depths])
        return verify_tree_sampling(tree, rows, gen).token_ids

    counts = _joint_of_first_two(step, N, V)
    assert chi_square_p_value(counts, p[0][:, None] * p[1][None, :]) > P_VALUE_MIN


def test_chi_square_detects_a_wrong_sampler():
    """The test has power: accepting drafts outright (no rejection) is caught."""
    V = 5
    p, q = _position_targets(V, 2, seed=1)
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(V)
    for x in torch.multinomial(q[0], 3000, replacement=True, generator=gen).tolist():
        counts[x] += 1
    assert chi_square_p_value(counts, p[0]) < P_VALUE_MIN
