"""Measured vs predicted: `minicomm bench` across hosts next to the α-β model of minicomm.cost.

    minicomm run --hostfile hosts examples/multihost_predict.py [--collectives allreduce]
        [--algorithms ring,rhd,hier] [--sizes 1M,4M,16M,64M] [--batches 3] [--warmup 1]

Measured: the project's benchmark tool (``minicomm.tools.bench.rank_main``, what ``minicomm bench``
runs inside ``minicomm run``): per collective, size and algorithm, the median over batches of the
slowest rank's time, out-of-place; size is the whole buffer (nccl-tests), busbw = size / time x
nccl-tests' factor.

The link parameters are measured first, on the running cluster, between rank 0 and the first
rank of another host (inter) and rank 0 and rank 1 (intra, when they share a host):
  α   half the round trip of an empty minicomm send/recv (median of 50);
  β   inter: 1 / TCP goodput of one plain socket stream from one host to the other (the link
      itself; 2 s); intra: half the round trip of a 16 MiB minicomm message / 16 MiB (shm);
  γ   seconds per byte of numpy's in-place add of two 64 MiB float32 arrays (the reduction).

Two predictions, both with ``minicomm.cost``'s own formulas (``flat_cost`` for ring / rhd,
``hier_cost`` for hier) and the measured α, β, γ:
  model   the formulas as they are: every rank is charged the link rate for what *it* sends, as
          if it had the host's NIC to itself;
  nic     the same formulas with β_inter multiplied by the number of ranks of one host that
          cross the network at the same time (the host's ranks share one NIC): 1 for a flat
          ring (one rank per host sends across at a time); ``hier_cost`` already charges the
          NIC's load (allreduce's L shard allreduces at once, reduce_scatter's L blocks, the
          leaders' phases of the others), so hier's two columns agree. A flat rhd allreduce
          pairs ranks of different hosts in its large halving steps when nodes are blocks of
          ranks: its nic prediction charges the bytes that leave a host in each step
          (``nic_rhd_allreduce``). Blank where the sharing is not that simple (ring alltoall,
          the other rhd collectives).
"""
import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

import minicomm as mc
from minicomm.cost import GAMMA, LinkModel, flat_cost, hier_cost
from minicomm.tools.bench import rank_main
from minicomm.tools.benchspec import BenchConfig, format_size, parse_size


# ---------------------------------------------------------------------------------- links
def ping_pong(comm, a, b, nbytes, reps):
    """Median half round trip between ranks a and b of an nbytes message (others idle)."""
    msg = np.zeros(nbytes, dtype=np.uint8)
    halves = []
    comm.barrier()
    if comm.rank in (a, b):
        for _ in range(reps):
            t0 = time.perf_counter()
            if comm.rank == a:
                comm.send(msg, b)
                comm.recv(b, out=msg)
            else:
                comm.recv(a, out=msg)
                comm.send(msg, a)
            halves.append((time.perf_counter() - t0) / 2)
    comm.barrier()
    return comm.broadcast_object(statistics.median(halves) if halves else None, root=a)


def _my_address():
    """This host's address on the route to the launcher (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MINICOMM_MASTER_ADDR", "127.0.0.1"), 9))
        return s.getsockname()[0]


def socket_goodput(comm, src, dst, seconds=2.0):
    """Bytes/s of one plain TCP stream from rank src's host to rank dst's host, at the receiver
    (first byte to EOF). The listening socket's address travels through the communicator."""
    result = {}
    if comm.rank == dst:
        lsock = socket.create_server(("0.0.0.0", 0))
        lsock.settimeout(30)
        addr = (_my_address(), lsock.getsockname()[1])

        def serve():
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(30)
                buf, total, t0 = bytearray(1 << 20), 0, None
                while True:
                    k = conn.recv_into(buf)
                    if not k:
                        break
                    t0 = t0 or time.perf_counter()
                    total += k
                result["bps"] = total / (time.perf_counter() - t0)
        server = threading.Thread(target=serve)
        server.start()
    addr = comm.broadcast_object(addr if comm.rank == dst else None, root=dst)
    if comm.rank == src:
        data = bytes(1 << 20)
        with socket.create_connection(addr, timeout=30) as conn:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                conn.sendall(data)
    if comm.rank == dst:
        server.join(60)
        lsock.close()
    bps = comm.broadcast_object(result.get("bps"), root=dst)
    if not bps:
        raise SystemExit(f"the goodput probe from rank {src} to rank {dst} failed")
    return bps


