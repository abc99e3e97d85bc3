"""Saving and restoring a training state: atomic, versioned, checksummed, validated both ways.

File layout (all integers little-endian):

    magic    b"JGRAPH-STATE\\n"                    (13 bytes)
    version  u32                                   (FORMAT_VERSION; READ_VERSIONS are read)
    hlen     u64, then `hlen` bytes of JSON header (at most MAX_HEADER_BYTES):
             {"leaves": [{path, shape, dtype, offset, nbytes[, key_impl]}, ...],
              "meta": {jgraph's settings that a reader must match}, "extra": user JSON}
    payload  the leaves' raw bytes (C order), back to back in header order
    sha256   32 bytes over everything before it

Writing goes to `.<name>.<pid>-<random>.tmp` in the target's folder, is flushed and fsync'ed, then
renamed over the target (atomic on POSIX): a crash leaves the old file or the new one. The
temporary is removed on every error path, and each save first removes the temporaries of its own
target left by saves whose process is gone (killed). What is written is validated first: a state
that `load` would refuse is never written.

Reading trusts nothing: a bounded header, a schema with bounded sizes, dtypes from an allow-list
(never pickle: no code runs from a file), shape and byte count agreeing with the payload before
anything is allocated, boolean bytes 0 or 1, typed PRNG keys rebuilt only for JAX's own key
implementations; then every leaf's path, shape and dtype against the expected state, the settings
in `meta`, and a dataset order that must be a permutation. Any mismatch raises `StateFileError`
naming the field, before the caller's state or dataset is touched.

Versions: 3 (written now) records in `meta.fingerprint` what produced the state (the model, the
optimizer, the batch: `jgraph.training.fingerprint`); 2 has the same layout without it and is
still read (`Optimizer.load` warns that it cannot check where such a state came from).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jgraph.errors import JGraphError
from jgraph.training.arguments import ArgumentError
from jgraph.training.dataset import Dataset

MAGIC = b"JGRAPH-STATE\n"
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)  # 2: no fingerprint in `meta` (same layout)
MAX_HEADER_BYTES = 64 * 2**20
MAX_RANK = 64
MAX_PATH_CHARS = 4096
_FIXED = struct.Struct("<IQ")
_DIGEST = 32
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                    "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
                    "complex128", "float8_e4m3fn", "float8_e5m2"})
KEY_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})
LEAF_FIELDS = {"path": str, "shape": list, "dtype": str, "offset": int, "nbytes": int}


class StateFileError(JGraphError):
    """A state file is missing, truncated, altered, of another version or of another state."""


class StateWriteError(StateFileError, OSError):
    """A state file could not be written (the folder, permissions, a full disk); the cause is
    chained, and the previous file at the path, if any, is intact."""


class StateFileWarning(UserWarning):
    """A state file was read without a check it could not carry (an old version's file)."""


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# -- writing ----------------------------------------------------------------------------------
def _leaf_bytes(name: str, leaf):
    """`(entry, raw bytes array)` of one leaf; `ArgumentError` if it cannot be saved."""
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ArgumentError(f"cannot save {name}: its buffer was donated to a later step and "
                            f"deleted; save the Optimizer's `latest_state` instead")
    entry = {}
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and _is_key(dtype):
        entry["key_impl"] = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
    try:
        arr = np.asarray(leaf, order="C")
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"cannot save {name}: not an array ({e})") from e
    if arr.dtype.name not in DTYPES:
        raise ArgumentError(f"cannot save {name}: dtype {arr.dtype} is not one of "
                            f"{sorted(DTYPES)}")
    entry.update(path=name, shape=list(arr.shape), dtype=arr.dtype.name, nbytes=arr.nbytes)
    return entry, arr.reshape(-1).view(np.uint8)


