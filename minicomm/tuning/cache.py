"""The files of ``minicomm.tuning``: the link cache and the tuned table (JSON, written atomically).

The cache directory is ``$MINICOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/minicomm``, else
``~/.cache/minicomm``; ``links-<hostname>.json`` and ``tune-<hostname>.json`` (formats: the
package docstring). A corrupt file is ignored with a warning, never an error: a job must start.
"""
from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..algorithms import FAMILIES
from ..schedule import COLLECTIVES

LINKS_FORMAT = "minicomm-links/3"
TABLE_FORMAT = "minicomm-tune/1"


# ---------------------------------------------------------------------------------- cache files
def cache_dir() -> str:
    env = os.environ.get("MINICOMM_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minicomm")


def links_path() -> str:
    return os.path.join(cache_dir(), f"links-{socket.gethostname()}.json")


def table_path() -> str:
    return os.path.join(cache_dir(), f"tune-{socket.gethostname()}.json")


def _write_json(path: str, obj: Any) -> None:
    """Write atomically: concurrent jobs of one machine never see a half-written file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read_json(path: str, fmt: str, what: str) -> Optional[Dict[str, Any]]:
    """The file's object, None when it is missing; a corrupt one is ignored with a warning."""
    try:
        with open(path) as f:
            obj = json.load(f)
        if not isinstance(obj, dict) or obj.get("format") != fmt:
            raise ValueError(f"not a {fmt} file")
        return obj
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"minicomm: ignoring corrupt {what} {path}: {e}", stacklevel=3)
        return None


def load_links(path: Optional[str] = None) -> Dict[str, Any]:
    """The link cache: {"links": {name: {"alpha", "beta", "overhead"}}, "gamma", "delta", "wake"}
    (missing keys: not probed yet). Invalid values make the whole file corrupt (warned,
    ignored)."""
    path = path or links_path()
    obj = _read_json(path, LINKS_FORMAT, "link cache")
    if obj is None:
        return {"links": {}}
    try:
        raw_links = obj.get("links", {})
        if not isinstance(raw_links, dict):
            raise ValueError(f"links: expected an object, got {raw_links!r}")
        links = {}
        for k, v in raw_links.items():
            if not isinstance(v, dict):
                raise ValueError(f"links.{k}: expected an object, got {v!r}")
            entry = {f: _field(f"links.{k}.{f}", v.get(f), _POSITIVE[f])
                     for f in _LINK_FIELDS if f in v or f not in _LATER_FIELDS}
            if len(entry) == len(_LINK_FIELDS):   # else written before a field existed:
                links[str(k)] = entry             # that link is probed again
        out: Dict[str, Any] = {"links": links}
        for k in _MACHINE_FIELDS:
            if k in obj:
                out[k] = _field(k, obj[k], _POSITIVE[k])
        if "memory" in obj:       # rows (bytes, δ, γ, contention): tuning.links.measure_memory
            out["memory"] = [[_field("memory", x, False) for x in row] for row in obj["memory"]]
            if any(len(row) != 4 for row in out["memory"]):
                raise ValueError("memory rows are (bytes, delta, gamma, contention)")
        return out
    except (TypeError, ValueError) as e:
        # ignored, so the link is probed again: a bad value must not fail every job
        warnings.warn(f"minicomm: ignoring corrupt link cache {path} (it is probed again): {e}",
                      stacklevel=2)
        return {"links": {}}


_LINK_FIELDS = ("alpha", "beta", "overhead", "exec_overhead")
_LATER_FIELDS = ("exec_overhead",)     # absent from older caches (not an error)
_MACHINE_FIELDS = ("gamma", "delta", "wake", "contention")
# per-byte costs divide (bandwidth = 1 / beta): they must be > 0; latencies may be 0
_POSITIVE = {"alpha": False, "beta": True, "overhead": False, "exec_overhead": False,
             "gamma": True, "delta": True,
             "wake": False, "contention": False}


def _field(name: str, v: Any, positive: bool) -> float:
    rule = "a finite number > 0 (seconds per byte)" if positive else "a finite number >= 0"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"field {name} = {v!r}: expected {rule}")
    x = float(v)
    if not (math.isfinite(x) and (x > 0 if positive else x >= 0)):
        raise ValueError(f"field {name} = {v!r}: expected {rule}")
    return x


def save_links(data: Dict[str, Any], path: Optional[str] = None) -> str:
    path = path or links_path()
    _write_json(path, {"format": LINKS_FORMAT, "host": socket.gethostname(), **data})
    return path




# ---------------------------------------------------------------------------------- tuned table
def _entry_key(e: Dict[str, Any]) -> Tuple:
    return (e["collective"], e["world"], tuple(e["topology"]), e["intra"], e["inter"], e["bytes"])


def _check_entry(e: Any) -> Dict[str, Any]:
    if not isinstance(e, dict):
        raise ValueError(f"entry {e!r} is not an object")
    out = {"collective": str(e["collective"]), "world": int(e["world"]),
           "topology": [int(t) for t in e["topology"]], "intra": str(e["intra"]),
           "inter": str(e["inter"]), "bytes": int(e["bytes"]), "best": str(e["best"]),
           "seconds": {str(k): float(v) for k, v in dict(e.get("seconds", {})).items()}}
    if out["collective"] not in COLLECTIVES:
        raise ValueError(f"unknown collective {out['collective']!r}")
    if out["best"] not in FAMILIES:
        raise ValueError(f"unknown algorithm {out['best']!r}")
    if len(out["topology"]) != out["world"] or out["bytes"] < 0:
        raise ValueError(f"entry {e!r}: topology does not name every rank, or bytes < 0")
    return out


def load_table(path: Optional[str] = None) -> List[Dict[str, Any]]:
    """The tuned table's entries ([] when there is none); a corrupt file warns and gives []."""
    path = path or table_path()
    obj = _read_json(path, TABLE_FORMAT, "tuned table")
    if obj is None:
        return []
    try:
        return [_check_entry(e) for e in obj["entries"]]
    except (KeyError, TypeError, ValueError) as e:
        warnings.warn(f"minicomm: ignoring corrupt tuned table {path}: {e!r}", stacklevel=2)
        return []


def write_table(entries: Sequence[Dict[str, Any]], path: Optional[str] = None) -> str:
    """Merge ``entries`` into the table file (same key and size: replaced); returns its path."""
    path = path or table_path()
    merged = {_entry_key(e): e for e in load_table(path)}
    for e in entries:
        try:
            e = _check_entry(e)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a tuned-table entry ({err!r}): {e!r}; the fields are "
                             f"documented in minicomm.tuning's package docstring") from None
        merged[_entry_key(e)] = e
    _write_json(path, {"format": TABLE_FORMAT, "host": socket.gethostname(),
                       "entries": sorted(merged.values(), key=_entry_key)})
    return path
