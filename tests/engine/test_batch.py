"""ForwardBatch.build against the definitions, element by element, on random mixed batches (decode
steps, prefill chunks over cached prefixes, draft trees with explicit positions, tensor inputs)."""
import random

import pytest
import torch

from engine.batch import BatchRequest, ForwardBatch


def _random_batch(rng: random.Random):
    ps = rng.choice([1, 4, 16])
    reqs = []
    for _ in range(rng.randint(1, 6)):
        n, c = rng.choice([1, 1, rng.randint(1, 9)]), rng.randint(0, 40)
        table = rng.sample(range(300), -(-(c + n) // ps) + rng.randint(0, 2))
        toks = [rng.randint(0, 99) for _ in range(n)]
        pos = [c + rng.randint(0, 3) for _ in range(n)] if rng.random() < 0.2 else None
        tree = torch.rand(n, n, generator=torch.Generator().manual_seed(rng.randint(0, 999))) < 0.5 \
            if rng.random() < 0.2 else None
        reqs.append(BatchRequest(torch.tensor(table) if rng.random() < 0.3 else table, c,
                                 torch.tensor(toks) if rng.random() < 0.2 else toks, pos, tree,
                                 rng.randint(0, n + 1)))
    return reqs, ps


@pytest.mark.parametrize("seed", range(4))
def test_build_matches_definitions(seed):
    rng = random.Random(seed)
    for _ in range(150):
        reqs, ps = _random_batch(rng)
        b = ForwardBatch.build(reqs, ps)
        B, T = len(reqs), sum(len(r.token_ids) for r in reqs)
        tq, smax = max(len(r.token_ids) for r in reqs), max(r.cached_len + len(r.token_ids) for r in reqs)
        assert b.kv_slots.shape == (B, smax) and b.kv_slots.is_contiguous()
        assert b.q_index.shape == b.q_valid.shape == (B, tq) and b.input_ids.shape == (T,)
        start, logits = 0, []
        for i, r in enumerate(reqs):
            n, c = len(r.token_ids), r.cached_len
            table = [int(p) for p in r.page_table]
            slot = [table[j // ps] * ps + j % ps for j in range(c + n)]  # the definition
            assert b.kv_slots[i].tolist() == slot + [0] * (smax - c - n)
            assert b.out_slots[start:start + n].tolist() == slot[c:]
            assert b.input_ids[start:start + n].tolist() == [int(t) for t in r.token_ids]
            assert b.positions[start:start + n].tolist() == (list(r.positions) if r.positions is not None
                                                            else list(range(c, c + n)))
            assert b.q_index[i].tolist() == list(range(start, start + n)) + [0] * (tq - n)
            assert b.q_valid[i].tolist() == [True] * n + [False] * (tq - n)
            m = b.attn_mask[i, 0]
            for q in range(tq):
                if q >= n:  # padding query: key 0 only
                    assert m[q].tolist() == [True] + [False] * (smax - 1)
                    continue
                want = [k <= c + q for k in range(smax)]
                if r.tree_mask is not None:
                    want[c:c + n] = r.tree_mask[q].tolist()
                assert m[q].tolist() == want
            k = min(max(r.num_logits, 1), n)
            logits += list(range(start + n - k, start + n))
            start += n
        assert b.logits_index.tolist() == logits
        assert b.q_lens == [len(r.token_ids) for r in reqs] and b.cached_lens == [r.cached_len for r in reqs]


def test_build_rejects_bad_requests():
    with pytest.raises(ValueError, match="empty batch"):
        ForwardBatch.build([], 16)
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardBatch.build([BatchRequest([0], 0, [])], 16)
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([BatchRequest([0], 16, [1])], 16)
    with pytest.raises(ValueError, match="positions"):
        ForwardBatch.build([BatchRequest([0], 0, [1, 2], positions=[0])], 16)
    with pytest.raises(ValueError, match="tree_mask shape"):
        ForwardBatch.build([BatchRequest([0], 0, [1, 2], tree_mask=torch.ones(3, 3, dtype=torch.bool))], 16)
