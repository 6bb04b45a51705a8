"""shm: the two-sided transport over /dev/shm for the peers of one node.

Each rank creates one segment holding an inbound ring per peer of its node; a message crosses
memory once on each side (the sender copies it into the ring, the receiver copies it out or
reduces straight from it), large messages streaming through the ring chunk by chunk. A large send
of a non-reducing call that the peer can read from this process's memory goes single-copy
instead, and so does any send above a chunk from registered memory. A waiting rank spins, then
sleeps on its segment's futex word (or its doorbell sockets); a peer wakes it only when its
sleeping flag says it may sleep.

One module per concern:

    layout.py      the segment and record layout; the ring, chunk and eager sizes
    peer.py        one peer's state: both rings, the doorbell socket, the receive matching
    segments.py    creating, attaching and unlinking segments; setup's handshake and probe
    ring.py        isend / irecv / progress: records pushed into and pulled out of the rings
    eager.py       the small-message path's calls (send_now, recv_now, ...): one record each
    doorbell.py    the sleeping flag, the futex word and the doorbell sockets
    singlecopy.py  descriptor records the receiver reads with process_vm_readv (cma.py)
    registered.py  registered memory: descriptor records naming (segment, offset)
    transport.py   ShmTransport: the parts composed, its capabilities, abort and close

``describe_copies()`` names the peers reached each way and why (logged at setup under
``MINICOMM_DEBUG=info``).
"""
from .layout import CHUNK, EAGER, segment_path
from .segments import sweep_job_segments
from .transport import ShmTransport

__all__ = ["CHUNK", "EAGER", "ShmTransport", "segment_path", "sweep_job_segments"]
