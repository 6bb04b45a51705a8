"""Atomic, owner-only checkpoints of one server's shard (its pieces, optimizer state and clocks),
each belonging to one run.

A *run* is one training job. ``ps.start(resume=False)`` begins a new run: the ``run_id`` it
names, which must have no checkpoints in the directory yet, or a fresh id drawn from the time
and 32 random bits (``new_run_id``). ``resume=True`` goes on with an existing run: the named one,
else the run whose newest checkpoint was written last (``choose``). A resumed job keeps its run's
id, so its later checkpoints rotate with the ones it resumed from.

One file per (server, run, update count): ``shard-SSS-r<run>-uUUUUUUUUUUU.npz`` in
``checkpoint_dir``; the metadata inside repeats the server, run and update count, and ``read``
refuses a file whose metadata disagrees with what its name promised. The newest ``KEEP``
checkpoints of a shard are kept *within its run*: servers of a synchronous job may be one
checkpoint interval apart when one dies, and resume picks the newest update count every server
holds. Another run's files are never deleted nor overwritten, whatever their update counts.

The directory is created 0700; an existing one is used only if it is a directory owned by this
user that neither group nor others can write (``ensure_dir``), else ``CheckpointError`` says what
to do: another local user who can write into it could plant a checkpoint that resume restores,
and a chmod now would not undo what they already planted, so it is refused, not repaired. A write
goes to a temporary file with a drawn name (``mkstemp``: O_EXCL, 0600) in that directory, is
fsync'ed, renamed over the final name (atomic on POSIX) and the directory is fsync'ed, so a
crash leaves either the old checkpoint or the new one, never a torn file.

Format: an uncompressed ``.npz`` (numpy's zip of ``.npy`` arrays), read back with
``allow_pickle=False``: numeric arrays plus one uint8 array holding the metadata as a JSON
object. Nothing in a checkpoint is ever unpickled.

Cost: one sequential write of the shard (params + optimizer state) every ``checkpoint_every``
updates, plus an fsync; restore reads it once; choosing a run lists the directory once.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import stat
import tempfile
import time
import zipfile
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

FORMAT = 1
KEEP = 2
META = "__meta__"
RUN_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_RUN = re.compile(rf"^{RUN_ID}$")
_NAME = re.compile(rf"^shard-(\d{{3}})-r({RUN_ID})-u(\d{{12}})\.npz$")
_TEMP = re.compile(rf"^\.shard-(\d{{3}})-r({RUN_ID})-u\d{{12}}\.npz\.[A-Za-z0-9_]+\.tmp$")

# (newest file's mtime in ns, update counts oldest first) per run, as ``runs`` lists them
Listing = Dict[str, Tuple[int, List[int]]]


class CheckpointError(ValueError):
    """A checkpoint is unreadable, was written by a job of another configuration, or its
    directory is not private to this user; or a new run's id already has checkpoints."""


def check_run_id(run_id) -> str:
    """``run_id`` if it can name a run (it becomes part of file names), else ValueError."""
    if not isinstance(run_id, str) or not _RUN.match(run_id):
        raise ValueError(f"run_id {run_id!r}: 1..64 letters, digits, '_', '.' or '-', starting "
                         f"with a letter or digit")
    return run_id


