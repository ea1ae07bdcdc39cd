"""Checkpoints: save a Session's Variables to one safetensors file and restore them.

`Saver` follows TF1's `tf.train.Saver`: build it once over a list of Variables (all
of them by default), then `saver.save(sess, path)` and `saver.restore(sess, path)`.
(The module is `saver`, not `checkpoint`: `tf.checkpoint` is the gradient
checkpointing marker, and a submodule of that name would replace it on import.)

The file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file, the
format PyTorch, JAX and Hugging Face tools already read, written and read through the
`safetensors` package's numpy API: an 8-byte header length, a JSON header naming
every tensor with its dtype, shape and byte range, then the raw bytes. Tensor names
are the Variables' names; TinyFlow's own facts go in the header's ``__metadata__``
(string values only, as the format requires)::

    {"format": "tinyflow.checkpoint", "version": "2", "tinyflow_version": "0.1.0",
     "sha256": "...",   # of the tensors' names, dtypes, shapes and bytes (`_digest`)
     "step": "1200"}    # only with save(..., global_step=1200)

safetensors itself has no checksum, so a flipped bit in the data would load as a
wrong weight; the ``sha256`` entry lets the reader refuse such a file instead.

So ``safetensors.torch.load_file("model.safetensors")`` opens a TinyFlow checkpoint
in PyTorch, and a file written by PyTorch's ``save_file`` restores into a TinyFlow
model whose Variables have the same names, shapes and dtypes.

Checkpoints of version 1 (a numpy ``.npz`` zip with a JSON manifest, written by
TinyFlow 0.1 before safetensors) are still read, through a strict reader of their
own (`_read_npz`), until TinyFlow 0.3; re-save them to convert. The format is told
by the file's first bytes, not its name.

Three choices make checkpoints safe to hand around:

* no pickle, ever: safetensors holds only raw numbers, and the old ``.npz`` files
  are read member by member without ``allow_pickle``;
* atomic writes: the file goes to a temporary file beside the target and is moved
  over it with `os.replace`, so a crash (even SIGKILL) mid-save leaves the old
  checkpoint, never half of a new one; the temporary file of a writer that died is
  removed by the next save to the same path;
* checked restores: names, shapes and dtypes are compared with the file before any
  Variable is touched, and every failure (a corrupt or truncated file, a header
  that claims more bytes than the file has, a missing Variable, a shape mismatch)
  is a `CheckpointError` that names the file and the problem, never a library's
  exception.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tinyflow import api
from tinyflow.graph import Node, TinyFlowError
from tinyflow.registry import source_kind

FORMAT = "tinyflow.checkpoint"
VERSION = 2          # 2: safetensors; 1: .npz + JSON manifest (read until TinyFlow 0.3)
_NPZ_VERSION = 1
_MANIFEST_KEY = "__manifest__"
_ZIP_MAGIC = b"PK\x03\x04"
# The safetensors reference implementation refuses headers over 100 MB; so do we,
# before reading anything else.
_MAX_HEADER_BYTES = 100_000_000

__all__ = ["Saver", "CheckpointError", "read_checkpoint", "read_metadata"]


class CheckpointError(TinyFlowError, ValueError):
    """A checkpoint that cannot be written, read, or matched to the Variables."""


def _to_numpy(value: Any) -> np.ndarray:
    """A host (numpy) copy of a Session value; CuPy arrays are copied off the GPU."""
    return value.get() if hasattr(value, "get") and not isinstance(value, np.ndarray) \
        else np.asarray(value)


class Saver:
    """Save and restore Variables (TF1's tf.train.Saver).

    var_list: the Variables to save: a list (each saved under its node name), or a
    dict {name in the file: Variable}. None (the default) takes every Variable
    created so far, trainable or not (so an optimizer's slots, such as Adam's
    moments, are saved too and training can resume where it stopped). As in TF1,
    Variables created after the Saver are not included.
    """

    def __init__(self, var_list: Sequence[Node] | Mapping[str, Node] | None = None) -> None:
        if var_list is None:
            var_list = api.global_variables()
        if isinstance(var_list, Mapping):
            pairs = [(str(name), var) for name, var in var_list.items()]
        else:
            pairs = [(var.name, var) for var in var_list]
        seen: dict[str, Node] = {}
        for name, var in pairs:
            if not isinstance(var, Node) or source_kind(var) != "variable":
                raise CheckpointError(f"Saver: {name!r} is not a Variable ({var!r})")
            if name in seen:
                raise CheckpointError(
                    f"Saver: two Variables are both named {name!r} (created at "
                    f"{seen[name].where} and {var.where}); give them distinct names, or "
                    "pass var_list as a dict {name: variable}")
            seen[name] = var
        self.variables: dict[str, Node] = seen

    # -- save ------------------------------------------------------------------------
    def save(self, session: Any, path: str | os.PathLike,
             global_step: int | None = None) -> str:
        """Write the Variables' current values in `session` to `path`; return the path.

        The path is used as given (no suffix is added; ``.safetensors`` is the usual
        one). `global_step`, if given, is kept in the file's metadata (TF1 appends it
        to the file name instead; read it back with `read_metadata`). The write is
        atomic: a crash at any point leaves the previous file at `path` whole.
        """
        path = Path(path)
        if not str(path) or path.is_dir():
            raise CheckpointError(f"cannot save to {str(path)!r}: it is a directory; "
                                  "give a file name such as model.safetensors")
        tensors: dict[str, np.ndarray] = {}
        for name, var in self.variables.items():
            value = session.variables.get(var)
            if value is None:
                raise CheckpointError(
                    f"cannot save {path}: Variable {name!r} (created at {var.where}) has "
                    "no value in this session; run tf.global_variables_initializer() first")
            # np.array, not np.ascontiguousarray: the latter turns 0-d values into (1,).
            tensors[name] = np.array(_to_numpy(value), order="C", copy=True)
        metadata = _metadata(path, tensors, global_step)
        _write_atomically(path, tensors, metadata)
        return str(path)

    # -- restore ---------------------------------------------------------------------
    def restore(self, session: Any, path: str | os.PathLike) -> None:
        """Set the Variables in `session` from the checkpoint at `path`.

        Every Variable of this Saver must be in the file with the same dtype, and with
        the same shape as its value in the session (or its declared shape). Entries in
        the file that this Saver does not name are ignored (restore a model without
        its optimizer state, say). Nothing is changed unless everything matches.
        """
        values = read_checkpoint(path)
        problems = []
        for name, var in self.variables.items():
            if name not in values:
                problems.append(f"Variable {name!r} (created at {var.where}) is missing "
                                "from the file")
                continue
            saved = values[name]
            want_shape = _expected_shape(session, var)
            if want_shape is not None and tuple(saved.shape) != want_shape:
                problems.append(f"Variable {name!r}: the file has shape {tuple(saved.shape)}, "
                                f"the model expects {want_shape}")
            if var.dtype is not None and saved.dtype != var.dtype:
                problems.append(f"Variable {name!r}: the file has dtype {saved.dtype}, "
                                f"the model expects {var.dtype}")
        if problems:
            raise CheckpointError(f"cannot restore {path}: " + "; ".join(problems))

        for name, var in self.variables.items():
            _assign_host(session, var, values[name])


def _expected_shape(session: Any, var: Node) -> tuple | None:
    held = session.variables.get(var)
    if held is not None:
        return tuple(held.shape)
    if var.shape is not None and None not in var.shape:
        return tuple(var.shape)
    return None  # a deferred-shape Variable (tf.nn.linear) takes the file's shape


def _assign_host(session: Any, var: Node, value: np.ndarray) -> None:
    """Put `value` into the session's store for `var`, keeping its buffer if it has one.

    Compiled programs may hold on to a Variable's buffer across runs, so a value of
    the same shape is written into it rather than replacing it.
    """
    held = session.variables.get(var)
    if held is not None and tuple(held.shape) == value.shape:
        if isinstance(held, np.ndarray):
            held[...] = value
        else:  # a CuPy array: copy host -> device into the same memory
            held.set(value)
        return
    if getattr(session, "device", "cpu") == "cuda":
        from tinyflow.backend import cuda_array_module
        session.variables[var] = cuda_array_module().asarray(value)
    else:
        session.variables[var] = value.copy()


def _metadata(path: Path, tensors: dict[str, np.ndarray],
              global_step: int | None) -> dict[str, str]:
    """The header's ``__metadata__`` for `tensors`, after checking safetensors can hold
    them."""
    from tinyflow.version import VERSION as __version__
    metadata = {"format": FORMAT, "version": str(VERSION), "tinyflow_version": __version__,
                "sha256": _digest(tensors)}
    if global_step is not None:
        metadata["step"] = str(int(global_step))
    for name, array in tensors.items():
        if name == "__metadata__":
            raise CheckpointError(f"cannot save {path}: '__metadata__' is reserved by the "
                                  "safetensors format; rename that Variable")
        if array.dtype.hasobject or array.dtype.kind not in "biuf":
            raise CheckpointError(f"cannot save {path}: Variable {name!r} has dtype "
                                  f"{array.dtype}, which safetensors cannot hold")
    return metadata


def _digest(tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in name order.

    It does not depend on where safetensors puts each tensor in the file, so the
    reader can recompute it from the arrays it loaded.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{array.dtype.name}\0{array.shape}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8))  # the bytes, without a copy
    return digest.hexdigest()


def _write_atomically(path: Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str]) -> None:
    """Write the safetensors file to a temporary file beside `path`, flush it to disk,
    then rename it over `path`.

    The temporary name carries the writer's process id (``.NAME.PID.XXXX.tmp``), so
    the next save can tell the leftovers of a writer that was killed from those of a
    writer still running, and remove them.
    """
    import safetensors
    import safetensors.numpy

    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(directory, path.name)
        handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.",
                                            suffix=".tmp", dir=directory)
    except OSError as err:
        raise CheckpointError(f"cannot save {path}: {err.strerror or err}") from None
    try:
        os.close(handle)
        # The library writes the file itself (no copy of the whole file in memory).
        safetensors.numpy.save_file(tensors, tmp_name, metadata=metadata)
        # mkstemp made the file private (0600); give it the mode a plain open()
        # would have (0666 less the umask), as users expect of a saved model.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)
        with open(tmp_name, "rb+") as tmp:
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException as err:
        Path(tmp_name).unlink(missing_ok=True)
        if isinstance(err, (OSError, safetensors.SafetensorError)):
            reason = getattr(err, "strerror", None) or err
            raise CheckpointError(f"cannot save {path}: {reason}") from None
        raise


def _remove_stale_temporaries(directory: Path, name: str) -> None:
    """Delete `.NAME.PID.*.tmp` files in `directory` whose writer PID no longer runs."""
    for leftover in directory.glob(f".{name}.*.tmp"):
        pid_text = leftover.name[len(name) + 2:].split(".", 1)[0]
        if not pid_text.isdigit() or _process_alive(int(pid_text)):
            continue
        leftover.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's live process (or an absurd number: stale)
    return True


def _read_bytes(path: Path) -> bytes:
    try:
        if path.is_dir():
            raise CheckpointError(f"checkpoint {path} is a directory, not a file")
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror or err}"
                              ) from None


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load a checkpoint file into {name: array}, checking it is whole and well formed.

    Reads safetensors files (any, not only TinyFlow's) and TinyFlow's version-1
    ``.npz`` checkpoints. Raises CheckpointError for a missing file, a file that is
    not a checkpoint, a corrupt or truncated file, or one whose header disagrees with
    its data. Never unpickles anything.
    """
    path = Path(path)
    data = _read_bytes(path)
    if data[:4] == _ZIP_MAGIC:
        return _read_npz(path, data)
    return _read_safetensors(path, data)[0]


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors checkpoint ({} for a version-1 ``.npz``)."""
    path = Path(path)
    data = _read_bytes(path)
    return {} if data[:4] == _ZIP_MAGIC else _read_safetensors(path, data)[1]


def _read_safetensors(path: Path, data: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """Decode safetensors `data`; the library checks every offset against the bytes."""
    import safetensors.numpy

    if len(data) < 8:
        raise CheckpointError(f"{path} is not a checkpoint: {len(data)} bytes is too short "
                              "for a safetensors header (the file may be truncated)")
    header_size = int.from_bytes(data[:8], "little")
    if header_size > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise CheckpointError(f"{path} is not a readable checkpoint: its header claims "
                              f"{header_size} bytes, the file has {len(data) - 8} after the "
                              "length (truncated, or not a safetensors file)")
    try:
        tensors = safetensors.numpy.load(data)
        # The library has checked the header; it is a flat JSON object of small dicts.
        header = json.loads(data[8:8 + header_size])
    except KeyError as err:  # a safetensors dtype numpy lacks, such as BF16
        raise CheckpointError(f"{path}: a tensor has dtype {err}, which numpy (and so "
                              "TinyFlow) cannot hold; convert it to float32 first") from None
    except Exception as err:  # SafetensorError: a header or offsets that do not add up
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt, truncated, "
                              f"or another format): {err}") from None
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") == FORMAT and metadata.get("version") != str(VERSION):
        raise CheckpointError(f"{path}: TinyFlow checkpoint version "
                              f"{metadata.get('version')!r} is not supported (this "
                              f"TinyFlow reads {VERSION} and {_NPZ_VERSION})")
    if "sha256" in metadata and metadata["sha256"] != _digest(tensors):
        raise CheckpointError(f"{path} is damaged: its data does not match the checksum "
                              "saved with it (a changed or corrupted file)")
    return tensors, metadata


def _read_npz(path: Path, data: bytes) -> dict[str, np.ndarray]:
    """Read a version-1 checkpoint: an uncompressed zip of ``.npy`` members.

    np.savez (which wrote them) stores members uncompressed, so anything else is
    refused; each member's bytes must be exactly what its .npy header declares, so a
    crafted header cannot make us allocate more than the file holds.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = {}
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                    raise CheckpointError(f"{path}: member {info.filename!r} is compressed "
                                          "or larger than the file; not a TinyFlow .npz")
                entries[info.filename.removesuffix(".npy")] = _npy_array(
                    path, info.filename, archive.read(info))
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
            NotImplementedError, KeyError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable TinyFlow checkpoint (corrupt, "
                              f"truncated, or another format): {type(err).__name__}: {err}"
                              ) from None
    manifest = _npz_manifest(path, entries.pop(_MANIFEST_KEY, None))
    values: dict[str, np.ndarray] = {}
    for i, (name, shape, dtype) in enumerate(zip(*manifest)):
        array = entries.get(f"v{i}")
        if array is None:
            raise CheckpointError(f"{path}: the array for {name!r} is missing")
        if list(array.shape) != list(shape) or array.dtype.name != dtype:
            raise CheckpointError(f"{path}: the array for {name!r} is {array.dtype.name} "
                                  f"{tuple(array.shape)}, the manifest says {dtype} "
                                  f"{tuple(shape)}")
        values[name] = array
    return values


