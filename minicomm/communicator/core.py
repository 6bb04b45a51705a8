"""The ``Communicator`` class: its state, composed from the package's parts (package doc)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from ..cost import LinkModel, parse_algo_env
from ..flightrecord import FlightRecorder, record_capacity
from ..p2p import P2PEngine
from ..settings import env_channels, env_debug, env_timeout, timeout_arg
from ..transports.base import Capabilities, capabilities_of
from .buffers import Buffers
from .calls import CACHE_ENTRIES, CallPlans
from .collectives import Collectives
from .faulttolerance import FaultTolerance
from .fingerprints import Fingerprints
from .grouping import Grouping
from .lifecycle import COLL, P2P, Lifecycle, context
from .memory import RegisteredBuffers
from .objects import ObjectCollectives
from .observe import Observability
from .persistent import PersistentCollectives
from .pointtopoint import PointToPoint
from .scatter import ScatterHeader
from .split import Split
from .uneven import UnevenCollectives


class Communicator(Collectives, UnevenCollectives, ScatterHeader, ObjectCollectives,
                   PersistentCollectives, Grouping, PointToPoint, Split,
                   FaultTolerance, Observability, RegisteredBuffers, CallPlans, Fingerprints,
                   Buffers, Lifecycle):
    """A group of ranks that run collectives together. Create with ``mc.spawn`` or ``mc.init``.

    Its methods: the collectives (``allreduce``, ``reduce``, ``broadcast``, ``allgather``,
    ``gather``, ``reduce_scatter``, ``alltoall``, ``scatter``, ``barrier``), the uneven and
    prefix ones (``allgatherv``, ``gatherv``, ``scatterv``, ``alltoallv``, ``scan``,
    ``exscan``), their object forms,
    point-to-point (``send``, ``recv``, ``isend``, ``irecv``), ``split``, ``window``,
    registered buffers (``empty``, ``register``, ``free``), fault tolerance (``revoke``,
    ``shrink``, ``agree``, ``failed_ranks``), observing (``dump_flight_record``, ``stats``,
    ``monitored_barrier``), ``abort`` and ``close``. A
    communicator is used by one thread at a time; ``async_op=True`` overlaps.

    Attributes:
        rank (int): This rank, 0..size-1.
        size (int): The number of ranks.
        world_ranks (tuple): The world rank of each rank (``world_ranks[comm.rank]`` is this
            rank's).
        topology (tuple): The node of each rank (nodes numbered 0..k-1 in order of first
            appearance).
        node (int): This rank's node.
        num_nodes (int): The number of nodes.
        local_rank (int): This rank's index among the ranks of its node.
        local_size (int): The number of ranks on this node.
        transport (object): The transport the messages move over (``transport.name``).
        caps (Capabilities): What the transport offers beyond the two-sided core, learned once.
        timeout (float): Seconds a call waits at most (``MINICOMM_TIMEOUT``, ``timeout=``).
        check (str): "header" (tags checked on every message, fingerprints before rooted
            calls), or "full": a fingerprint exchange before every call
            (``MINICOMM_DEBUG=detail``).
        link_model (LinkModel): What ``algorithm="auto"`` chooses by.

    Examples:
        >>> comm.rank in range(comm.size), comm.size
        (True, 2)
    """

    def __init__(self, transport, rank: int, size: int, *,
                 world_ranks: Optional[Sequence[int]] = None,
                 topology: Optional[Sequence[int]] = None, comm_id: int = 1,
                 timeout: Optional[float] = None, check: Optional[str] = None,
                 link_model: Optional[LinkModel] = None, _owner: bool = True,
                 _caps: Optional[Capabilities] = None):
        self.transport = transport
        self.caps = capabilities_of(transport) if _caps is None else _caps
        self.rank, self.size = rank, size
        self.world_ranks = tuple(world_ranks) if world_ranks is not None else tuple(range(size))
        topo = tuple(topology) if topology is not None else (0,) * size
        # Node ids renumbered 0..k-1 in order of first appearance, so every rank agrees.
        remap: Dict[int, int] = {}
        self.topology = tuple(remap.setdefault(t, len(remap)) for t in topo)
        self.node = self.topology[rank]
        self.num_nodes = len(set(self.topology))
        same = [r for r in range(size) if self.topology[r] == self.node]
        self.local_rank, self.local_size = same.index(rank), len(same)
        self.comm_id = comm_id
        self.timeout = timeout_arg("timeout", timeout) or env_timeout()
        debug = env_debug()
        self.debug_info = debug in ("info", "detail")
        # "header": tags checked on every message, plus a fingerprint exchange before rooted
        # collectives; "full" (MINICOMM_DEBUG=detail): a fingerprint exchange before every call.
        self.check = check or ("full" if debug == "detail" else "header")
        self._algo_env = parse_algo_env()
        self.channels = env_channels()     # a ring's channel count (MINICOMM_CHANNELS)
        self._ctx = context(comm_id, COLL)
        capacity = record_capacity()
        self._flight = FlightRecorder(capacity, comm_id, rank, self.world_ranks) if capacity \
            else None
        self._init_lifecycle(_owner)
        self._init_fingerprints(CACHE_ENTRIES)
        self._init_scatter()
        self._switch = None               # the job's in-network switch link (launch/switch.py)
        self._innet_refused = False       # auto stops asking the switch once it declined
        self._innet_used = False          # this communicator holds a group on the switch
        self._init_calls(link_model)      # sets link_model, which clears the scatter plans too
        self._p2p = P2PEngine(transport, rank, self.world_ranks, context(comm_id, P2P))

    def __repr__(self):
        return (f"<Communicator rank {self.rank}/{self.size} node {self.node}/{self.num_nodes} "
                f"transport={self.transport.name} id={self.comm_id}>")
