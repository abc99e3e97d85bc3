"""Saving and restoring a training state: atomic, versioned, checksummed.

File layout (all integers little-endian):

    magic    b"JGRAPH-STATE\\n"                    (13 bytes)
    version  u32                                   (FORMAT_VERSION)
    hlen     u64, then `hlen` bytes of JSON header: one entry per leaf (path, shape, dtype,
             offset, nbytes) plus optional `extra` (JSON-serialisable user data)
    payload  the leaves' raw bytes (C order), at the header's offsets
    sha256   32 bytes over everything before it

The write goes to a temporary file in the same folder, is flushed and fsync'ed, then renamed over
`path` (atomic on POSIX): a crash leaves either the old file or the new one. Loading checks magic,
version, length, checksum, and every leaf's path, shape and dtype against the expected state
before building anything, so a truncated or altered file raises `StateFileError` and the caller's
state (and dataset) are left untouched. A dataset's shard order is stored as the leaf `dataset`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import jax
import numpy as np

from jgraph.errors import JGraphError

MAGIC = b"JGRAPH-STATE\n"
FORMAT_VERSION = 1
_DIGEST = 32


class StateFileError(JGraphError):
    """A state file is missing, truncated, altered, of another version or of another state."""


def _leaves_with_paths(state, dataset):
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    items = [(jax.tree_util.keystr(p), leaf) for p, leaf in flat]
    if dataset is not None:
        items.append(("dataset", dataset.permutation))
    return items


def save_state(path, state, dataset=None, extra=None) -> None:
    """Write `state` (and `dataset.permutation`) to `path` atomically."""
    path = Path(path)
    entries, chunks, offset = [], [], 0
    for name, leaf in _leaves_with_paths(state, dataset):
        arr = np.asarray(leaf)
        data = arr.tobytes(order="C")
        entries.append({"path": name, "shape": list(arr.shape), "dtype": arr.dtype.name,
                        "offset": offset, "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    header = json.dumps({"leaves": entries, "extra": extra}, sort_keys=True).encode()
    body = b"".join([MAGIC, struct.pack("<IQ", FORMAT_VERSION, len(header)), header, *chunks])
    blob = body + hashlib.sha256(body).digest()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_state_file(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Verify `path` and return (header, {leaf path: array})."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise StateFileError(f"cannot read state file {path}: {e}") from e
    fixed = len(MAGIC) + struct.calcsize("<IQ")
    if len(blob) < fixed + _DIGEST or not blob.startswith(MAGIC):
        raise StateFileError(f"{path} is not a jgraph state file (bad magic or too short)")
    version, hlen = struct.unpack_from("<IQ", blob, len(MAGIC))
    if version != FORMAT_VERSION:
        raise StateFileError(f"{path} has format version {version}; this jgraph reads version "
                             f"{FORMAT_VERSION}")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise StateFileError(f"{path} is truncated or altered: its SHA-256 checksum does not match")
    try:
        header = json.loads(body[fixed:fixed + hlen])
    except ValueError as e:
        raise StateFileError(f"{path}: unreadable header: {e}") from e
    payload = body[fixed + hlen:]
    arrays = {}
    for e in header["leaves"]:
        chunk = payload[e["offset"]:e["offset"] + e["nbytes"]]
        dtype = np.dtype(jax.numpy.dtype(e["dtype"]))
        if len(chunk) != e["nbytes"] or e["nbytes"] != dtype.itemsize * int(np.prod(e["shape"])):
            raise StateFileError(f"{path}: leaf {e['path']} has the wrong number of bytes")
        arrays[e["path"]] = np.frombuffer(chunk, dtype).reshape(e["shape"]).copy()
    return header, arrays


def load_state(path, template, dataset=None):
    """Read a state shaped like `template` (a pytree of arrays or ShapeDtypeStructs)."""
    header, arrays = read_state_file(path)
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    want = [jax.tree_util.keystr(p) for p, _ in flat] + (["dataset"] if dataset else [])
    if sorted(arrays) != sorted(want):
        raise StateFileError(f"{path} holds leaves {sorted(arrays)}, expected {sorted(want)}")
    leaves = []
    for p, like in flat:
        name, arr = jax.tree_util.keystr(p), arrays[jax.tree_util.keystr(p)]
        if arr.shape != tuple(np.shape(like)) or arr.dtype != np.dtype(like.dtype):
            raise StateFileError(f"{path}: leaf {name} is {arr.dtype}{list(arr.shape)}, expected "
                                 f"{np.dtype(like.dtype)}{list(np.shape(like))}")
        host = isinstance(like, np.ndarray | np.generic)
        leaves.append(arr[()] if host and arr.ndim == 0 else arr if host else jax.device_put(arr))
    if dataset is not None:
        perm = arrays["dataset"]
        if perm.shape != dataset.permutation.shape:
            raise StateFileError(f"{path}: dataset order has {perm.shape[0]} shards, the dataset "
                                 f"{dataset.permutation.shape[0]}")
        dataset.permutation = perm.astype(dataset.permutation.dtype)
    return jax.tree.unflatten(treedef, leaves)
