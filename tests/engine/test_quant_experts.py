"""MXRoutedExperts: every strategy against the dense reference; tuned-table lookup, the one-time
untuned WARNING, last_impl; pdserve tune-moe writing a table."""
import json
import logging
import os

import pytest
import torch

from engine.moe import mx_cpu_kernel, tuned_table
from engine.moe.experts import moe_sorted
from engine.moe.mx_experts import AUTO_IMPLS, MX_MOE_IMPLS, DequantCache, MXRoutedExperts
from engine.moe.tune import random_routing
from engine.moe.tuned_table import MoEShape
from engine.quant.mx import MX_FORMATS, MXSpec, qdq_mx

E, H, I, K = 8, 64, 64, 2


def make_experts(fmt="mxfp4", act=None, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
    spec = MXSpec(MX_FORMATS[fmt])
    m = MXRoutedExperts.from_dense(w13, w2, K, spec, act_spec=MXSpec(MX_FORMATS[act]) if act else None,
                                   cache=DequantCache(1 << 30), **kw)
    return m, w13, w2


def reference(m, x, routing, w13, w2):
    """Dense math on the module's own dequantized weights; activations quantized as the module does."""
    if m.act_spec is None:
        return moe_sorted(x, m.dequant("w13", None, x.dtype), m.dequant("w2", None, x.dtype), routing)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xq = qdq_mx(x[t:t + 1], m.act_spec)
        for k in range(K):
            e = int(routing.ids[t, k])
            h = xq @ m.dequant("w13", e, x.dtype).T
            a = qdq_mx(torch.nn.functional.silu(h[:, :I]) * h[:, I:], m.act_spec)
            out[t] += routing.weights[t, k].to(x.dtype) * (a @ m.dequant("w2", e, x.dtype).T)[0]
    return out


def runnable(m):
    """Every strategy but ``triton`` off a cuda device (it runs on CPU only under TRITON_INTERPRET=1:
    tests/engine/test_mx_fused.py)."""
    return [(n, fn) for n, fn in MX_MOE_IMPLS.items() if n != "triton" or m.can_run(n, torch.float32)]


@pytest.mark.parametrize("fmt,act", [("mxfp4", None), ("mxfp6_e2m3", None), ("mxfp6_e3m2", None), ("mxfp8", None),
                                     ("mxfp4", "mxfp4")])
def test_all_strategies_match_the_dense_reference(fmt, act):
    m, w13, w2 = make_experts(fmt, act)
    for T in (1, 3, 24):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        routing = random_routing(T, E, K, seed=T)
        ref = reference(m, x, routing, w13, w2)
        for name, fn in runnable(m):
            torch.testing.assert_close(fn(m, x, routing), ref, rtol=1e-4, atol=1e-5, msg=f"{name} T={T}")
        # and within MX tolerance of the unquantized bf16-style weights
        full = moe_sorted(x, w13, w2, routing)
        rel = ((ref - full).norm() / full.norm()).item()
        assert rel < {"mxfp4": 0.45 if act else 0.3, "mxfp6_e3m2": 0.15}.get(fmt, 0.1), (fmt, act, rel)


def test_gather_without_per_pair_copies_matches(monkeypatch):
    """GLM-5-sized experts take the no-copy per-pair GEMVs (PAIR_COPY_MAX_BYTES exceeded): same result."""
    from engine.moe import experts
    m, w13, w2 = make_experts("mxfp4")
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(5))
    routing = random_routing(3, E, K, seed=5)
    ref = MX_MOE_IMPLS["mx_gather"](m, x, routing)
    monkeypatch.setattr(experts, "PAIR_COPY_MAX_BYTES", 0)
    for name in ("mx_gather", "cached_gather"):
        torch.testing.assert_close(MX_MOE_IMPLS[name](m, x, routing), ref, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_compute_matches_fp32_within_bf16_rounding():
    m, _, _ = make_experts("mxfp4")
    x = torch.randn(24, H)
    routing = random_routing(24, E, K, seed=1)
    ref = MX_MOE_IMPLS["mx_sorted"](m, x, routing)
    for name, fn in runnable(m):
        got = fn(m, x.bfloat16(), routing).float()
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2, name


def test_weights_are_packed_buffers_and_much_smaller_than_bf16():
    m, _, _ = make_experts("mxfp4")
    names = dict(m.named_buffers())
    assert set(names) == {"w13_codes", "w13_scales", "w2_codes", "w2_scales"} and not list(m.parameters())
    assert all(b.dtype == torch.uint8 for b in names.values())
    assert names["w13_codes"].shape == (E, 2 * I, H // 2) and names["w2_scales"].shape == (E, H, I // 32)
    assert m.weight_bytes() / m.dense_bytes(torch.bfloat16) == pytest.approx(4.25 / 16)


def test_cache_is_bounded_and_cached_strategies_need_room():
    m, _, _ = make_experts("mxfp4")
    m.cache = DequantCache(m.dense_bytes(torch.float32) - 1)
    assert not m.can_run("cached_sorted", torch.float32) and m.can_run("cached_sorted", torch.bfloat16)
    shared = DequantCache(m.dense_bytes(torch.float32))
    a, _, _ = make_experts("mxfp4", seed=1)
    b, _, _ = make_experts("mxfp4", seed=2)
    a.cache = b.cache = shared
    x, r = torch.randn(2, H), random_routing(2, E, K)
    MX_MOE_IMPLS["cached_gather"](a, x, r)
    MX_MOE_IMPLS["cached_gather"](b, x, r)  # evicts a's layer
    assert shared.used_bytes <= shared.budget_bytes and len(shared._entries) == 1


def no_fused_kernel(monkeypatch, fused: bool) -> None:
    """``fused`` False: behave as on a box without a C++ compiler (the fused CPU kernel unavailable)."""
    if not fused:
        monkeypatch.setattr(mx_cpu_kernel, "available", lambda: False)
    elif not mx_cpu_kernel.available():
        pytest.skip("no C++ compiler")


def write_table(dirpath, shape, impls, meta=None):
    """A table file for ``shape`` on this device in ``dirpath`` (``meta``: what it claims it was measured with;
    default: this process's kernel set and ISA)."""
    meta = meta or tuned_table.TableMeta.here(list(MX_MOE_IMPLS))
    path = dirpath / shape.file_name(tuned_table.device_name("cpu"))
    path.write_text(tuned_table.table_json(meta, {int(k): v for k, v in impls.items()}))
    tuned_table._read_table.cache_clear()
    return path


@pytest.mark.parametrize("fused", [True, False])
def test_tuned_table_nearest_key_and_last_impl(tmp_path, monkeypatch, caplog, fused):
    no_fused_kernel(monkeypatch, fused)
    m, _, _ = make_experts("mxfp4")  # with a DequantCache that has room for the whole layer
    write_table(tmp_path, m.shape, {"1": "mx_dense", "16": "mx_grouped", "256": "cached_sorted"})
    monkeypatch.setattr(tuned_table, "TABLE_DIRS", [str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="engine.moe.tuned_table"):
        # up to FALLBACK_GATHER_MAX_PAIRS pairs (decode, verify) a batch-invariant gather whatever the table says:
        # the fused kernel's where it builds, else per-step dequantizing of the selected experts (no dense layer)
        decode = "fused_gemv" if fused else "mx_gather"  # MXFP4: the in-register kernel
        # the table's cached_sorted at 5000 holds a dense layer: the memory contract wins, the untuned rule runs
        for T, want in ((1, decode), (6, decode), (12, "mx_grouped"), (100, "mx_grouped"),
                        (5000, "fused_sorted" if fused else "mx_sorted")):
            x = torch.randn(T, H)
            m(x, random_routing(T, E, K, seed=T))
            assert m.last_impl == want, (T, m.last_impl)
    assert not caplog.records
    assert m.cache.used_bytes == 0  # auto never filled the cache it was given


@pytest.mark.parametrize("what", ["kernel_set", "isa", "old_format"])
def test_table_of_other_kernels_is_reported_once_and_ignored(tmp_path, monkeypatch, caplog, what):
    """A table measured with another strategy set or on another ISA class (or in the bare format of before,
    which says neither) picks nothing here: ONE WARNING names the file and tune-moe, then the untuned rule."""
    monkeypatch.setattr(tuned_table, "TABLE_DIRS", [str(tmp_path)])
    monkeypatch.setattr(tuned_table, "_warned", set())
    m, _, _ = make_experts("mxfp4", impl="auto")
    here = tuned_table.TableMeta.here(list(MX_MOE_IMPLS))
    impls = {"1": "mx_dense", "64": "mx_dense"}
    if what == "old_format":
        path = tmp_path / m.shape.file_name(tuned_table.device_name("cpu"))
        path.write_text(json.dumps(impls))
        tuned_table._read_table.cache_clear()
    else:
        other = (tuned_table.TableMeta("0123456789ab", here.isa) if what == "kernel_set"
                 else tuned_table.TableMeta(here.kernel_set, "avx2" if here.isa != "avx2" else "amx"))
        path = write_table(tmp_path, m.shape, impls, other)
    with caplog.at_level(logging.WARNING, logger="engine.moe.tuned_table"):
        for _ in range(3):
            m(torch.randn(64, H), random_routing(64, E, K))
            assert m.last_impl != "mx_dense"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "ignoring tuned MoE table" in warnings[0] and "tune-moe" in warnings[0]
    assert here.kernel_set in warnings[0] and here.isa in warnings[0]


def test_tables_of_this_kernel_set_are_used():
    """The kernel set hash moves with the strategy set (a new strategy makes every older table stale)."""
    names = list(MX_MOE_IMPLS)
    assert tuned_table.kernel_set(names) == tuned_table.kernel_set(list(reversed(names)))
    assert tuned_table.kernel_set(names) != tuned_table.kernel_set(names + ["new_kernel"])


@pytest.mark.parametrize("fused", [True, False])
def test_untuned_shape_warns_once_and_falls_back(monkeypatch, caplog, tmp_path, fused):
    no_fused_kernel(monkeypatch, fused)
    monkeypatch.setattr(tuned_table, "TABLE_DIRS", [str(tmp_path)])
    monkeypatch.setattr(tuned_table, "_warned", set())
    layers = [make_experts("mxfp6_e2m3", seed=s)[0] for s in range(3)]
    with caplog.at_level(logging.WARNING, logger="engine.moe.tuned_table"):
        for T in (1, 8, 64):
            for layer in layers:
                layer(torch.randn(T, H), random_routing(T, E, K))
                if fused:  # 128 pairs at T=64: still the grouped kernel (FUSED_GATHER_MAX_PAIRS)
                    assert layer.last_impl == "fused_gather"
                else:
                    assert layer.last_impl == ("mx_gather" if T * K <= tuned_table.FALLBACK_GATHER_MAX_PAIRS
                                               else "mx_sorted")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "E=8,N=64,H=64,topk=2,dtype=mxfp6_e2m3" in msg and "mx_gather" in msg and "tune-moe" in msg
    assert "fused_gather" in msg


def test_forced_impl_and_bad_impl():
    m, _, _ = make_experts("mxfp4", impl="mx_grouped")
    m(torch.randn(2, H), random_routing(2, E, K))
    assert m.last_impl == "mx_grouped"
    with pytest.raises(ValueError, match="unknown MX MoE impl"):
        make_experts("mxfp4", impl="nope")


def test_tune_moe_cli_writes_a_table(tmp_path):
    from cli.main import main
    rc = main(["tune-moe", "--shapes", "64,64,8,2", "tiny", "--tokens", "1,8", "--impls", "mx_gather,mx_sorted,cached_dense",
               "--out", str(tmp_path), "--max-run-s", "2"])
    assert rc == 0
    dev = tuned_table.device_name("cpu")
    here = tuned_table.TableMeta.here(list(MX_MOE_IMPLS))
    for shape in (MoEShape(64, 64, 8, 2), tuned_table.NAMED_SHAPES["tiny"]):
        raw = json.loads((tmp_path / shape.file_name(dev)).read_text())
        assert (raw["kernel_set"], raw["isa"], raw["format"]) == (here.kernel_set, here.isa, tuned_table.TABLE_FORMAT)
        table = raw["impls"]
        assert set(table) == {"1", "8"} and set(table.values()) <= {"mx_gather", "mx_sorted", "cached_dense"}
        assert tuned_table.load_table(shape, dev, here, [str(tmp_path)]) == {int(k): v for k, v in table.items()}


def test_tune_moe_times_the_fused_strategies(tmp_path):
    if not mx_cpu_kernel.available():
        pytest.skip("no C++ compiler")
    from cli.main import main
    rc = main(["tune-moe", "--shapes", "64,64,8,2", "--tokens", "1,64", "--impls", "fused_gather,fused_sorted,triton",
               "--out", str(tmp_path), "--max-run-s", "2"])
    assert rc == 0
    raw = json.loads((tmp_path / MoEShape(64, 64, 8, 2).file_name(tuned_table.device_name("cpu"))).read_text())
    table = raw["impls"]
    assert set(table) == {"1", "64"} and set(table.values()) <= {"fused_gather", "fused_sorted"}  # triton: no cuda


def test_shipped_tables_name_registered_impls():
    files = [f for f in os.listdir(tuned_table.TUNED_DIR) if f.endswith(".json")]
    assert files, "no tuned tables shipped"
    here = tuned_table.kernel_set(list(MX_MOE_IMPLS))
    for f in files:
        assert f.startswith("E=") and ",device_name=" in f
        with open(os.path.join(tuned_table.TUNED_DIR, f)) as fh:
            raw = json.load(fh)
        # written by today's tune-moe, for today's kernels, on the ISA class its name says
        assert raw.get("format") == tuned_table.TABLE_FORMAT and raw["kernel_set"] == here, f
        assert f.split(",device_name=")[1].removesuffix(".json").endswith("_" + raw["isa"]), f
        table = raw["impls"]
        assert table and all(k.isdigit() and v in AUTO_IMPLS for k, v in table.items()), f
    shipped = {f.split(",device_name=")[0] for f in files}
    for name in ("tiny", "peer"):
        assert tuned_table.NAMED_SHAPES[name].key("x").split(",device_name=")[0] in shipped, name


def test_decode_and_verify_round_alike_with_mx_experts(tmp_path, monkeypatch):
    """A token's MoE output is bitwise the same alone (decode) and among 6 (verify), even when a tuning table
    names a strategy that rounds differently at each T (mx_dense)."""
    m, _, _ = make_experts("mxfp4")
    write_table(tmp_path, m.shape, {"1": "mx_dense"})
    monkeypatch.setattr(tuned_table, "TABLE_DIRS", [str(tmp_path)])
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(9))
    r = random_routing(6, E, K, seed=9)
    together = m(x, r)
    for t in range(6):
        alone = m(x[t:t + 1], type(r)(r.ids[t:t + 1], r.weights[t:t + 1]))
        assert torch.equal(alone[0], together[t]), t
