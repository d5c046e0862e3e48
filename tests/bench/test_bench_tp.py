"""bench_tp end to end on the tiny model (fresh rank processes per configuration): the ranks agree with TP1,
each holds fewer weight bytes, and the communication it reports is exactly what a TP decode step must move."""
from bench.bench_tp import main
from engine.checkpoint import TINY_GLM5


def test_bench_tp_reports_capacity_and_exact_communication():
    rows = main(["--preset", "tiny", "--batch", "2", "--prompt-len", "16", "--decode-steps", "2",
                 "--moe-parallel", "ep"])
    tp1, tp1_threads, tp2 = rows
    assert [r["label"] for r in rows] == ["TP1 1 thread", "TP1 2 threads", "TP2 ep MoE, 1 thread/rank"]
    assert tp1["tokens"] == tp1_threads["tokens"] == tp2["tokens"]
    assert len(tp2["weight_bytes_per_rank"]) == 2 and max(tp2["weight_bytes_per_rank"]) < 0.7 * tp1["weight_bytes"]
    assert tp1["decode_comm_bytes_per_step"] == 0
    B, H, V, L = 2, TINY_GLM5["hidden_size"], TINY_GLM5["vocab_size"], TINY_GLM5["num_hidden_layers"]
    # per decode step: the embedding's and every layer's two [B, H] fp32 all_reduces, the [B, V] logits gathered
    assert tp2["decode_comm_bytes_per_step"] == (2 * L + 1) * B * H * 4 + B * V * 4
    assert tp2["decode_collectives_per_step"] == 2 * L + 2
