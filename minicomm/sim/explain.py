"""``minicomm sim --explain``: the seed's GPT-3 traffic figures, from first principles and simulated.

Arithmetic (S = gradient bytes, p ranks, m servers of g accelerators, B a link's bandwidth):
  GPT-3 175B parameters x 2 bytes (fp16)      S = 350 GB (decimal: 1 GB = 1e9 B)
  ring allreduce, per rank                    sends 2(p-1)/p S and receives as much:
                                              reduce-scatter (p-1)/p S, then allgather (p-1)/p S
  flat ring over p = 1,024 (rank order fills   the ring crosses a server boundary m times; each of
    servers: 8 consecutive ranks per server)    those m hops carries 2(p-1)/p S over one NIC, so the
                                              network moves m * 2(p-1)/p S and the call takes
                                              ~2(p-1)/p S / B_nic + 2(p-1) α
  hier over 128 x 8                           intra reduce-scatter (NVLink), inter allreduce of S/g
                                              per accelerator on g rails at once, intra allgather:
                                              the network moves m * 2(m-1)/m S as well, but over g
                                              NICs per server in parallel: ~g x less time on it
  "89.6 TB" = 256 x 350 GB = 2 x 128 x S      the bytes the network carries for one allreduce of S
                                              across 128 servers when each server sends ~2S (its
                                              reduce-scatter and allgather shares) and the (p-1)/p
                                              factor is rounded to 1; exactly: flat ring
                                              128 * 2(1023/1024) S = 89.51 TB, hier 2 * 127 * S =
                                              88.9 TB. Counted once (sent), not sent + received.
Every number is also counted in the simulation (bytes through NIC links, time).
"""
from __future__ import annotations

from typing import List, Optional

from .engine import simulate
from .presets import get_topology
from .topology import Topology
from .units import describe_link, format_time

GPT3_PARAMS = 175e9
FP16 = 2


def _tb(x: float) -> str:
    return f"{x / 1e12:.2f} TB"


def _nic_bytes(res, topo: Topology) -> float:
    """Bytes that left accelerators through NICs in a simulated call."""
    return float(res.link_bytes_by_kind.get("nic_out", 0.0))


