"""Workload generators: exact lengths, exact shared prefixes (so the ideal hit rate is the requested one),
ids in [2, vocab), determinism, random ranges and trace parsing."""
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.loadgen.config import BenchConfig
from bench.loadgen.workload import WORDS, load_trace, make_workload

VOCAB = 512


def make_cfg(**kw) -> BenchConfig:
    base = dict(workload="prefill-bound", input_len=1000, output_len=50, cache_hit=0.6, num_prefixes=3, rps=(1.0,))
    return BenchConfig(**{**base, **kw}).with_defaults()


def lcp(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def ideal_hit_rate(reqs, ids) -> float:
    """What a perfect token-granular prefix cache would hit in steady state (every group already resident):
    each request's longest common prefix with any other request."""
    hit = sum(max(lcp(ids[i], ids[j]) for j in range(len(reqs)) if j != i) for i in range(len(reqs)))
    return hit / sum(r.input_len for r in reqs)


@pytest.mark.parametrize("input_len,cache_hit", [(1000, 0.6), (4000, 0.6), (20000, 0.6), (500, 0.25), (300, 0.0)])
def test_prefill_bound_lengths_and_hit_rate_exact(input_len, cache_hit):
    wl = make_workload(make_cfg(input_len=input_len, cache_hit=cache_hit), VOCAB)
    reqs = [wl.request(i) for i in range(40)]
    prefix_len = round(cache_hit * input_len)
    for r in reqs:
        assert len(r.prompt_ids) == r.input_len == input_len
        assert r.output_len == 50
        assert r.prefix_len == prefix_len
        assert all(2 <= t < VOCAB for t in r.prompt_ids)
    # Same group: exactly prefix_len tokens shared; different groups / no prefix: nothing shared.
    ids = [np.asarray(r.prompt_ids) for r in reqs]
    for i, j in itertools.combinations(range(len(reqs)), 2):
        a, b = reqs[i], reqs[j]
        same = a.prefix_group is not None and a.prefix_group == b.prefix_group
        assert lcp(ids[i], ids[j]) == (prefix_len if same else 0)
    groups = {r.prefix_group for r in reqs}
    assert groups == ({None} if cache_hit == 0 else {0, 1, 2})
    assert ideal_hit_rate(reqs, ids) == pytest.approx(cache_hit, abs=1e-12)


def test_reference_shape_4k_200():
    wl = make_workload(make_cfg(input_len=4096, output_len=200, num_prefixes=1), VOCAB)
    r = wl.request(7)
    assert (len(r.prompt_ids), r.output_len, r.prefix_len) == (4096, 200, round(0.6 * 4096))


def test_deterministic_per_index_and_seed():
    a, b = make_workload(make_cfg(), VOCAB), make_workload(make_cfg(), VOCAB)
    assert [a.request(i) for i in (5, 0, 3)] == [b.request(i) for i in (5, 0, 3)]
    assert a.request(3) == a.request(3)
    c = make_workload(make_cfg(seed=1), VOCAB)
    assert c.request(3).prompt_ids != a.request(3).prompt_ids


def test_prefill_bound_defaults_are_the_reference():
    cfg = BenchConfig(rps=(1.0,)).with_defaults()
    assert (cfg.input_len, cfg.output_len, cfg.cache_hit) == (20_000, 1_000, 0.6)
    ss = BenchConfig(workload="single-stream").with_defaults()
    assert (ss.input_len, ss.output_len, ss.concurrency) == (10_000, 1_500, (1,))


def test_random_lengths_within_ranges():
    cfg = make_cfg(workload="random", input_range=(100, 200), output_range=(5, 9), cache_hit=0.5)
    wl = make_workload(cfg, VOCAB)
    reqs = [wl.request(i) for i in range(200)]
    ins, outs = {r.input_len for r in reqs}, {r.output_len for r in reqs}
    assert min(ins) >= 100 and max(ins) <= 200 and len(ins) > 50
    assert outs == set(range(5, 10))
    for r in reqs:
        assert len(r.prompt_ids) == r.input_len and r.prefix_len == round(0.5 * r.input_len)


def test_random_default_ranges():
    cfg = BenchConfig(workload="random", input_len=100, output_len=10, concurrency=(2,)).with_defaults()
    assert cfg.input_range == (50, 150) and cfg.output_range == (5, 15)


def test_text_prompts_use_words():
    wl = make_workload(make_cfg(text_prompts=True, input_len=100), None)
    r = wl.request(0)
    words = r.text.split()
    assert r.prompt_ids is None and len(words) == 100 and set(words) <= set(WORDS)
    other = wl.request(1).text.split()
    if wl.request(1).prefix_group == r.prefix_group:
        assert words[:60] == other[:60] and words[60] != other[60]


def test_token_prompts_need_a_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        make_workload(make_cfg(), None)


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trace_replay(tmp_path):
    rows = [{"timestamp": 10.5, "input_len": 64, "output_len": 4, "prefix_group": 1},
            {"timestamp": 10.0, "input_len": 32, "output_len": 2, "prefix_group": None},
            {"timestamp": 12.0, "input_len": 128, "output_len": 8, "prefix_group": 1}]
    path = write_trace(tmp_path / "t.jsonl", rows)
    cfg = BenchConfig(workload="trace", trace=path, cache_hit=0.5, trace_speed=2.0).with_defaults()
    wl = make_workload(cfg, VOCAB)
    assert len(wl) == 3 and wl.span_s == pytest.approx(1.0)
    reqs = [wl.request(i) for i in range(3)]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.25, 1.0])
    assert [(r.input_len, r.output_len, r.prefix_group) for r in reqs] == [(32, 2, None), (64, 4, 1), (128, 8, 1)]
    assert [len(r.prompt_ids) for r in reqs] == [32, 64, 128]
    assert lcp(reqs[1].prompt_ids, reqs[2].prompt_ids) == 32  # the shorter prefix of group 1


def test_trace_bad_line_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_len": 4, "output_len": 1}\n{"timestamp": 1, "input_len": 4}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(str(path))


@settings(max_examples=40, deadline=None)
@given(input_len=st.integers(2, 3000), cache_hit=st.floats(0.0, 0.95), num_prefixes=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1), vocab=st.integers(3, 100_000))
def test_any_shape_is_exact(input_len, cache_hit, num_prefixes, seed, vocab):
    wl = make_workload(make_cfg(input_len=input_len, cache_hit=cache_hit, num_prefixes=num_prefixes, seed=seed),
                       vocab)
    reqs = [wl.request(i) for i in range(6)]
    prefix_len = min(round(cache_hit * input_len), input_len - 1)
    ids = [np.asarray(r.prompt_ids) for r in reqs]
    for r, a in zip(reqs, ids):
        assert len(a) == input_len and r.prefix_len == (prefix_len if r.prefix_group is not None else 0)
        assert a.min() >= 2 and a.max() < vocab
    if vocab - 2 >= 6:  # enough ids for distinct first suffix tokens: shared parts are exact
        for i, j in itertools.combinations(range(6), 2):
            same = reqs[i].prefix_group is not None and reqs[i].prefix_group == reqs[j].prefix_group
            want = reqs[i].prefix_len if same else 0
            if not same and reqs[i].prefix_group is not None and reqs[j].prefix_group is not None \
                    and (reqs[i].prefix_group - reqs[j].prefix_group) % (vocab - 2) == 0:
                continue  # two groups with one first token (more groups than ids)
            assert lcp(ids[i], ids[j]) == want