def _npy_array(path: Path, member: str, raw: bytes) -> np.ndarray:
    """One .npy member, checked: a plain dtype and exactly as many bytes as declared."""
    stream = io.BytesIO(raw)
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise ValueError(f"unknown .npy version {version}")
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read_header(stream)
    if dtype.hasobject or dtype.kind not in "biuf":
        raise CheckpointError(f"{path}: member {member!r} has dtype {dtype}; a checkpoint "
                              "holds numbers only (object arrays would need pickle)")
    body = raw[stream.tell():]
    count = 1
    for dim in shape:
        count *= int(dim)
    if count * dtype.itemsize != len(body):
        raise CheckpointError(f"{path}: member {member!r} declares shape {shape} "
                              f"({count * dtype.itemsize} bytes) but holds {len(body)}")
    array = np.frombuffer(body, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return array.copy()


def _npz_manifest(path: Path, raw: np.ndarray | None) -> tuple[list, list, list]:
    """(names, shapes, dtypes) from a version-1 manifest, every field type-checked."""
    if raw is None:
        raise CheckpointError(f"{path} has no {_MANIFEST_KEY} entry: not a TinyFlow "
                              "checkpoint")
    try:
        manifest = json.loads(raw.tobytes().decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path}: the manifest is not JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("version") != _NPZ_VERSION:
        raise CheckpointError(f"{path}: .npz checkpoint version {manifest.get('version')!r} "
                              f"is not supported (only {_NPZ_VERSION})")
    names, shapes, dtypes = (manifest.get(k) for k in ("names", "shapes", "dtypes"))
    well_formed = (
        isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)
        and len(names) == len(shapes) == len(dtypes)
        and all(isinstance(n, str) for n in names)
        and all(isinstance(d, str) for d in dtypes)
        and all(isinstance(s, list) and all(type(d) is int and d >= 0 for d in s)
                for s in shapes))
    if not well_formed:
        raise CheckpointError(f"{path}: the manifest is damaged (names, shapes and dtypes "
                              "must be lists of equal length of strings, lists of "
                              "non-negative integers, and strings)")
    return names, shapes, dtypes
