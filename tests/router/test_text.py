"""Streamed text deltas never split a character and add up to the full decode."""
from hypothesis import given, settings, strategies as st

from router.text import Detokenizer, TextCodec
from router_fakes import write_tokenizer


def test_deltas_add_up_to_the_full_decode(tmp_path):
    codec = TextCodec.from_model_dir(write_tokenizer(str(tmp_path)))
    ids = codec.encode("héllo wörld, 日本語 text ✓ done")
    d = Detokenizer(codec)
    deltas = [d.step([i]) for i in ids]
    assert "".join(deltas) + d.flush() == codec.decode(ids)
    assert not any("\ufffd" in x for x in deltas)


def test_no_tokenizer_means_no_codec(tmp_path):
    assert TextCodec.from_model_dir(str(tmp_path)) is None and TextCodec.from_model_dir(None) is None
    (tmp_path / "tokenizer.json").write_text("not json")
    assert TextCodec.from_model_dir(str(tmp_path)) is None


_CODEC = {}


def _codec(tmp_dir):
    if "c" not in _CODEC:
        _CODEC["c"] = TextCodec.from_model_dir(write_tokenizer(tmp_dir))
    return _CODEC["c"]


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 299), max_size=40), split=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_any_ids_any_chunking(tmp_path_factory, ids, split):
    codec = _codec(str(tmp_path_factory.mktemp("tok")))
    d, out, i, k = Detokenizer(codec), [], 0, 0
    while i < len(ids):
        n = split[k % len(split)]
        out.append(d.step(ids[i:i + n]))
        i, k = i + n, k + 1
    assert "".join(out) + d.flush() == codec.decode(ids)
