"""/dev/shm filling up never kills a worker (issue 25, item 4): a shm pool reserves its whole segment when
it is created, or is not created (the decode worker then uses a private pool: TCP transfers)."""
from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import signal
import subprocess

import pytest

import kvt_workers
from cluster.local import shm_segment_prefix
from decode.startup import make_pool
from engine.kvcache.pool import KVPool
from kvt_helpers import make_layout
from kvtransfer import ShmKVPool, shm

pytestmark = pytest.mark.timeout(120)


def test_pool_falls_back_to_private_memory_when_the_segment_cannot_be_reserved(monkeypatch, tmp_path, caplog):
    """``posix_fallocate`` says ENOSPC (what a full tmpfs answers, after the statvfs check passed): no pool,
    no file left behind, and the decode worker's pool is a private one, with one WARNING."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    calls = []

    def no_space(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    lay = make_layout(num_layers=2)
    with pytest.raises(OSError) as exc:
        ShmKVPool(lay, 16)
    assert exc.value.errno == errno.ENOSPC and calls, exc.value
    assert os.listdir(tmp_path) == []
    with caplog.at_level(logging.WARNING):
        pool = make_pool(lay, 16, shm=True)
    assert type(pool) is KVPool
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "TCP" in warnings[0].getMessage(), warnings
    assert os.listdir(tmp_path) == []


def test_filesystem_without_fallocate_reserves_by_writing(monkeypatch, tmp_path):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    pool = ShmKVPool(make_layout(num_layers=2), 16)
    st = os.stat(tmp_path / pool.segment_name)
    assert st.st_blocks * 512 >= pool.segment_bytes  # every byte backed
    pool.close()
    assert os.listdir(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs of our own (needs root: skipped elsewhere)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_tmpfs_filled_after_the_pool_was_created_does_not_kill_the_worker(small_tmpfs):
    """Real tmpfs, real process: create a ~1.5 MiB pool in a 4 MiB tmpfs, fill the tmpfs to the last
    byte, then write every byte of the pool. Before the fix the first write to an unbacked page killed
    the process with SIGBUS."""
    lay = make_layout(num_layers=4, latent=64)
    num_pages = 256
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=kvt_workers.fill_after_create_worker, args=(child, small_tmpfs, lay.to_dict(),
                                                                         num_pages), daemon=True)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"worker died with {signal.Signals(-proc.exitcode).name}" \
        if proc.exitcode and proc.exitcode < 0 else proc.exitcode
    assert conn.recv() == "full"
    assert conn.recv() > 0
    assert sorted(os.listdir(small_tmpfs)) == ["filler"]  # the pool unlinked its segment


def test_a_full_tmpfs_refuses_a_new_pool_cleanly(small_tmpfs, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", small_tmpfs)
    with pytest.raises(OSError) as exc:
        ShmKVPool(make_layout(num_layers=4, latent=64), 4096)  # ~24 MiB > 4 MiB
    assert exc.value.errno == errno.ENOSPC
    assert os.listdir(small_tmpfs) == []


def test_the_launcher_names_segments_like_the_pool_does():
    pool = ShmKVPool(make_layout(num_layers=2), 8)
    try:
        assert pool.segment_name.startswith(shm_segment_prefix(os.getpid()))
        assert shm.segment_prefix(os.getpid()) == shm_segment_prefix(os.getpid())
    finally:
        pool.close()


def _rss_shmem_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


@pytest.mark.parametrize("populate", [True, False])
def test_a_shm_pool_is_resident_from_its_creation(monkeypatch, populate):
    """Every page of the segment is mapped when the pool is created (as a private pool's torch.zeros is), so
    a worker's RSS does not creep up by the pool's size as transfers first touch its pages (a 10-minute soak
    read 362 -> 516 MB on a decode worker whose 117 MB pool was mapped lazily). Both ways: madvise, and the
    zero fill older kernels get."""
    if not populate:
        monkeypatch.setattr(shm, "MADV_POPULATE_WRITE", None)
    lay = make_layout(num_layers=4, latent=512, page_size=16)
    before = _rss_shmem_kb()
    pool = ShmKVPool(lay, 512)
    try:
        grown_kb = _rss_shmem_kb() - before
        assert grown_kb >= 0.95 * pool.segment_bytes / 1024, (grown_kb, pool.segment_bytes)
    finally:
        pool.close()
