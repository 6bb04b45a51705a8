"""Link and topology presets for the simulator; the figures live in ``presets.json`` (data).

Per direction, GB/s = 1e9 B/s; "eff" is the rate the model uses, "line" the nominal one; α the
per-message latency of the link class. (I) = illustrative: an assumption, not a published
measurement.

  link           eff   line   α us  source
  nvlink4        370   450    1.9   H100 datasheet (900 GB/s bidir); 370 GB/s effective for ring:
                                     https://github.com/NVIDIA/nccl-tests/issues/212 (NCCL dev)
  nvlink3        240   300    1.9   A100 datasheet (600 GB/s bidir); "close to 240 GB/s":
                                     https://github.com/NVIDIA/nccl/issues/1712 (NVIDIA)
  pcie5-x16      40    63     2.5   PCI-SIG 32 GT/s x16; (I) 40 from the 35-45 GB/s busbw of 8x
                                     H100 PCIe in a vendor blog (alayanew.com nccl-tests post)
  ib-hdr-200     24    25     4.0   "24GB/s is the peak performance per 200G NIC":
                                     https://github.com/NVIDIA/nccl-tests/issues/119 (NCCL dev)
  ib-ndr-400     47    50     4.0   "For NDR @ 400Gbps you should see 46-48GB/s per NIC":
                                     https://github.com/NVIDIA/nccl-tests/issues/290 (NVIDIA)
  roce-400       45    50     5.5   (I) 400GbE line rate, perftest 392 Gb/s per rail
                                     (https://github.com/NVIDIA/nccl/issues/2409); efficiency and
                                     latency assumed for a tuned lossless fabric
  ub-400         48    50     1.5   (I) Unified Bus port (UB-Mesh, arXiv 2503.20377): all assumed
  ub-mesh-intra  376   392    1.0   (I) one NPU's x56 UB lanes in its rack's 8 x 8 full mesh (x4
                                     per link; UB-Mesh's x72 per NPU less x16 out of the rack)
  ub-x128        860   896    1.5   (I) a board's x128 UB port to the Clos (x16 per NPU)
                                     UB lanes: (I) 7 GB/s each, so x72 = one H100's 450 + 50 GB/s

Issue gap g (LogP): 0.1 us NVLink, 0.2 PCIe / UB, 0.5 IB / RoCE between two messages one sender
starts at once, (I) everywhere: it matters for patterns that issue many messages per step (a PS
round, all-to-all), not for rings and trees.

α values: NCCL's own model constants (``hwLat`` for a ring step with the LL128 protocol in
src/graph/tuning.cc, https://github.com/NVIDIA/nccl) — approximate, not measurements.

Topologies (``--nodes`` changes the server count of any of them):
  dgx-h100       8 x H100, NVSwitch (nvlink4), 8 x NDR 400G rails, leaf/spine, 32 servers per
                 leaf group (DGX SuperPOD scalable unit), non-blocking
  dgx-a100       8 x A100, NVSwitch (nvlink3), 8 x HDR 200G rails, 20 servers per leaf group
  pcie-8gpu      8 GPUs on PCIe 5.0 x16 under one CPU root (360 GB/s root, (I)), 1 x NDR per server
  roce-fat-tree  8 x H100 NVLink4 servers, 8 x RoCEv2 400G per server on its ToR, 3 tiers,
                 4 servers per ToR, 8 ToRs per pod, 2:1 to the core (I)
  ub-mesh        UB-Mesh racks: 64 NPUs as an 8 x 8 2D full mesh (``mesh_dims``), one UB x128
                 port per board of 8 to a rail-optimised Clos, 2 racks = 128 NPUs (I);
                 arXiv 2503.20377 (docs/decisions/ub-mesh-shape.md)
  dgx-a100-sharp dgx-a100 whose switches reduce (SHARP): 20 GB/s per port (NCCL's rule,
                 nccl#320), 1 GiB - 32 B per operation (SHARP docs), 0.6 us per reducing
                 switch (I: fitted to Graham et al. 2016's 8-byte point)
  dgx-h100-sharp dgx-h100 (NVLS) whose switches reduce: 40 GB/s per port (I: the HDR rule
                 scaled by NDR's line rate), the rest as dgx-a100-sharp
                 (docs/decisions/sharp-model.md)

Checked against public nccl-tests figures in tests/test_sim.py (the simulated ring busbw of one
server, and of one NIC between two servers, must be the cited effective rates within 5%).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from .topology import LinkSpec, Topology, link_from_dict, read_topology_file, topology_from_dict

PRESETS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets.json")

# Between-server link of each interconnect ``--compare-interconnects`` puts on the same servers.
INTERCONNECTS = (("IB NDR 400G", "ib-ndr-400", 0.2e-6), ("RoCEv2 400G", "roce-400", 0.5e-6),
                 ("UB 400G", "ub-400", 0.2e-6))


@lru_cache(maxsize=1)
def _load() -> Tuple[Dict[str, LinkSpec], Dict[str, Topology]]:
    with open(PRESETS_FILE) as f:
        data = json.load(f)
    links = {name: link_from_dict(d, name) for name, d in data["links"].items()}
    # a preset link keeps its preset's name
    links = {name: LinkSpec(**{**l.__dict__, "name": name}) for name, l in links.items()}
    topos: Dict[str, Topology] = {}
    for name, d in data["topologies"].items():
        topos[name] = topology_from_dict({**d, "name": name}, links, topos)
    return links, topos


def links() -> Mapping[str, LinkSpec]:
    return dict(_load()[0])


def topologies() -> Mapping[str, Topology]:
    return dict(_load()[1])


def link(name: str) -> LinkSpec:
    ls = _load()[0]
    if name not in ls:
        raise ValueError(f"unknown link preset {name!r}; known: {', '.join(sorted(ls))}")
    return ls[name]


def sharp_settings(of: Union[str, Topology]) -> Optional[Dict[str, Any]]:
    """The SHARP figures (Topology fields) of a topology with network.sharp on, or of the
    switches that go with a link preset (those of a preset topology with SHARP on over that
    link; ``--compare-interconnects``); None where no switch reduces."""
    found = [of] if isinstance(of, Topology) else [t for t in _load()[1].values()
                                                   if t.nic_link.name == of]
    for t in found:
        if t.sharp:
            return {"sharp": True, "sharp_port_bandwidth": t.sharp_port_bandwidth,
                    "sharp_max_bytes": t.sharp_max_bytes, "sharp_latency": t.sharp_latency}
    return None


def get_topology(spec: str, nodes: Optional[int] = None) -> Topology:
    """A preset name or a .toml / .json file path; ``nodes`` overrides the server count."""
    ls, ts = _load()
    if spec in ts:
        topo = ts[spec]
    elif os.path.splitext(spec)[1] in (".toml", ".json") or os.path.sep in spec:
        topo = read_topology_file(spec, ls, ts)
    else:
        raise ValueError(f"unknown topology {spec!r}: give a preset ({', '.join(sorted(ts))}) "
                         f"or a .toml / .json file")
    if nodes is not None:
        if nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {nodes}")
        topo = topo.with_servers(nodes)
    return topo
