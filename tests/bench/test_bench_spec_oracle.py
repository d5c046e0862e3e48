"""``bench.bench_spec_oracle`` shortened on a tiny glm4_moe with an MTP layer: the report's shape, every
speculative output equal to plain greedy, the oracle's acceptance near the asked value and the cost model's
steps counted by draft length."""
from engine.checkpoint import init_random_model
from shared_helpers import TINY_GQA_MTP


def test_short_run_reports_oracle_and_cost_model_rows(tmp_path):
    from bench.bench_spec_oracle import main
    model = init_random_model(TINY_GQA_MTP, str(tmp_path / "m"))
    report = main(["--model", model, "--spec", "3/1/4", "--accept-len", "4", "--batches", "1,2", "--max-tokens", "16",
                   "--prompt-len", "8", "--dtype", "float32", "--repeats", "1", "--threads", "1", "--cost-model",
                   "--json"])
    assert report["corrupt_rate"] == 0.0 and [r["batch"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["plain_tok_s"] > 0
        assert row["oracle"]["equals_plain"] and row["cost"]["equals_plain"]
        assert row["oracle"]["accept_len"] == 4.0  # rate 0: every draft of the chain accepted
        assert sum(row["cost"]["steps_by_drafts"]) > 0 and row["oracle"]["vs_plain"] > 0