def measure_links(comm):
    topo = comm.topology
    other = next((r for r in range(comm.size) if topo[r] != topo[0]), None)
    local = next((r for r in range(1, comm.size) if topo[r] == topo[0]), None)
    if other is None:
        raise SystemExit("multihost_predict.py needs ranks on at least two hosts")
    # two arrays larger than any cache, as the reductions of a large collective stream them
    a, b = np.ones((64 << 20) // 4, dtype=np.float32), np.ones((64 << 20) // 4, dtype=np.float32)
    np.add(a, b, out=a)
    t0 = time.perf_counter()
    for _ in range(3):
        np.add(a, b, out=a)
    gamma = (time.perf_counter() - t0) / 3 / a.nbytes
    del a, b
    links = dict(alpha_inter=ping_pong(comm, 0, other, 0, 50),
                 beta_inter=1 / socket_goodput(comm, 0, other), gamma=gamma)
    links["minicomm_goodput_inter"] = (16 << 20) / ping_pong(comm, 0, other, 16 << 20, 3)
    if local is not None:
        links["alpha_intra"] = ping_pong(comm, 0, local, 0, 50)
        links["beta_intra"] = ping_pong(comm, 0, local, 16 << 20, 3) / (16 << 20)
    else:
        links["alpha_intra"], links["beta_intra"] = links["alpha_inter"], links["beta_inter"]
    return links


def nic_rhd_allreduce(p, n, topo, links):
    """Flat rhd allreduce charged per host: a step pairing ranks of different hosts costs
    α_inter plus the bytes leaving the busiest host at β_inter, a step inside hosts α_intra
    plus one rank's bytes at β_intra; plus the reduction. Follows rhd's pairing (rank XOR 2^k,
    from the top bit down: the largest halves go furthest; powers of two only)."""
    if p & (p - 1):
        return None
    step_costs, size, d = [], n, p // 2
    while d >= 1:
        size /= 2
        crossing = [r for r in range(p) if topo[r] != topo[r ^ d]]
        per_host = max((sum(1 for r in crossing if topo[r] == h) for h in set(topo)), default=0)
        step_costs.append(links["alpha_inter"] + size * per_host * links["beta_inter"] if per_host
                          else links["alpha_intra"] + size * links["beta_intra"])
        d //= 2
    return 2 * sum(step_costs) + n * (p - 1) / p * links["gamma"]   # halving, then doubling


def predictions(comm, coll, n, algo, links):
    """(model, nic) predicted seconds for n bytes per rank (vector, or block of the blocked
    collectives), see the module doc; None where there is no formula."""
    p, topo, g = comm.size, comm.topology, links["gamma"]
    if algo == "hier":
        def hier(nic_share):
            m = LinkModel(links["alpha_intra"], links["beta_intra"], links["alpha_inter"],
                          links["beta_inter"] * nic_share, g)
            return hier_cost(coll, p, n, topo, m)
        # hier_cost already charges what shares the NIC (allreduce's L shards at once,
        # reduce_scatter's L blocks; the other collectives cross from the leaders only)
        return hier(1), hier(1)
    # a flat family across hosts is charged the inter link throughout (the cost model's convention)
    plain = flat_cost(coll, algo, p, n, links["alpha_inter"], links["beta_inter"], g)
    if algo == "ring" and coll != "alltoall":      # ring alltoall is pairwise shifts, not a ring
        return plain, plain
    if algo == "rhd" and coll == "allreduce":
        return plain, nic_rhd_allreduce(p, n, topo, links)
    return plain, None


# ---------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--collectives", default="allreduce")
    ap.add_argument("--algorithms", default="ring,rhd,hier")
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="whole-buffer sizes (K, M, G)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--json", help="rank 0 writes links and rows here")
    args = ap.parse_args()

    comm = mc.init()
    links = measure_links(comm)
    cfg = BenchConfig(collectives=args.collectives.split(","),
                      sizes=[parse_size(x) for x in args.sizes.split(",")], nranks=comm.size,
                      nodes=comm.num_nodes, algorithms=args.algorithms.split(","),
                      dtype=args.dtype, warmup=args.warmup, batches=args.batches, quiet=True)
    cfg.validate()
    rows = rank_main(comm, cfg)
    if comm.rank == 0:
        layout = "x".join(str(list(comm.topology).count(h)) for h in sorted(set(comm.topology)))
        print(f"# {comm.size} ranks, hosts x ranks: {layout}; "
              f"{comm.caps.describe() if comm.caps.describe else comm.transport.name}")
        print(f"# links: alpha_inter {links['alpha_inter'] * 1e6:.0f} us, inter goodput "
              f"{8 / links['beta_inter'] / 1e9:.3f} Gbit/s (socket), "
              f"{8 * links['minicomm_goodput_inter'] / 1e9:.3f} Gbit/s (minicomm 16 MiB); "
              f"alpha_intra {links['alpha_intra'] * 1e6:.0f} us, intra "
              f"{1 / links['beta_intra'] / 1e9:.2f} GB/s; "
              f"gamma {1 / links['gamma'] / 1e9:.2f} GB/s "
              f"(the cost model's default {1 / GAMMA / 1e9:.1f})")
        print(f"{'collective':<15}{'size':>6}{'algorithm':>10}{'time ms':>10}{'busbw GB/s':>12}"
              f"{'model ms':>10}{'meas/model':>11}{'nic ms':>9}{'meas/nic':>9}")
        for row in rows:
            t = row["time_us"] / 1e6
            n = row["count"] * np.dtype(args.dtype).itemsize      # bytes per vector / block
            row["model_s"], row["nic_s"] = predictions(comm, row["collective"], n, row["algo"],
                                                       links)
            cells = [f"{row['model_s'] * 1e3:>10.1f}{t / row['model_s']:>11.2f}" if row["model_s"]
                     else f"{'-':>10}{'-':>11}",
                     f"{row['nic_s'] * 1e3:>9.1f}{t / row['nic_s']:>9.2f}" if row["nic_s"]
                     else f"{'-':>9}{'-':>9}"]
            print(f"{row['collective']:<15}{format_size(row['size']):>6}{row['algo']:>10}"
                  f"{t * 1e3:>10.1f}{row['busbw']:>12.4f}" + "".join(cells), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(layout=layout, links=links, rows=rows), f, indent=1)
    comm.close()


if __name__ == "__main__":
    sys.exit(main())
