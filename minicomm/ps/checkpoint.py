"""Atomic, owner-only checkpoints of one server's shard (its pieces, optimizer state and clocks).

One file per (server, update count): ``shard-SSS-uUUUUUUUUUUU.npz`` in ``checkpoint_dir``. A write
goes to a temporary file in the same directory (created 0600 with O_EXCL), is fsync'ed, renamed
over the final name (atomic on POSIX) and the directory is fsync'ed, so a crash leaves either the
old checkpoint or the new one, never a torn file. The directory is created 0700. The newest
``KEEP`` checkpoints of a shard are kept: servers of a synchronous job may be one checkpoint
interval apart when one dies, and resume picks the newest update count *every* server still has.

Format: an uncompressed ``.npz`` (numpy's zip of ``.npy`` arrays), read back with
``allow_pickle=False``: numeric arrays plus one uint8 array holding the metadata as JSON. Nothing
in a checkpoint is ever unpickled.

Cost: one sequential write of the shard (params + optimizer state) every ``checkpoint_every``
updates, plus an fsync; restore reads it once.
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Dict, List, Tuple

import numpy as np

FORMAT = 1
KEEP = 2
META = "__meta__"
_NAME = re.compile(r"^shard-(\d{3})-u(\d{12})\.npz$")


class CheckpointError(ValueError):
    """A checkpoint is unreadable, or was written by a job of another configuration."""


def shard_file(server: int, updates: int) -> str:
    return f"shard-{server:03d}-u{updates:012d}.npz"


def ensure_dir(path: str) -> str:
    """Create the checkpoint directory owner-only (0700) if it does not exist."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)             # makedirs' mode is filtered by the umask
    return path


def available(directory: str, server: int) -> List[Tuple[int, str]]:
    """(update count, path) of every complete checkpoint of ``server``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for n in names:
        m = _NAME.match(n)
        if m and int(m.group(1)) == server:
            found.append((int(m.group(2)), os.path.join(directory, n)))
    return sorted(found)


def remove_temporaries(directory: str, server: int) -> None:
    """Drop the half-written temporaries a crash of ``server`` may have left."""
    prefix = f".shard-{server:03d}-"
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for n in names:
        if n.startswith(prefix) and ".tmp" in n:
            try:
                os.unlink(os.path.join(directory, n))
            except FileNotFoundError:
                pass


def write(directory: str, server: int, updates: int, meta: dict,
          arrays: Dict[str, np.ndarray], keep: int = KEEP) -> str:
    """Write one checkpoint atomically; delete this shard's older ones beyond ``keep``."""
    if META in arrays:
        raise ValueError(f"array name {META!r} is reserved")
    directory = ensure_dir(directory)
    final = os.path.join(directory, shard_file(server, updates))
    tmp = os.path.join(directory, f".{shard_file(server, updates)}.tmp{os.getpid()}")
    blob = json.dumps(dict(meta, format=FORMAT, server=server, updates=updates)).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
    for _, old in available(directory, server)[:-keep]:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return final


def read(path: str) -> Tuple[dict, Dict[str, np.ndarray]]:
    """(metadata, arrays) of one checkpoint file; ``CheckpointError`` if it is not one of ours."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e})") from e
    blob = arrays.pop(META, None)
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise CheckpointError(f"{path}: no metadata record")
    try:
        meta = json.loads(blob.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, "
                              f"expected {FORMAT}")
    return meta, arrays