def new_run_id(taken=()) -> str:
    """A fresh run id: the UTC start time (to the microsecond) and 32 random bits."""
    while True:
        ns = time.time_ns()
        run = (time.strftime("%Y%m%d-%H%M%S", time.gmtime(ns // 10**9))
               + f"-{ns // 1000 % 10**6:06d}-{secrets.token_hex(4)}")
        if run not in taken:
            return run


def shard_file(server: int, updates: int, run: str) -> str:
    return f"shard-{server:03d}-r{run}-u{updates:012d}.npz"


def ensure_dir(path) -> str:
    """Create the checkpoint directory 0700, or check that an existing one is private.

    Raises ``CheckpointError`` for a path that is not a directory, a directory another user
    owns, or one that group or others can write."""
    path = os.fspath(path)
    try:
        os.makedirs(path, mode=0o700)
        os.chmod(path, 0o700)             # makedirs' mode is filtered by the umask
    except FileExistsError:
        pass
    st = os.stat(path)                    # a symlink's target is where the files land
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint directory {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise CheckpointError(f"checkpoint directory {path} is owned by uid {st.st_uid}, not by "
                              f"this user (uid {me}): its owner controls what resume would "
                              f"restore; use a directory of your own (minicomm creates it 0700)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise CheckpointError(f"checkpoint directory {path} has mode {mode:04o}: group or others "
                              f"can write into it, so another user could plant a checkpoint "
                              f"that resume restores; check what is in it, then `chmod go-w "
                              f"{path}` (or 0700), or use another directory (minicomm creates "
                              f"it 0700)")
    return path


def runs(directory: str, server: int) -> Listing:
    """Every run with a complete checkpoint of ``server``: {run: (newest mtime ns, updates)}."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    found: Dict[str, Tuple[int, List[int]]] = {}
    for n in names:
        m = _NAME.match(n)
        if not m or int(m.group(1)) != server:
            continue
        try:
            st = os.stat(os.path.join(directory, n), follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        newest, updates = found.get(m.group(2), (0, []))
        updates.append(int(m.group(3)))
        found[m.group(2)] = (max(newest, st.st_mtime_ns), updates)
    return {r: (t, sorted(u)) for r, (t, u) in found.items()}


def available(directory: str, server: int, run: str) -> List[Tuple[int, str]]:
    """(update count, path) of every complete checkpoint of ``server`` in ``run``, oldest first."""
    _, updates = runs(directory, server).get(run, (0, []))
    return [(u, os.path.join(directory, shard_file(server, u, run))) for u in updates]


def remove_temporaries(directory: str, server: int, run: str) -> None:
    """Drop the half-written temporaries a crash of ``server`` in ``run`` may have left."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for n in names:
        m = _TEMP.match(n)
        if m and int(m.group(1)) == server and m.group(2) == run:
            try:
                os.unlink(os.path.join(directory, n))
            except FileNotFoundError:
                pass


def write(directory: str, server: int, updates: int, meta: dict,
          arrays: Dict[str, np.ndarray], keep: int = KEEP, *, run: str) -> str:
    """Write one checkpoint of ``run`` atomically; delete the run's older ones beyond ``keep``."""
    check_run_id(run)
    if META in arrays:
        raise ValueError(f"array name {META!r} is reserved")
    directory = ensure_dir(directory)
    name = shard_file(server, updates, run)
    final = os.path.join(directory, name)
    blob = json.dumps(dict(meta, format=FORMAT, run=run, server=server, updates=updates)).encode()
    # A drawn name created with O_EXCL: nobody can have made it first, nor guess it.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o600)              # whatever the umask
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{META: np.frombuffer(blob, np.uint8)}, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)                     # the rename itself is durable
    finally:
        os.close(dfd)
    for _, old in available(directory, server, run)[:-keep]:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return final


def read(path: str, run: Optional[str] = None, server: Optional[int] = None,
         updates: Optional[int] = None) -> Tuple[dict, Dict[str, np.ndarray]]:
    """(metadata, arrays) of one checkpoint file; ``CheckpointError`` if it is not one of ours
    (or, for each of ``run``, ``server``, ``updates`` given, its metadata says otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                or stat.S_IMODE(st.st_mode) & 0o022:
            raise CheckpointError(f"{path}: not a regular file of this user that only it can "
                                  f"write (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})")
        try:
            z = np.load(f, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive")
            with z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, KeyError, NotImplementedError, zipfile.BadZipFile,
                zlib.error) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint ({e})") from e
    blob = arrays.pop(META, None)
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise CheckpointError(f"{path}: no metadata record")
    try:
        meta = json.loads(blob.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: metadata is not a JSON object (a JSON "
                              f"{type(meta).__name__})")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, "
                              f"expected {FORMAT}")
    for key, want in (("run", run), ("server", server), ("updates", updates)):
        if want is not None and meta.get(key) != want:
            raise CheckpointError(f"{path}: its metadata says {key}={meta.get(key)!r}, its name "
                                  f"{key}={want!r}")
    return meta, arrays


def choose(listings: Sequence[Listing], resume: bool, run_id: Optional[str], sync: bool,
           directory: str) -> Tuple[str, List[int], Optional[str]]:
    """Which run a starting job is, and the update count each server restores (-1: none).

    ``listings``: each server's ``runs``. Returns (run, update count per server, a note to print
    or None). ``resume=False``: ``run_id`` (``CheckpointError`` if it has checkpoints) or a fresh
    id. ``resume=True``: ``run_id``, else the run whose newest file (on any server) was written
    last; a synchronous job restores the newest update count every server holds, an asynchronous
    one each server's newest. A run without checkpoints starts from the initial values."""
    fresh = [-1] * len(listings)
    known = set().union(*listings)
    if not resume:
        if run_id is None:
            return new_run_id(known), fresh, None
        if run_id in known:
            raise CheckpointError(f"run {run_id!r} already has checkpoints in {directory}: "
                                  f"resume=True continues it; another run_id (or none) starts "
                                  f"a new run")
        return run_id, fresh, None
    named = run_id is not None
    if not named:
        if not known:
            return new_run_id(), fresh, None
        run_id = max(known, key=lambda r: (max(s[r][0] for s in listings if r in s), r))
    if run_id not in known:
        return run_id, fresh, None                  # a named run without files starts here
    have = [set(s[run_id][1]) if run_id in s else set() for s in listings]
    if not sync:
        return run_id, [max(h) if h else -1 for h in have], None
    common = set.intersection(*have)
    if common:
        return run_id, [max(common)] * len(listings), None
    where = "; ".join(f"server {i}: {sorted(h)}" for i, h in enumerate(have))
    if named:
        raise CheckpointError(f"run {run_id!r} in {directory} has no update count that every "
                              f"server holds ({where}); resume another run, or start a new one")
    new = new_run_id(known)
    return new, fresh, (f"no checkpoint of run {run_id!r} that every server holds ({where}); "
                        f"run {new!r} starts from the initial values")
