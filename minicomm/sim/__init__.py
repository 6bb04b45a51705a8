"""Cluster-scale simulator: the schedule IR's third interpreter (time on a modelled network).

    from minicomm import sim
    topo = sim.get_topology("dgx-h100", nodes=128)
    r = sim.simulate("allreduce", "hier", topo, nbytes=1 << 30)
    r.time_s, r.algbw, r.busbw, r.busiest_link

Modules: topology (servers, intra fabric, NICs, fat-tree), presets (+ presets.json), engine
(schedules as flows: α per message, max-min fair link sharing, γ per reduced byte), host (the
same schedules as processes on CPU cores: the machine auto prices; + host_model.json), ps_model
(parameter server push/pull), explain (the GPT-3 traffic arithmetic), timeline (a simulated
call's modelled steps, which ``minicomm sim --trace`` writes), cli (``minicomm sim``).
Imports only minicomm.schedule / algorithms / errors / ops, numpy and the standard library.
"""
from .engine import SimResult, busbw_factor, simulate, simulate_schedules  # noqa: F401
from .presets import get_topology, link, links, topologies  # noqa: F401
from .topology import Fabric, LinkSpec, Topology  # noqa: F401
