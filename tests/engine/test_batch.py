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


def test_the_mask_is_a_normal_tensor_whoever_builds_it_first():
    """The same kind of tensor whether the model's forward (inference mode) or a caller outside it (the tree
    proposer edits the mask before the forward) builds it first: a compiled step guards on its inputs' dispatch
    keys, and the two kinds compiled the same speculative step twice (tests/engine/test_spec_dsa's tree)."""
    reqs = [BatchRequest([0, 1], 5, [7, 8], tree_mask=torch.tensor([[True, False], [True, True]])),
            BatchRequest([2], 3, [9])]
    kinds = []
    for inference in (True, False):
        batch = ForwardBatch.build(reqs, 4)
        with torch.inference_mode(inference):
            mask = batch.attn_mask
        kinds.append((mask.is_inference(), torch._C._dispatch_keys(mask)))
        assert mask[0, 0, 1].tolist() == [True] * 7 and mask[1, 0, 0].tolist() == [True] * 4 + [False] * 3
        mask[0, 0, 0, 6] = False  # a caller outside inference mode may edit it (the proposer's sibling masks)
    assert kinds[0] == kinds[1] and not kinds[0][0], kinds


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_kv_slots_are_row_major_on_and_off_the_page_boundary(num_reqs):
    """``kv_slots [B, S]`` has strides ``(S, 1)`` whatever the context's length, and is no view: a compiled step
    guards on its inputs' strides (a one-request slice that kept its page-padded row stride compiled a second
    graph) and on a view's base sizes (a flat reshape's view compiled 4 graphs after a decode worker's warm-up)."""
    for n in (8, 13):  # on a page boundary (page 4), and off it
        batch = ForwardBatch.build([BatchRequest([0, 1, 2, 3], n - 1, [5])] * num_reqs, 4)
        assert batch.kv_slots.shape == (num_reqs, n) and batch.kv_slots.stride() == (n, 1), batch.kv_slots.stride()
        assert batch.kv_slots._base is None
