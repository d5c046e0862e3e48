"""TTFT added by disaggregation: the first token of a prompt whose KV is shipped to a decode worker, vs
the same prefill keeping its KV in the process (what a co-located prefill + decode engine does).

One local cluster (``pdserve serve`` internals: 1 prefill + 1 decode worker, the default model unless
``--model``, fp32), driven directly over the internal gRPC API with the cluster secret, so the router is
not part of either number. Per request, alternating with fresh random prompts (no prefix-cache hits):

* ``one process``: ``PrefillWorker.Prefill`` without a ticket: chunked prefill + MTP pass + first token,
  KV kept locally;
* ``disaggregated``: ``DecodeWorker.Reserve`` then ``Prefill`` with the ticket: the same prefill while
  each layer's KV streams to the decode worker; it answers once the decode worker has verified the last
  byte (DONE), i.e. what the router waits for before it streams the first token.

Both run on the same prefill worker with the same threads, so the difference is the transfer's cost:
the reservation round trip, the part of the shipment that does not overlap the forward, and DONE.
``--transport tcp`` (default pools) or ``shm`` (decode pool in shared memory, pages copied).

    .venv/bin/python bench/bench_disagg.py [--lens 1024,3072] [--requests 8] [--transport tcp,shm] [--json]

Goal (issue 5): disaggregation adds <= 10% to TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from protos import rpc  # noqa: E402
from protos.pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from router.config import RouterConfig  # noqa: E402


def measure(cluster, lens: list[int], requests: int, rng: random.Random) -> dict:
    addr = {ch.name: ch.address for ch in cluster.workers}
    md = rpc.auth_metadata(cluster.secret)
    out = {}
    with grpc.insecure_channel(addr["prefill-0"], options=rpc.CHANNEL_OPTIONS) as pch, \
            grpc.insecure_channel(addr["decode-0"], options=rpc.CHANNEL_OPTIONS) as dch:
        pre, dec = worker_pb2_grpc.PrefillWorkerStub(pch), worker_pb2_grpc.DecodeWorkerStub(dch)
        vocab = int(pre.GetStatus(worker_pb2.StatusRequest(), metadata=md, timeout=10).info["vocab_size"])
        sp = generation_pb2.SamplingParams(max_tokens=1)
        k = 0

        def one(ids: list[int], ship: bool) -> float:
            nonlocal k
            k += 1
            req_id = f"b{k}"
            t0 = time.perf_counter()
            ticket = None
            if ship:
                ticket = dec.Reserve(worker_pb2.ReserveRequest(request_id=req_id, num_tokens=len(ids),
                                                               max_new_tokens=1),
                                     metadata=md, timeout=60).ticket
            r = pre.Prefill(worker_pb2.PrefillRequest(request_id=req_id, token_ids=ids, sampling=sp, ticket=ticket),
                            metadata=md, timeout=600)
            t = time.perf_counter() - t0
            assert r.cached_tokens == 0 and (r.transfer_bytes > 0) == ship, r
            if ship:
                dec.Abort(worker_pb2.AbortRequest(request_id=req_id), metadata=md, timeout=60)
            return t

        for n in lens:
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(requests + 1):  # the first pair warms up
                for ship in ((True, False) if i % 2 else (False, True)):
                    t = one([rng.randrange(2, vocab) for _ in range(n)], ship)
                    if i:
                        times[ship].append(t)
            d, loc = statistics.median(times[True]), statistics.median(times[False])
            out[n] = {"disagg_p50_s": round(d, 4), "one_process_p50_s": round(loc, 4),
                      "added_pct": round(100 * (d / loc - 1), 1), "added_ms": round((d - loc) * 1e3, 1)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--lens", default="1024,3072", help="prompt lengths (tokens)")
    p.add_argument("--requests", type=int, default=8, help="timed requests per length and mode")
    p.add_argument("--transport", default="tcp,shm")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    lens = [int(x) for x in args.lens.split(",")]
    rng = random.Random(0)
    res: dict = {"transports": {}}
    for transport in args.transport.split(","):
        cluster = LocalCluster(LocalClusterConfig(model=args.model, router=RouterConfig(port=0), speculative="off",
                                                  dtype="float32", no_shm=transport != "shm"))
        try:
            cluster.start()
            res["model"] = cluster.model
            res["transports"][transport] = measure(cluster, lens, args.requests, rng)
        finally:
            cluster.stop()
    res["load_avg_1m"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"TTFT at the prefill worker, KV shipped vs kept in the process ({res['model']}, {args.requests} "
          f"requests each, interleaved; p50):")
    for transport, rows in res["transports"].items():
        for n, r in rows.items():
            print(f"  {transport:>3} {n:>6} tokens: disaggregated {r['disagg_p50_s'] * 1e3:8.1f} ms   one process "
                  f"{r['one_process_p50_s'] * 1e3:8.1f} ms   added {r['added_ms']:+6.1f} ms ({r['added_pct']:+.1f}%)"
                  f"   goal <= +10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
