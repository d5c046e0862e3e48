"""KV pools sized from memory (engine.memory), --dtype auto (engine.precision) and checkpoint headers
(engine.headers): the numbers in every refusal, the dtype reasons, a truncated file named."""
import json
import logging
import struct

import pytest
import torch

from engine.defaults import SHIPPED_DEFAULT
from engine.headers import TensorInfo, checkpoint_tensors, read_header, weights_bytes
from engine.loader import CheckpointError
from engine.memory import (
    ACTIVATION_RESERVE_BYTES,
    CPU_DEFAULT_NUM_PAGES,
    DeviceMemory,
    GiB,
    PoolSizeError,
    PoolSizing,
    host_memory,
    parse_bytes,
    plan_pool,
)
from engine.precision import CPU_NARROW_MIN_HIDDEN, cpu_flags, resolve_dtype
from engine.sizing import plan_start

PAGE = 1 << 20  # 1 MiB pages keep the arithmetic readable
CPU16 = DeviceMemory("cpu", 16 * GiB, 12 * GiB)
GPU80 = DeviceMemory("cuda:0", 80 * GiB, 79 * GiB)


def test_mem_fraction_sizes_the_pool_from_total_memory_minus_weights_and_reserve():
    plan = plan_pool(PoolSizing(mem_fraction=0.5), PAGE, 2 * GiB, CPU16)
    assert plan.num_pages == (8 * GiB - 2 * GiB - ACTIVATION_RESERVE_BYTES) // PAGE == 5 * 1024
    assert plan.pool_bytes == 5 * GiB and plan.reason == "--mem-fraction 0.5"


def test_gpu_default_is_nine_tenths_and_cpu_default_is_capped():
    gpu = plan_pool(PoolSizing(), PAGE, 10 * GiB, GPU80)
    assert gpu.num_pages == (int(0.9 * 80 * GiB) - 11 * GiB) // PAGE
    assert plan_pool(PoolSizing(), PAGE, 0, CPU16).num_pages == CPU_DEFAULT_NUM_PAGES
    # a CPU default shrinks to what fits instead of claiming the whole host
    small = DeviceMemory("cpu", 16 * GiB, 2 * GiB)
    assert plan_pool(PoolSizing(), PAGE, 0, small).num_pages == 1024


def test_a_pool_that_cannot_fit_is_refused_with_the_numbers():
    with pytest.raises(PoolSizeError) as e:
        plan_pool(PoolSizing(num_pages=100_000), PAGE, 2 * GiB, CPU16)
    assert str(e.value) == ("KV pool of 100000 pages (97.66 GiB, --num-pages 100000) does not fit: 12.00 GiB of "
                            "16.00 GiB available on cpu, weights ~2.00 GiB, 1.00 GiB kept for activations: at most "
                            "9216 pages of 1048576 bytes fit")
    with pytest.raises(PoolSizeError, match=r"--kv-cache-memory 21474836480\) does not fit"):
        plan_pool(PoolSizing(kv_cache_memory=20 * GiB), PAGE, 0, CPU16)
    with pytest.raises(PoolSizeError, match="holds no page: one page takes 1048576 bytes"):
        plan_pool(PoolSizing(kv_cache_memory=1000), PAGE, 0, CPU16)
    # the fraction is of total memory: more than is available now is refused, not allocated
    with pytest.raises(PoolSizeError, match=r"--mem-fraction 1\) does not fit: 12.00 GiB of 16.00 GiB"):
        plan_pool(PoolSizing(mem_fraction=1.0), PAGE, 0, CPU16)
    with pytest.raises(PoolSizeError, match=r"--mem-fraction 0.05 leaves no room for a KV pool: 0.05 x 16.00 GiB"):
        plan_pool(PoolSizing(mem_fraction=0.05), PAGE, 0, CPU16)
    assert plan_pool(PoolSizing(kv_cache_memory=3 * GiB), PAGE, 0, CPU16).num_pages == 3072


def test_sizing_flags_are_exclusive_and_checked():
    with pytest.raises(ValueError, match="give at most one of --num-pages, --mem-fraction"):
        PoolSizing(num_pages=10, mem_fraction=0.5)
    with pytest.raises(ValueError, match=r"--mem-fraction must be in \(0, 1\], got 1.5"):
        PoolSizing(mem_fraction=1.5)
    with pytest.raises(ValueError, match="--num-pages must be >= 1"):
        PoolSizing(num_pages=0)


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * GiB and parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1.5G") == 1_500_000_000 and parse_bytes("1000") == 1000 and parse_bytes("2 kib") == 2048
    for bad in ("", "GiB", "8 parsecs", "-1G"):
        with pytest.raises(ValueError, match="not a size in bytes"):
            parse_bytes(bad)


def test_host_memory_honours_a_cgroup_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\nMemAvailable:   8388608 kB\n")
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{1 * GiB}\n")
    assert host_memory(str(tmp_path / "meminfo"), str(tmp_path)) == DeviceMemory("cpu", 4 * GiB, 3 * GiB)
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory(str(tmp_path / "meminfo"), str(tmp_path)) == DeviceMemory("cpu", 16 * GiB, 8 * GiB)


