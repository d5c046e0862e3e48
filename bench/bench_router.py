"""Router cost: added latency per request, and routing decisions per second.

1. **Overhead.** Zero-compute echo workers (one process serving both PrefillWorker and DecodeWorker, answering
   at once) and a real router process (``python -m router``). The same request is timed two ways, one at a
   time, interleaved: *direct* (this process makes the router's worker calls itself: Reserve, Prefill,
   Decode stream) and *via router* (one public ``Generate`` stream). Latency is send -> last chunk; the
   overhead is the difference of the percentiles. Both clients use grpc.aio on uvloop.
2. **Decisions/s.** ``CacheAwarePolicy.choose`` + ``order_decode`` for random prompts over a ``PrefixIndex``
   holding ``--radix-entries`` block hashes spread over ``--prefill-workers`` workers (half the prompts share
   a cached prefix), in this process, no I/O: the routing work the router does per request.

    .venv/bin/python bench/bench_router.py [--requests 2000] [--radix-entries 1000] [--json]

Goals: overhead p99 <= 1 ms, >= 10k decisions/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from common.reasons import FinishReason, Role  # noqa: E402
from protos import rpc  # noqa: E402
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.policy import CacheAwarePolicy, Candidate, order_decode  # noqa: E402
from router.prefix_index import PrefixIndex, PromptHashes, prefix_block_hashes  # noqa: E402

SECRET = "bench-secret"
INFO = {"vocab_size": "1000", "max_context": "4096", "page_size": "16", "eos_token_ids": "1", "has_tokenizer": "0"}


# -- echo workers (separate process) ------------------------------------------------------------------------
class EchoPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token=7)

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse()

    async def GetStatus(self, request, context):
        return generation_pb2.WorkerStatus(worker_id="echo-p", role=Role.PREFILL, healthy=True, pages_total=4096,
                                           pages_free=4096, info=INFO, model_hash="echo")

    async def StreamCacheEvents(self, request, context):
        yield worker_pb2.CacheEvent(reset=True)
        await asyncio.sleep(3600)


class EchoDecode(worker_pb2_grpc.DecodeWorkerServicer):
    async def Reserve(self, request, context):
        return worker_pb2.ReserveResponse(ticket=worker_pb2.TransferTicket(request_id=request.request_id,
                                                                           target="echo", ticket=b"t"))

    async def Decode(self, request, context):
        n = request.sampling.max_tokens - len(request.output_prefix)
        yield worker_pb2.DecodeChunk(token_ids=[8] * n, finish_reason=FinishReason.LENGTH)

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse()

    async def GetStatus(self, request, context):
        return generation_pb2.WorkerStatus(worker_id="echo-d", role=Role.DECODE, healthy=True, pages_total=4096,
                                           pages_free=4096, info=INFO, model_hash="echo")


def echo_worker_main(port_q) -> None:
    async def main():
        server = rpc.make_server(SECRET)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(EchoPrefill(), server)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(EchoDecode(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()
    _run(main())


# -- a bare proxy (separate process): the cost floor of one Python gRPC hop making the same calls -----------
class BareProxy(generation_pb2_grpc.GenerationServicer):
    """Reserve -> Prefill -> Decode on the echo worker and stream back: no validation, routing, metrics,
    retries or deadlines. What any router written on grpc.aio pays for the hop itself."""

    def __init__(self, worker_addr: str) -> None:
        ch = grpc.aio.insecure_channel(worker_addr, options=rpc.CHANNEL_OPTIONS)
        self.pre, self.dec = worker_pb2_grpc.PrefillWorkerStub(ch), worker_pb2_grpc.DecodeWorkerStub(ch)
        self.md = rpc.auth_metadata(SECRET)
        self.n = 0

    async def Generate(self, request, context):
        self.n += 1
        req_id, ids, sp = f"b{self.n}", list(request.token_ids.ids), request.sampling
        t = (await self.dec.Reserve(worker_pb2.ReserveRequest(request_id=req_id, num_tokens=len(ids),
                                                              max_new_tokens=sp.max_tokens), metadata=self.md)).ticket
        r = await self.pre.Prefill(worker_pb2.PrefillRequest(request_id=req_id, token_ids=ids, sampling=sp, ticket=t),
                                   metadata=self.md)
        yield generation_pb2.GenerateResponse(request_id=req_id, token_ids=[r.first_token])
        async for c in self.dec.Decode(worker_pb2.DecodeRequest(request_id=req_id, prompt_ids=ids,
                                                                output_prefix=[r.first_token], sampling=sp),
                                       metadata=self.md):
            yield generation_pb2.GenerateResponse(request_id=req_id, token_ids=c.token_ids,
                                                  finish_reason=c.finish_reason)


def bare_proxy_main(worker_addr: str, port_q) -> None:
    async def main():
        server = rpc.make_server(None)
        generation_pb2_grpc.add_GenerationServicer_to_server(BareProxy(worker_addr), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()
    _run(main())


def _run(coro):
    try:
        import uvloop  # lazy: uvloop
        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


# -- overhead -------------------------------------------------------------------------------------------------
async def time_requests(router_addr: str, router_pid: int, worker_addr: str, bare_addr: str, bare_pid: int, n: int,
                        prompt_len: int, max_tokens: int):
    md = rpc.auth_metadata(SECRET)
    ids = list(range(2, 2 + prompt_len))
    sp = generation_pb2.SamplingParams(max_tokens=max_tokens)
    direct, routed, bare = [], [], []
    async with grpc.aio.insecure_channel(worker_addr, options=rpc.CHANNEL_OPTIONS) as wch, \
            grpc.aio.insecure_channel(router_addr, options=rpc.CHANNEL_OPTIONS) as rch, \
            grpc.aio.insecure_channel(bare_addr, options=rpc.CHANNEL_OPTIONS) as bch:
        pre, dec = worker_pb2_grpc.PrefillWorkerStub(wch), worker_pb2_grpc.DecodeWorkerStub(wch)
        gen, bare_gen = generation_pb2_grpc.GenerationStub(rch), generation_pb2_grpc.GenerationStub(bch)
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sp)

        async def one_direct(i):
            req_id = f"d{i}"
            t0 = time.perf_counter()
            t = (await dec.Reserve(worker_pb2.ReserveRequest(request_id=req_id, num_tokens=len(ids),
                                                             max_new_tokens=max_tokens), metadata=md, timeout=5)).ticket
            r = await pre.Prefill(worker_pb2.PrefillRequest(request_id=req_id, token_ids=ids, sampling=sp, ticket=t),
                                  metadata=md, timeout=5)
            async for _ in dec.Decode(worker_pb2.DecodeRequest(request_id=req_id, prompt_ids=ids,
                                                               output_prefix=[r.first_token], sampling=sp),
                                      metadata=md, timeout=5):
                pass
            return time.perf_counter() - t0

        async def one_routed(i, stub=gen):
            t0 = time.perf_counter()
            async for _ in stub.Generate(req, timeout=5):
                pass
            return time.perf_counter() - t0

        for i in range(50):  # warm up channels and code paths
            await one_direct(i)
            await one_routed(i)
            await one_routed(i, bare_gen)
        client_cpu = cpu_per_req = bare_cpu = 0.0
        for i in range(n):
            c0 = time.process_time()
            direct.append(await one_direct(i))
            client_cpu += time.process_time() - c0
            cpu0 = proc_cpu_s(router_pid)
            routed.append(await one_routed(i))
            cpu_per_req += proc_cpu_s(router_pid) - cpu0
            cpu0 = proc_cpu_s(bare_pid)
            bare.append(await one_routed(i, bare_gen))
            bare_cpu += proc_cpu_s(bare_pid) - cpu0
        cpu_per_req /= n
    # this process's CPU for the direct path (3 worker calls) sets the scale: what one client-side call costs here
    return direct, routed, bare, cpu_per_req, bare_cpu / n, client_cpu / n / 3


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc): load-independent, unlike wall time."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_router(worker_addr: str, profile: str | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else []), "-m", "router", "--port", "0", "--http-port", "0",
           "--prefill", worker_addr, "--decode", worker_addr, "--cluster-secret", SECRET, "--log-level", "WARNING"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("PDSERVE_READY"):
            return proc, line.split()[2]
    raise RuntimeError(f"router exited with {proc.wait()}")


def bench_overhead(args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    worker = ctx.Process(target=echo_worker_main, args=(q,), daemon=True)
    worker.start()
    worker_addr = f"127.0.0.1:{q.get(timeout=30)}"
    proxy = ctx.Process(target=bare_proxy_main, args=(worker_addr, q), daemon=True)
    proxy.start()
    bare_addr = f"127.0.0.1:{q.get(timeout=30)}"
    router, router_addr = start_router(worker_addr, args.profile)
    try:
        time.sleep(0.5)  # first status poll
        holder = {}

        async def main():
            holder["r"] = await time_requests(router_addr, router.pid, worker_addr, bare_addr, proxy.pid,
                                              args.requests, args.prompt_len, args.max_tokens)
        _run(main())
        direct, routed, bare, cpu_per_req, bare_cpu, call_cpu = holder["r"]
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(10)
        for p in (worker, proxy):
            p.terminate()
            p.join(5)
    out = {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    for q_name, qv in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        d, r, b = pct(direct, qv) * 1e3, pct(routed, qv) * 1e3, pct(bare, qv) * 1e3
        out[q_name] = {"direct_ms": round(d, 3), "router_ms": round(r, 3), "overhead_ms": round(r - d, 3),
                       "bare_proxy_ms": round(b, 3), "bare_overhead_ms": round(b - d, 3)}
    out["mean_overhead_ms"] = round((statistics.mean(routed) - statistics.mean(direct)) * 1e3, 3)
    out["router_cpu_ms_per_request"] = round(cpu_per_req * 1e3, 3)
    out["bare_proxy_cpu_ms_per_request"] = round(bare_cpu * 1e3, 3)
    out["client_cpu_ms_per_grpc_call"] = round(call_cpu * 1e3, 3)
    out["load_avg_1m"] = os.getloadavg()[0]
    return out


# -- decisions/s ----------------------------------------------------------------------------------------------
def bench_decisions(args) -> dict:
    rng = random.Random(0)
    page, workers = 16, [f"p{i}" for i in range(args.prefill_workers)]
    index, prefixes = PrefixIndex(), []
    while sum(index.num_blocks(w) for w in workers) < args.radix_entries:
        prefix = [rng.randrange(2, 1000) for _ in range(page * rng.randrange(4, 16))]
        hashes = prefix_block_hashes(prefix, page)
        index.apply(rng.choice(workers), stored=hashes[:args.radix_entries - sum(index.num_blocks(w)
                                                                                 for w in workers)])
        prefixes.append(prefix)
    prompts = []
    for i in range(args.decisions):
        tail = [rng.randrange(2, 1000) for _ in range(args.prompt_len)]
        prompts.append((rng.choice(prefixes) + tail)[:max(args.prompt_len, 1)] if i % 2 else tail)
    pol = CacheAwarePolicy(RouterConfig())
    pcs = [Candidate(w, rng.randrange(0, 3)) for w in workers]
    dcs = [Candidate(f"d{i}", rng.randrange(0, 8), rng.randrange(0, 4096), 4096) for i in range(4)]
    lat, hits = [], 0
    t_all, cpu0 = time.perf_counter(), time.process_time()
    for ids in prompts:
        t0 = time.perf_counter()
        choice = pol.choose(pcs, PromptHashes(ids, page), index)
        order_decode(dcs, (len(ids) + 16) // page + 1)
        lat.append(time.perf_counter() - t0)
        hits += choice.matched_tokens > 0
    total, cpu = time.perf_counter() - t_all, time.process_time() - cpu0
    return {"radix_entries": sum(index.num_blocks(w) for w in workers), "prefill_workers": len(workers),
            "prompt_len": args.prompt_len, "decisions": len(prompts), "decisions_per_s": round(len(prompts) / total),
            "decisions_per_cpu_s": round(len(prompts) / cpu),
            "p50_us": round(pct(lat, 0.5) * 1e6, 1), "p99_us": round(pct(lat, 0.99) * 1e6, 1),
            "prefix_hits": hits}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--radix-entries", type=int, default=1000)
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--decisions", type=int, default=20000)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="run the router under cProfile and write its stats here (pstats format)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = {"decisions": bench_decisions(args)}
    if not args.skip_overhead:
        res["overhead"] = bench_overhead(args)
    if args.json:
        print(json.dumps(res))
        return 0
    d = res["decisions"]
    print(f"routing decisions: {d['decisions_per_s']:,}/s wall, {d['decisions_per_cpu_s']:,}/CPU-s over {d['radix_entries']} radix entries on "
          f"{d['prefill_workers']} workers (p50 {d['p50_us']} us, p99 {d['p99_us']} us, {d['prefix_hits']} prefix hits)"
          f"  goal >= 10,000/s")
    if "overhead" in res:
        o = res["overhead"]
        print(f"router overhead over {o['requests']} requests (prompt {o['prompt_len']}, {o['max_tokens']} tokens):")
        for q in ("p50", "p90", "p99"):
            print(f"  {q}: direct {o[q]['direct_ms']:.3f} ms, via router {o[q]['router_ms']:.3f} ms, "
                  f"added {o[q]['overhead_ms']:.3f} ms; a bare grpc.aio proxy making the same calls adds "
                  f"{o[q]['bare_overhead_ms']:.3f} ms")
        print(f"  router CPU per request: {o['router_cpu_ms_per_request']:.3f} ms (the bare proxy: "
              f"{o['bare_proxy_cpu_ms_per_request']:.3f} ms); for scale, one client-side gRPC "
              f"call costs {o['client_cpu_ms_per_grpc_call']:.3f} ms CPU here (the router makes 3 and serves 1); "
              f"1-min load average {o['load_avg_1m']:.1f} on {os.cpu_count()} cores")
        print("  goal: added p99 <= 1 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
