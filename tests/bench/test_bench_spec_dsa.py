"""``bench.bench_spec_dsa`` end to end, shortened: in-process and served (two real ``pdserve serve`` clusters),
a prompt past the default model's index_topk; the report's shape and the tokens of every path equal."""
import json
import os

import pytest

from engine.defaults import SHIPPED_DEFAULT

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")),
                                reason="no default model")


def test_short_run_reports_both_paths(tmp_path):
    from bench.bench_spec_dsa import main
    out = tmp_path / "r.json"
    report = main(["--spec", "2/1/3", "--max-tokens", "12", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["prompt_tokens"] == 4 * report["index_topk"]
    for path in ("in-process", "served"):
        res = report["results"][path]
        assert res["off"]["equals_plain_in_process"] and res["on"]["equals_plain_in_process"], path
        assert res["off"]["tok_s"] > 0 and res["on"]["tok_s"] > 0 and res["speedup"] > 0
        assert "accept_len" not in res["off"] and res["on"]["accept_len"] >= 1
        per = res["on"]["accept_rate_per_position"]
        assert len(per) == 2 and per[0] is not None and all(r is None or 0 <= r <= 1 for r in per)