BF16 = [TensorInfo("w", "BF16", 1000), TensorInfo("gate", "F32", 10), TensorInfo("mx", "U8", 64)]


def test_dtype_auto_follows_the_checkpoint_where_the_device_is_fast():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    big = CPU_NARROW_MIN_HIDDEN
    assert resolve_dtype("auto", BF16, cpu, big, frozenset({"avx512f", "amx_bf16"})) == (
        "bfloat16", "the checkpoint is bfloat16, this CPU has amx_bf16 and the hidden size 2048 >= 2048", False)
    lacks = ("the checkpoint is bfloat16 but this CPU lacks avx512_bf16 and amx_bf16 (emulated bfloat16 is "
             "slower than float32)")
    assert resolve_dtype("auto", BF16, cpu, big, frozenset({"avx512f", "avx2"})) == ("float32", lacks, True)
    assert resolve_dtype("auto", BF16, gpu, 128, frozenset()).dtype == "bfloat16"
    f32 = [TensorInfo("w", "F32", 1000), TensorInfo("b", "BF16", 10)]
    assert resolve_dtype("auto", f32, gpu, big, frozenset()) == ("float32", "the checkpoint is float32", False)
    assert resolve_dtype("float16", BF16, cpu, 128, frozenset()) == ("float16", "given", False)
    with pytest.raises(ValueError, match="dtype 'fp4' not in"):
        resolve_dtype("fp4", BF16, cpu, big)
    assert isinstance(cpu_flags(), frozenset)


@pytest.mark.parametrize("hidden,want", [(128, "float32"), (256, "float32"), (1024, "float32"), (2048, "bfloat16"),
                                         (6144, "bfloat16")])
def test_dtype_auto_keeps_small_models_in_float32_on_a_cpu(hidden, want):
    """A bf16 checkpoint on a CPU with AMX-BF16 runs in bf16 only from ``CPU_NARROW_MIN_HIDDEN`` on: below it
    the CPU's small-M bf16 GEMMs are slower than float32 (the default model, H = 128, and the peers'
    glm4_moe, H = 256, decode slower in bf16; docs/performance.md). On a GPU the size does not matter."""
    choice = resolve_dtype("auto", BF16, torch.device("cpu"), hidden, frozenset({"avx512_bf16", "amx_bf16"}))
    assert choice.dtype == want and choice.widened == (want == "float32")
    if want == "float32":
        assert f"hidden size {hidden} < 2048" in choice.reason and "--dtype bfloat16 to override" in choice.reason
    assert resolve_dtype("auto", BF16, torch.device("cuda"), hidden, frozenset()).dtype == "bfloat16"


def test_start_plan_warns_when_auto_widens_the_default_model(caplog):
    """The shipped default model (bf16 checkpoint, hidden 128) starts in float32 on an AMX CPU, and the start-up
    log says so as a WARNING with the reason (it doubles the weights' memory)."""
    with caplog.at_level(logging.INFO, logger="engine.sizing"):
        plan = plan_start(SHIPPED_DEFAULT, "auto", None, torch.device("cpu"), 16, PoolSizing(num_pages=8),
                          frozenset({"avx512_bf16", "amx_bf16"}))
    assert plan.dtype.dtype == "float32" and plan.kv_dtype == "float32"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "dtype auto -> float32" in r.getMessage()]
    assert warned and "hidden size 128 < 2048" in warned[0].getMessage()


def test_weights_bytes_counts_floats_in_the_compute_dtype_and_payloads_as_stored():
    assert weights_bytes(BF16, 4) == 1010 * 4 + 64
    assert weights_bytes(BF16, 2) == 1010 * 2 + 64


def _write_safetensors(path, tensors: dict[str, tuple[str, list[int], int]], cut: int = 0) -> None:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(off)
    path.write_bytes(data[:len(data) - cut])


def test_headers_name_a_truncated_or_broken_file(tmp_path):
    good = tmp_path / "model.safetensors"
    _write_safetensors(good, {"a": ("BF16", [4, 8], 64), "b": ("F32", [3], 12)})
    assert read_header(str(good)) == [TensorInfo("a", "BF16", 32), TensorInfo("b", "F32", 3)]
    assert checkpoint_tensors(str(tmp_path)) == read_header(str(good))
    _write_safetensors(good, {"a": ("BF16", [4, 8], 64)}, cut=10)
    with pytest.raises(CheckpointError) as e:
        read_header(str(good))
    assert str(e.value) == f"{good}: truncated: its header describes {good.stat().st_size + 10} bytes, the file " \
                           f"has {good.stat().st_size}"
    good.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a safetensors file \(2 bytes, no header\)"):
        read_header(str(good))
    good.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(CheckpointError, match="model.safetensors: safetensors header is not valid JSON"):
        read_header(str(good))
