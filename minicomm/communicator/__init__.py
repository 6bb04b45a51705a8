"""The public communicator: validation, algorithm choice, sequence tags, async work, split.

Every collective goes the same way:
  validate the arguments locally (TypeError / ValueError before anything is sent)
  -> choose the family (per-call ``algorithm=``, else ``MINICOMM_ALGO``, else the α-β model)
  -> take the next sequence number (every rank of the communicator takes the same one)
  -> optionally exchange call fingerprints (``check="full"``: every rank learns of a mismatch)
  -> fetch the cached plan for (collective, family, count, root) and run it through the transport
Every message of the call carries (communicator id, sequence number, step, packed signature,
count), so a rank that disagrees on the call is detected from the first header it receives.

The package, by job (``Communicator`` composes one class of each):
  core.py          the class and its state; the transport's capabilities, learned once
  lifecycle.py     the one-thread guard, async work (``Work``), break, abort, close
  collectives.py   the nine collectives: a repeated call finds its bound ``Call`` (a cache in
                   front of what ``*_init`` binds), else validate, bind, run
  buffers.py       input, output and in-place handling; each collective's buffer layout
  calls.py         call signatures bound to plans (``Call``), and running them
  cache.py         ``BoundedCache``, the one cache type
  fingerprints.py  the call fingerprint checks;  scatter.py  scatter's header exchange
  pointtopoint.py  send / recv;  objects.py  object collectives (cloudpickle)
  persistent.py    ``*_init``: persistent requests (``Request``) over bound calls
  grouping.py      ``comm.group()``: held calls, fusion, the group's check
  split.py         split and windows;  memory.py  registered buffers
"""
from .core import Communicator
from .lifecycle import WORLD_ID, Work, context
from .persistent import Request

__all__ = ["Communicator", "Work", "Request", "WORLD_ID", "context"]
