"""minicomm: from-scratch collective communication in pure Python + numpy.

    import minicomm as mc
    results = mc.spawn(lambda comm: comm.allreduce(np.ones(4)), world_size=4)

Start a world with ``spawn`` (threads or processes on this machine) or ``init`` (in a process
that ``minicomm run``, mpiexec, srun or torchrun started); every rank gets a ``Communicator``.
The names here: ``spawn``, ``init``, ``Communicator``, ``Work`` (an async operation's handle),
``Request`` (a persistent collective, from ``comm.allreduce_init`` and the other ``*_init``),
``Status`` (what a receive matched), the errors (``CommError`` and its subclasses
``CommTimeout``, ``MismatchError``, ``PeerFailure``, ``Revoked``, ``RMAError``, ``SpawnError``), the
reduction ops ``SUM``, ``PROD``, ``MIN``, ``MAX``, ``AVG``, ``BAND``, ``BOR``, ``BXOR`` (the
strings "sum", "prod", ...: ``op=`` takes either) and the wildcards ``ANY_SOURCE`` and
``ANY_TAG`` of ``recv`` / ``irecv`` (both -1).
"""
from . import algorithms
from . import verifier as _verifier
from .communicator import Communicator, Request, Work
from .errors import (
    CommError,
    CommTimeout,
    MismatchError,
    PeerFailure,
    Revoked,
    RMAError,
    SpawnError,
)
from .launch import init, spawn
from .launch.world import set_link_agreement
from .ops import AVG, BAND, BOR, BXOR, MAX, MIN, PROD, SUM
from .p2p import ANY_SOURCE, ANY_TAG, Status
from .tuning import agree_link_model

# The composition root: new worlds agree on their links' model (minicomm.tuning sits above the
# launcher, so the launcher takes its measurement as a hook instead of importing it).
set_link_agreement(agree_link_model)
del set_link_agreement, agree_link_model
# register(verify=True) proves, and every registered schedule is checked before it runs, with
# the verifier: a layer above the algorithms, so they take it as hooks
algorithms.set_prover(_verifier.prove_family)
algorithms.set_checker(_verifier.check_structure)
del _verifier

__version__ = "0.1.0"
__all__ = ["spawn", "init", "Communicator", "Work", "Request", "CommError", "CommTimeout",
           "MismatchError", "PeerFailure", "Revoked", "RMAError", "SpawnError", "SUM", "PROD",
           "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "ANY_SOURCE", "ANY_TAG", "Status"]