def explain(topo: Optional[Topology] = None, simulate_calls: bool = True) -> str:
    topo = topo or get_topology("dgx-h100", nodes=128)
    g, m = topo.gpus_per_server, topo.servers
    p = topo.endpoints
    S = GPT3_PARAMS * FP16
    per_rank = 2 * (p - 1) / p * S
    lines: List[str] = []
    out = lines.append
    B_nic, B_intra = topo.nic_link.bandwidth, topo.intra_link.bandwidth
    a_nic = topo.nic_link.latency + 3 * topo.switch_latency
    out(f"GPT-3 175B, fp16 gradients: 175e9 x 2 B = S = {S / 1e9:.0f} GB")
    out(f"topology: {topo.describe()}")
    out(f"symbols: S = gradient bytes; p = {p} ranks (one per accelerator); m = {m} servers; "
        f"g = {g} accelerators per server; B_nic = one NIC's bandwidth, {B_nic / 1e9:g} GB/s; "
        f"B_nvlink = one accelerator's NVLink bandwidth, {B_intra / 1e9:g} GB/s; α = one "
        f"message's latency between servers (NIC + 3 switches), {format_time(a_nic)}; "
        f"1 GB = 1e9 B, 1 TB = 1e12 B")
    out("")
    out(f"Ring allreduce over p = {p} ranks: every rank sends (p-1)/p S in the reduce-scatter and "
        f"(p-1)/p S in the allgather")
    out(f"  per rank: 2(p-1)/p S = 2 x {p - 1}/{p} x {S / 1e9:.0f} GB = {per_rank / 1e9:.1f} GB "
        f"sent (and as much received)")
    out(f"  all ranks: p x 2(p-1)/p S = {_tb(p * per_rank)} on all links (NVLink included)")
    ring_net = m * per_rank
    out(f"Flat ring, rank order filling servers ({g} consecutive ranks each): {m} of the {p} ring "
        f"hops cross servers, each carrying {per_rank / 1e9:.1f} GB over ONE NIC:")
    out(f"  network bytes = {m} x {per_rank / 1e9:.1f} GB = {_tb(ring_net)}")
    t_ring = per_rank / B_nic + 2 * (p - 1) * a_nic
    out(f"  time ~ 2(p-1)/p S / B_nic + 2(p-1) α = {per_rank / 1e9:.1f} GB / "
        f"{B_nic / 1e9:.0f} GB/s + {2 * (p - 1)} x {a_nic * 1e6:.1f} us = {t_ring:.2f} s")
    shard = S / g
    hier_net = m * g * 2 * (m - 1) / m * shard
    t_hier = (2 * (g - 1) / g * S / B_intra + 2 * (m - 1) / m * shard / B_nic)
    out(f"Hier over {m} servers x {g}: intra reduce-scatter ({(g - 1) / g * S / 1e9:.0f} GB per "
        f"accelerator over NVLink), inter allreduce of S/{g} = {shard / 1e9:.2f} GB per "
        f"accelerator among the {m} of each rail ({g} rails at once), intra allgather:")
    out(f"  network bytes = {m} servers x {g} NICs x 2({m - 1}/{m}) x {shard / 1e9:.2f} GB = "
        f"{_tb(hier_net)} (the same traffic, spread over {g} NICs per server)")
    out(f"  time ~ 2(g-1)/g S / B_nvlink + 2(m-1)/m (S/g) / B_nic = {t_hier:.2f} s "
        f"(+ latency; phases run one after the other)")
    out(f"  flat / hier ~ {t_ring / t_hier:.1f}x")
    out("")
    out('"89.6 TB" = 256 x 350 GB = 2 x 128 x S: the bytes crossing the network for ONE '
        "allreduce of S among 128 servers, with")
    out("  - S = 350 GB (fp16, decimal GB), 128 servers (1,024 GPUs / 8), every byte counted once "
        "as it is sent (not again when received),")
    out("  - each server sending ~2S: its reduce-scatter and allgather shares, the (p-1)/p factor "
        "rounded to 1,")
    out(f"  - it holds for the flat ring ({_tb(ring_net)} exactly) and for hier "
        f"({_tb(hier_net)}): the algorithms move the same bytes; hier spreads them over 8 rails.")
    out("  It is NOT per-GPU traffic (that is ~0.7 TB) nor the NVLink traffic "
        f"({_tb(p * per_rank - ring_net)} more for the flat ring).")
    t = {"ring": t_ring, "hier": t_hier}
    net = {"ring": ring_net, "hier": hier_net}
    how = "estimated"
    if simulate_calls:
        out("")
        out("Simulated (the real schedules on the topology; sizes rounded to a multiple of p "
            "elements per ring channel):")
        count = int(S // 4 // (p * topo.channels)) * p * topo.channels
        how = "simulated"
        for algo in ("ring", "hier"):
            r = simulate("allreduce", algo, topo, count=count)
            t[algo], net[algo] = r.time_s, _nic_bytes(r, topo)
            out(f"  {algo:>4}: {r.time_s:7.2f} s  busbw {r.busbw:6.1f} GB/s  network bytes "
                f"{_tb(net[algo])}  busiest link: {describe_link(r.busiest_link)} "
                f"({100 * r.busiest_link_utilisation:.0f}% busy)")
    nics = topo.nics_per_server
    because = (f": it spreads that traffic over all {nics} NICs of a server instead of one"
               if nics > 1 and t["hier"] < t["ring"] else "")
    lo, hi = sorted(net.values())
    bytes_said = (f"puts about {_tb(hi)} on the network whichever algorithm runs"
                  if hi <= 1.05 * lo else
                  f"puts {_tb(net['ring'])} on the network as a flat ring, {_tb(net['hier'])} as "
                  f"hier")
    out(f"Summary: one allreduce of GPT-3's {S / 1e9:.0f} GB of fp16 gradients over {m} servers "
        f"x {g} accelerators {bytes_said}; {how}, hier takes {format_time(t['hier'])} and a flat ring "
        f"{format_time(t['ring'])} ({t['ring'] / t['hier']:.1f}x){because}.")
    return "\n".join(lines)
