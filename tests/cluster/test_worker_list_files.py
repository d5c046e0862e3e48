"""The worker list (it says where the router sends the cluster secret) is written and read only in a private
directory, never through a symlink (issue 25: predictable /tmp/pdserve-ray/<namespace>/ and temp names)."""
import logging
import os

import pytest

from router.discovery import (DiscoveryConfig, FileDiscovery, WorkerList, ensure_private_dir, read_worker_list,
                              write_worker_list)

LIST = WorkerList(("127.0.0.1:5001",), ("127.0.0.1:5002",))
ATTACKER_UID = 54321


def test_a_fresh_directory_is_created_private(tmp_path):
    d = ensure_private_dir(str(tmp_path / "pdserve-ray" / "ns"))
    for p in (d, os.path.dirname(d)):
        assert os.stat(p).st_mode & 0o777 == 0o700
    write_worker_list(os.path.join(d, "workers.json"), LIST)
    assert os.listdir(d) == ["workers.json"]
    assert os.stat(os.path.join(d, "workers.json")).st_mode & 0o777 == 0o600
    assert read_worker_list(os.path.join(d, "workers.json")) == LIST


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "attacker-owned", "symlink"])
def test_a_directory_prepared_by_someone_else_is_refused(tmp_path, how):
    """An attacker who creates /tmp/pdserve-ray/<namespace> first (or a symlink there) must not get to
    choose, read or swap the worker list: the launcher refuses the directory."""
    d = tmp_path / "ns"
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        os.symlink(tmp_path / "elsewhere", d)
    else:
        d.mkdir(mode=0o700)
        if how == "attacker-owned":
            if os.geteuid() != 0:
                pytest.skip("needs root to give the directory away")
            os.chown(d, ATTACKER_UID, ATTACKER_UID)
        else:
            os.chmod(d, 0o777 if how == "world-writable" else 0o770)
    with pytest.raises(PermissionError):
        ensure_private_dir(str(d))
    with pytest.raises(PermissionError):
        write_worker_list(str(d / "workers.json"), LIST)
    assert not os.path.exists(d / "workers.json") and not os.listdir(tmp_path / "elsewhere" if how == "symlink"
                                                                       else d)


def test_a_symlink_at_the_target_or_the_old_temporary_name_is_not_followed(tmp_path):
    """The old writer opened ``workers.json.tmp<pid>`` with a plain open(): a symlink planted there made it
    write through to the symlink's target. Now the temporary name is random and created O_EXCL, and the
    rename replaces a symlink at the target instead of writing through it."""
    d = tmp_path / "ns"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = d / "workers.json"
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    os.symlink(victim, path)
    write_worker_list(str(path), LIST)
    assert victim.read_text() == "precious"
    assert not os.path.islink(path) and read_worker_list(str(path)) == LIST
    assert sorted(os.listdir(d)) == sorted(["workers.json", f"workers.json.tmp{os.getpid()}"])


def test_the_router_ignores_a_list_it_could_not_trust(tmp_path, caplog):
    """A list in a group/world-writable directory, or a symlink, is not applied: no address from it is
    ever contacted (the router would send it the cluster secret)."""
    d = tmp_path / "ns"
    d.mkdir(mode=0o700)
    path = d / "workers.json"
    write_worker_list(str(path), LIST)
    added = []

    class Registry:
        workers: dict = {}

        def add_worker(self, role, address):
            added.append((role, address))

    disc = FileDiscovery(DiscoveryConfig(discovery=f"file:{path}"), Registry())
    os.chmod(d, 0o777)
    with caplog.at_level(logging.WARNING):
        assert not disc.check()
    assert added == [] and "writable by group or others" in caplog.text
    os.chmod(d, 0o700)
    os.chmod(path, 0o666)
    disc._seen = None
    assert not disc.check() and added == []
    os.chmod(path, 0o600)
    disc._seen = None
    assert disc.check() and sorted(added) == [("decode", "127.0.0.1:5002"), ("prefill", "127.0.0.1:5001")]
