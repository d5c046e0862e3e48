"""Live discovery (router/discovery.py + Registry.add_worker/remove_worker) over real gRPC against the
router's in-process fake workers: workers join, leave (drained first) and come back while the router serves."""
import asyncio
import os

import pytest

from router.client import AsyncGenerationClient
from router.config import RouterConfig
from router.discovery import DiscoveryConfig, FileDiscovery, WorkerList, write_worker_list
from router.registry import DRAINING
from router.server import RouterServer
from router_fakes import FakeDecode, FakePrefill, expected_tokens

SECRET = "disc-secret"


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def wait_for(cond, timeout_s: float = 5.0, what: str = "condition"):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_worker_list_parse_and_atomic_write(tmp_path):
    wl = WorkerList.parse('{"prefill": ["10.0.0.1:5", "10.0.0.1:5"], "decode": ["h:6"]}')
    assert wl == WorkerList(("10.0.0.1:5",), ("h:6",))
    for bad in ("[]", '{"prefill": "h:1"}', '{"decode": ["nohost"]}', '{"decode": [":1"]}', "{"):
        with pytest.raises(ValueError):
            WorkerList.parse(bad)
    path = str(tmp_path / "w.json")
    write_worker_list(path, wl)
    assert WorkerList.parse(open(path).read()) == wl and os.listdir(tmp_path) == ["w.json"]
    with pytest.raises(ValueError, match="file:PATH"):
        DiscoveryConfig(discovery="ray:auto")


def test_router_follows_the_worker_list(tmp_path):
    async def go():
        decodes = {f"d{i}": FakeDecode(f"d{i}", SECRET) for i in range(2)}
        prefills = [FakePrefill(f"p{i}", decodes, SECRET) for i in range(2)]
        for w in [*decodes.values(), *prefills]:
            await w.start()
        d0, d1 = decodes.values()
        p0, p1 = prefills
        path = str(tmp_path / "workers.json")
        srv = RouterServer(RouterConfig(port=0, cluster_secret=SECRET, health_interval_s=0.1, health_timeout_s=0.5,
                                        rpc_timeout_s=0.5, routing="round_robin"))
        await srv.start()
        reg = srv.core.registry
        disc = FileDiscovery(DiscoveryConfig(discovery=f"file:{path}", discovery_interval_s=0.05), reg)
        task = asyncio.get_running_loop().create_task(disc.run())
        client = AsyncGenerationClient(srv.address, timeout_s=10)
        try:
            assert not reg.workers  # no file yet: nothing to serve, and no error
            write_worker_list(path, WorkerList((p0.address,), (d0.address,)))
            await wait_for(reg.serving, what="first workers in rotation")
            out = await client.generate(token_ids=[3, 4, 5], max_tokens=4)
            assert out.token_ids == expected_tokens([3, 4, 5], 4)
            assert (out.metrics.prefill_worker, out.metrics.decode_worker) == ("p0", "d0")

            # p0 and d0 leave, p1 and d1 join: the leavers are drained at once, then forgotten
            write_worker_list(path, WorkerList((p1.address,), (d1.address,)))
            await wait_for(lambda: reg.workers[p0.key].excluded == DRAINING if p0.key in reg.workers else True,
                           what="p0 draining")
            await wait_for(lambda: {w.key for w in reg.healthy("prefill") + reg.healthy("decode")} ==
                           {p1.key, d1.key}, what="p1 and d1 in rotation")
            for _ in range(3):
                out = await client.generate(token_ids=[7, 8], max_tokens=3)
                assert (out.metrics.prefill_worker, out.metrics.decode_worker) == ("p1", "d1")
            await wait_for(lambda: set(reg.workers) == {p1.key, d1.key}, what="leavers forgotten")

            # a broken file is ignored (the last good list stays); p0 comes back on the same address
            with open(path, "w") as f:
                f.write("{not json")
            await asyncio.sleep(0.2)
            assert set(reg.workers) == {p1.key, d1.key}
            write_worker_list(path, WorkerList((p0.address, p1.address), (d1.address,)))
            await wait_for(lambda: len(reg.healthy("prefill")) == 2, what="p0 back")
            seen = {(await client.generate(token_ids=[9], max_tokens=2)).metrics.prefill_worker for _ in range(4)}
            assert seen == {"p0", "p1"}

            # removing every worker: the router stops serving but keeps running
            write_worker_list(path, WorkerList((), ()))
            await wait_for(lambda: not reg.serving(), what="router not serving")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await srv.stop()
            for w in [*decodes.values(), *prefills]:
                await w.stop(0)
    run(go())


def test_a_draining_worker_keeps_its_inflight_call(tmp_path):
    async def go():
        decodes = {"d0": FakeDecode("d0", SECRET)}
        p0 = FakePrefill("p0", decodes, SECRET)
        d0 = decodes["d0"]
        for w in (d0, p0):
            await w.start()
        srv = RouterServer(RouterConfig(port=0, cluster_secret=SECRET, health_interval_s=0.1, rpc_timeout_s=0.2))
        await srv.start()
        reg = srv.core.registry
        disc = FileDiscovery(DiscoveryConfig(discovery=f"file:{tmp_path}/w.json"), reg)
        disc.apply(WorkerList((p0.address,), (d0.address,)))
        client = AsyncGenerationClient(srv.address, timeout_s=10)
        try:
            await wait_for(reg.serving, what="serving")
            d0.b.delay_s = 0.1  # 8 chunks: ~0.8 s of decoding
            call = asyncio.get_running_loop().create_task(client.generate(token_ids=[1, 2], max_tokens=8,
                                                                          ignore_eos=True))
            await wait_for(lambda: reg.workers[d0.key].inflight == 1, what="decode stream open")
            disc.apply(WorkerList((p0.address,), ()))
            assert reg.workers[d0.key].excluded == DRAINING and not reg.serving()
            out = await call  # the drained worker finishes what it was doing
            assert out.finish_reason == "length" and len(out.token_ids) == 8
            await wait_for(lambda: d0.key not in reg.workers, what="d0 forgotten after its call ended")
        finally:
            await client.close()
            await srv.stop()
            for w in (d0, p0):
                await w.stop(0)
    run(go())
