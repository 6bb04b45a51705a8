"""Link measurement and the tuned table: what fills in the cost model's parameters.

``minicomm.cost`` prices schedules from a ``LinkModel``; this package measures one: probes at
world start (``links``), the files it caches them in (``cache``), and timing every algorithm
for ``minicomm bench --tune`` (``table``). It sits above the communicator and the launcher: it
builds communicators and may start ranks (``measure_table`` with spawn arguments).

Link parameters (``LinkModel``): per link class (intra-node, inter-node) α (one exchange step), β
(s/byte) and o (CPU per message operation); γ (in-place add, s/byte of array), δ (memcpy), wake,
contention and the node's cores (fields: ``minicomm.cost.LinkModel``). At communicator start
(``agree_link_model``, which the world bootstrap ``minicomm.launch.world.connect_world`` calls
through its link-agreement hook) rank 0 reads ``links-<hostname>.json`` from the cache
directory, or measures what it lacks, on a two-rank communicator of rank 0 and a peer over that
link (``probe_link``: three 8-byte calls whose differences, against the simulator's prediction
for the same schedules, give o and α, then ``PROBE_BYTES`` exchanged and sent one way for β; ``probe_contention``: copies
by one rank, then by two at once; ``probe_wake``: a message to a sleeping rank; ``measure_local``:
γ and δ with numpy on 32 MiB). It writes the cache (so a machine measures once: delete the file
to measure again, best on an idle machine) and sends its values, and the tuned-table entries of
this world's transports, to every rank: the choice is identical on every rank even when their
own measurements or files would differ. ``MINICOMM_TUNE=0`` measures nothing (the constants
``DEFAULT_LINKS``, ``GAMMA``, ``DELTA``, ``WAKE``; a tuned table is still followed). A corrupt
cache file is ignored with a warning (and probed anew). The cache directory is
``$MINICOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/minicomm``, else ``~/.cache/minicomm``. Link
cache format (JSON; seconds, seconds per byte)::

    {"format": "minicomm-links/3", "host": "box1",
     "links": {"shm": {"alpha": 1.0e-05, "beta": 1.6e-10, "overhead": 3.5e-06},
               "tcp": {...}, "tcp>box2": {...}},            # ">host": the link to another host
     "gamma": 8.1e-11, "delta": 7.9e-11, "wake": 2.3e-04, "contention": 0.33}

Tuned table API (for ``minicomm bench --tune``)::

    entries = measure_table(target, collectives, sizes, algorithms=FAMILIES,
                            batch_seconds=0.02, batches=5, max_iters=1000)
        target: a Communicator (call it on every rank, like a collective; every rank gets the same
                entries) or a dict of ``mc.spawn`` keyword arguments, e.g.
                {"world_size": 4, "transport": "shm", "nodes": 1} (it starts the ranks itself).
        sizes: message sizes in bytes *as auto sees them*: the per-rank block, count x itemsize,
                i.e. the vector for broadcast / reduce / allreduce, one rank's input for
                allgather / gather, one block (a 1/p of the input) for reduce_scatter / alltoall /
                scatter. (nccl-tests' size is p times that for the block collectives.) Each is
                rounded down to whole float32 elements (at least one); barrier is timed once,
                at 0 bytes, whatever ``sizes`` says.
        Timing: float32 sum, root 0, each family called explicitly (so no table or env var
        decides); a batch is ``k`` back-to-back calls after a barrier, k chosen so a batch takes
        ``batch_seconds`` (1..max_iters); one untimed batch each first; families take turns
        batch by batch (drift hits all alike); a batch's time is the slowest rank's; an entry's
        time is the median over ``batches`` batches. ``time_algorithms(comm, collective, bytes,
        algorithms, ...)`` does this for one size (any of FAMILIES and "auto") and returns
        {algorithm: seconds}, the same on every rank.
    path = write_table(entries, path=None)   # merge into tune-<hostname>.json (entries with the
                                             # same key are replaced), atomically; returns the path
    entries = load_table(path=None)          # [] when missing; a corrupt file: warning and []

Table file format (JSON), one entry per timed (key, size)::

    {"format": "minicomm-tune/1", "host": "box1",
     "entries": [{"collective": "allreduce", "world": 4, "topology": [0, 0, 0, 0],
                  "intra": "shm", "inter": "tcp", "bytes": 1024,
                  "seconds": {"ring": 3.1e-05, "tree": 2.9e-05, "rhd": 2.2e-05, "hier": 3.1e-05},
                  "best": "rhd"}, ...]}

    key = (collective, world, topology, intra, inter): ``topology`` is the node index of every
    rank (nodes numbered by first appearance, as ``comm.topology``); ``intra`` / ``inter`` are the
    transports inside a node / between nodes (as ``comm.link_model`` names them,
    ``launch.world.link_names``: shm+tcp for transport "auto" and for "shm" on one node, shm+shm
    for "shm" across emulated nodes, tcp+tcp for "tcp"). ``best`` is the family auto follows;
    ``seconds`` is informational (median seconds per call).
"""
from ..cost import LinkModel
from .cache import (
                    LINKS_FORMAT,
                    TABLE_FORMAT,
                    cache_dir,
                    links_path,
                    load_links,
                    load_table,
                    save_links,
                    table_path,
                    write_table,
)
from .links import agree_link_model, measure_local, probe_contention, probe_link, probe_wake
from .table import measure_table, time_algorithms

__all__ = ["LinkModel", "LINKS_FORMAT", "TABLE_FORMAT", "cache_dir", "links_path", "load_links",
           "load_table", "save_links", "table_path", "write_table", "agree_link_model",
           "measure_local", "probe_contention", "probe_link", "probe_wake", "measure_table",
           "time_algorithms"]