def _own_temporaries(path: Path):
    """`(file, pid)` of each temporary that a save of `path` left in its folder."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)-[0-9a-f]{{8}}\.tmp")
    with contextlib.suppress(OSError):
        for name in os.listdir(path.parent):
            match = pattern.fullmatch(name)
            if match:
                yield path.parent / name, int(match.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temporaries(path) -> int:
    """Remove temporaries of `path` whose saving process is gone; return how many."""
    removed = 0
    for tmp, pid in _own_temporaries(Path(path)):
        if pid != os.getpid() and not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
                removed += 1
    return removed


def as_path(path, what: str) -> Path:
    """`path` as a `Path`; `ArgumentError` unless it is a str or an os.PathLike."""
    if not isinstance(path, str | os.PathLike):
        raise ArgumentError(f"{what}: path must be a str or an os.PathLike, got "
                            f"{type(path).__name__}")
    return Path(path)


def is_folder(path: Path, what: str) -> bool:
    """`path.is_dir()`, or `ArgumentError` where the file system refuses to look (a name too
    long, a path through a file it cannot search)."""
    try:
        return path.is_dir()
    except OSError as e:
        raise ArgumentError(f"{what} {str(path)!r} cannot be used: {e.strerror or e}") from e


def dataset_order(dataset, what: str):
    """The shard order of `dataset` (a `jg.Dataset`), or None."""
    if dataset is not None and not isinstance(dataset, Dataset):
        raise ArgumentError(f"{what}: dataset must be a jg.Dataset, got {type(dataset).__name__}")
    return None if dataset is None else dataset.permutation


def _temporary(path: Path) -> Path:
    """A fresh temporary next to `path`, named so that `remove_stale_temporaries` knows it."""
    return path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def check_writable(path, what: str) -> Path:
    """`ArgumentError` unless `save_state(path, ...)` could write there now: its folder exists
    or can be made, and a file can be created in it (a real probe: permissions, read-only file
    systems and a path under a regular file all fail here, not after hours of training)."""
    path = Path(path)
    if is_folder(path, what):
        raise ArgumentError(f"{what} {str(path)!r} is a folder, not a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArgumentError(f"{what} {str(path)!r} cannot be written: its folder "
                            f"{str(path.parent)!r} cannot be made ({e.strerror or e})") from e
    probe = _temporary(path)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as e:
        raise ArgumentError(f"{what} {str(path)!r} cannot be written: no file can be created "
                            f"in {str(path.parent)!r} ({e.strerror or e})") from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return path


def save_state(path, state, dataset=None, extra=None, meta=None) -> None:
    """Write `state` (and `dataset.permutation`) to `path` atomically. What cannot be saved is an
    `ArgumentError`; a failed write is a `StateWriteError` (an `OSError` too)."""
    path = as_path(path, "save")
    if path.is_dir():
        raise ArgumentError(f"save: {str(path)!r} is a folder, not a file path")
    order = dataset_order(dataset, "save")
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    named = [(jax.tree_util.keystr(p), leaf) for p, leaf in flat]
    if order is not None:
        named.append(("dataset", order))
    entries, chunks, offset = [], [], 0
    for name, leaf in named:
        entry, raw = _leaf_bytes(name, leaf)
        entries.append({**entry, "offset": offset})
        chunks.append(raw)
        offset += entry["nbytes"]
    try:
        header = json.dumps({"leaves": entries, "meta": meta or {}, "extra": extra},
                            sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"save: `extra` must be JSON-serialisable: {e}") from e
    check_header(parse_header(header, path), offset, path)  # never write what load refuses
    try:
        _write(path, header, chunks)
    except OSError as e:
        raise StateWriteError(f"cannot write state file {str(path)!r}: {e}") from e


def _write(path: Path, header: bytes, chunks) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = _temporary(path)
    replaced = False
    try:  # an interrupt anywhere in here leaves no temporary: the cleanup tolerates every state
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            for part in (MAGIC, _FIXED.pack(FORMAT_VERSION, len(header)), header, *chunks):
                digest.update(part)
                f.write(part)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        replaced = True
    finally:
        if not replaced:
            with contextlib.suppress(OSError):  # absent if open failed or replace succeeded
                os.unlink(tmp)
    with contextlib.suppress(OSError):  # make the rename durable (not possible everywhere)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# -- reading ----------------------------------------------------------------------------------
def parse_header(raw: bytes, path) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise StateFileError(f"{path}: unreadable header: {type(e).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("leaves"), list):
        raise StateFileError(f"{path}: header must be an object with a list `leaves`")
    unknown = set(header) - {"leaves", "meta", "extra"}
    if unknown:
        raise StateFileError(f"{path}: header has unknown fields {sorted(unknown)}")
    if not isinstance(header.get("meta", {}), dict):
        raise StateFileError(f"{path}: header field `meta` must be an object")
    return header


def _leaf_field(entry: dict, key: str, index: int, path):
    value = entry.get(key)
    kind = LEAF_FIELDS[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise StateFileError(f"{path}: field leaves[{index}].{key} must be a {kind.__name__}, "
                             f"got {value!r:.80}")
    return value


def check_header(header: dict, payload_bytes: int, path) -> None:
    """Validate the leaf table against the payload size (pure arithmetic: nothing allocated)."""
    offset, seen = 0, set()
    for i, e in enumerate(header["leaves"]):
        if not isinstance(e, dict):
            raise StateFileError(f"{path}: field leaves[{i}] must be an object")
        unknown = set(e) - set(LEAF_FIELDS) - {"key_impl"}
        if unknown:
            raise StateFileError(f"{path}: field leaves[{i}] has unknown keys {sorted(unknown)}")
        name = _leaf_field(e, "path", i, path)
        if len(name) > MAX_PATH_CHARS or name in seen:
            raise StateFileError(f"{path}: field leaves[{i}].path is too long or repeated")
        seen.add(name)
        shape = _leaf_field(e, "shape", i, path)
        if len(shape) > MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool)
                                            and 0 <= d for d in shape):
            raise StateFileError(f"{path}: field leaves[{i}].shape ({name}) must be at most "
                                 f"{MAX_RANK} non-negative ints, got {shape!r:.80}")
        dtype = _leaf_field(e, "dtype", i, path)
        if dtype not in DTYPES:
            raise StateFileError(f"{path}: field leaves[{i}].dtype ({name}) is {dtype!r:.40}, "
                                 f"not one of {sorted(DTYPES)}")
        if "key_impl" in e and (e["key_impl"] not in KEY_IMPLS or dtype != "uint32"):
            raise StateFileError(f"{path}: field leaves[{i}].key_impl ({name}) must be one of "
                                 f"{sorted(KEY_IMPLS)} over uint32 data")
        if _leaf_field(e, "offset", i, path) != offset:
            raise StateFileError(f"{path}: field leaves[{i}].offset ({name}) is {e['offset']}, "
                                 f"expected {offset} (leaves are stored back to back)")
        nbytes = _leaf_field(e, "nbytes", i, path)
        if nbytes != math.prod(shape) * jnp.dtype(dtype).itemsize:
            raise StateFileError(f"{path}: field leaves[{i}].nbytes ({name}) is {nbytes}, but "
                                 f"{dtype}{shape} takes "
                                 f"{math.prod(shape) * jnp.dtype(dtype).itemsize}")
        offset += nbytes
        if offset > payload_bytes:
            raise StateFileError(f"{path}: leaf {name} ends at byte {offset}, beyond the "
                                 f"{payload_bytes}-byte payload")
    if offset != payload_bytes:
        raise StateFileError(f"{path}: the leaves take {offset} bytes, the payload has "
                             f"{payload_bytes}")


def read_state_file(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Verify `path` and return (header, {leaf path: array}); typed keys come back as keys. The
    header also holds the file's format version as `header["version"]`."""
    path = as_path(path, "load")
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise StateFileError(f"cannot read state file {path}: {e}") from e
    fixed = len(MAGIC) + _FIXED.size
    if len(blob) < fixed + _DIGEST or not blob.startswith(MAGIC):
        raise StateFileError(f"{path} is not a jgraph state file (bad magic or too short)")
    version, hlen = _FIXED.unpack_from(blob, len(MAGIC))
    if version not in READ_VERSIONS:
        raise StateFileError(f"{path} has format version {version}; this jgraph reads versions "
                             f"{list(READ_VERSIONS)}")
    if hashlib.sha256(memoryview(blob)[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise StateFileError(f"{path} is truncated or altered: its SHA-256 checksum does not match")
    if hlen > min(MAX_HEADER_BYTES, len(blob) - fixed - _DIGEST):
        raise StateFileError(f"{path}: field hlen is {hlen}, beyond the file or the "
                             f"{MAX_HEADER_BYTES}-byte limit")
    header = parse_header(blob[fixed:fixed + hlen], path)
    payload = memoryview(blob)[fixed + hlen:len(blob) - _DIGEST]
    check_header(header, len(payload), path)
    arrays = {}
    for e in header["leaves"]:
        arr = np.frombuffer(payload, jnp.dtype(e["dtype"]), math.prod(e["shape"]),
                            e["offset"]).reshape(e["shape"])
        if arr.dtype == np.bool_ and np.any(arr.view(np.uint8) > 1):
            raise StateFileError(f"{path}: leaf {e['path']} holds bytes other than 0 and 1 as "
                                 f"booleans")
        if "key_impl" in e:
            try:
                arr = jax.random.wrap_key_data(arr, impl=e["key_impl"])
            except (TypeError, ValueError) as err:
                raise StateFileError(f"{path}: leaf {e['path']} is no {e['key_impl']} key "
                                     f"data: {err}") from None
        arrays[e["path"]] = arr
    return {**header, "version": version}, arrays


def check_meta(header: dict, meta: dict, path) -> None:
    """Every setting in `meta` must equal the file's (a period-8 state is not a period-4 one)."""
    found = header.get("meta", {})
    for key, want in meta.items():
        if key not in found:
            raise StateFileError(f"{path}: field meta.{key} is missing (expected {want!r})")
        if found[key] != want:
            raise StateFileError(f"{path}: field meta.{key} is {found[key]!r:.80}, this "
                                 f"Optimizer has {want!r}")


def _describe(a) -> str:
    return f"{a.dtype}{list(np.shape(a))}"


def read_state(path, template, nshards: int | None = None, meta=None, on_host: bool = False,
               check=None):
    """`(state, permutation or None, header)`: a state shaped like `template` (a pytree of arrays
    or ShapeDtypeStructs; NumPy leaves stay on the host), read and checked; nothing is mutated.
    With `nshards`, the file must hold a dataset order of that many shards; without, a stored
    order is ignored. With `on_host`, every leaf stays on the host (the caller places them).
    `check(header)` runs after `meta` is checked, before the leaves are (a fingerprint)."""
    header, arrays = read_state_file(path)
    check_meta(header, meta or {}, path)
    if check is not None:
        check(header)
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    want = [jax.tree_util.keystr(p) for p, _ in flat] + (["dataset"] if nshards is not None
                                                          else [])
    found = set(arrays) - ({"dataset"} if nshards is None else set())  # an order not asked for
    missing, unexpected = sorted(set(want) - found), sorted(found - set(want))
    if missing == ["dataset"] and not unexpected:
        raise StateFileError(f"{path} holds no dataset order (it was saved without `dataset=`)")
    if missing or unexpected:
        raise StateFileError(f"{path} is the state of another model or optimizer: it lacks "
                             f"leaves {missing} and has unexpected leaves {unexpected}")
    leaves = []
    for p, like in flat:
        name = jax.tree_util.keystr(p)
        arr = arrays[name]
        if arr.shape != tuple(np.shape(like)) or arr.dtype != like.dtype:
            raise StateFileError(f"{path}: leaf {name} is {_describe(arr)}, expected "
                                 f"{_describe(like)}")
        if on_host or isinstance(like, np.ndarray | np.generic):  # a host leaf (the counter)
            leaves.append(arr.copy()[()] if arr.ndim == 0 else arr.copy())
        else:
            leaves.append(jax.device_put(arr))
    permutation = None
    if nshards is not None:
        permutation = arrays["dataset"]
        if (permutation.shape != (nshards,) or permutation.dtype.kind not in "iu"
                or not np.array_equal(np.sort(permutation), np.arange(nshards))):
            raise StateFileError(f"{path}: field dataset must be a permutation of the "
                                 f"{nshards} shards, got {_describe(permutation)}")
        permutation = permutation.astype(np.int64)
    return jax.tree.unflatten(treedef, leaves), permutation, header
