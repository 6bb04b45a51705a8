"""minicomm: from-scratch collective communication in pure Python + numpy.

    import minicomm as mc
    results = mc.spawn(lambda comm: comm.allreduce(np.ones(4)), world_size=4)
"""
from .communicator import Communicator, Work
from .errors import CommError, CommTimeout, MismatchError, PeerFailure, RMAError, SpawnError
from .launch import init, spawn
from .launch.world import set_link_agreement
from .ops import AVG, BAND, BOR, BXOR, MAX, MIN, PROD, SUM
from .p2p import ANY_SOURCE, ANY_TAG, Status
from .tuning import agree_link_model

# The composition root: new worlds agree on their links' model (minicomm.tuning sits above the
# launcher, so the launcher takes its measurement as a hook instead of importing it).
set_link_agreement(agree_link_model)
del set_link_agreement, agree_link_model

__version__ = "0.1.0"
__all__ = ["spawn", "init", "Communicator", "Work", "CommError", "CommTimeout", "MismatchError",
           "PeerFailure", "RMAError", "SpawnError", "SUM", "PROD", "MIN", "MAX", "AVG", "BAND",
           "BOR", "BXOR", "ANY_SOURCE", "ANY_TAG", "Status"]
