"""Checkpoints: save a Session's Variables to one safetensors file and restore them.

`Saver` follows TF1's `tf.train.Saver`: build it once over a list of Variables (all
of them by default), then `saver.save(sess, path)` and `saver.restore(sess, path)`.
(The module is `saver`, not `checkpoint`: `tf.checkpoint` is the gradient
checkpointing marker, and a submodule of that name would replace it on import.)

The file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file, the
format PyTorch, JAX and Hugging Face tools already read: an 8-byte header length, a JSON
header naming every tensor with its dtype, shape and byte range, then the raw bytes.
The `safetensors` package writes it; TinyFlow reads it itself (`_read_safetensors`), so
that a restore can copy each tensor from the file straight into its Variable. Tensor
names are the Variables' names; TinyFlow's own facts go in the header's
``__metadata__`` (string values only, as the format requires)::

    {"format": "tinyflow.checkpoint", "version": "3", "tinyflow_version": "0.1.0",
     "step": "1200",     # only with save(..., global_step=1200)
     "crc32": "9f3a04c2"}  # of the metadata and the tensors (`_digest`)

safetensors itself has no checksum, so a flipped bit in the data would load as a
wrong weight; the ``crc32`` entry lets the reader refuse such a file instead. CRC-32
(zlib's) is there to catch accidents, a disk or a copy that damaged the file: it
detects every change confined to 32 consecutive bits (so every flipped byte), and
misses a random larger change once in 4 billion times. It is no defence against
someone who edits the file on purpose, but neither was the SHA-256 that version 2
used: a checksum stored in the file can be recomputed by whoever changes the file.
CRC-32 runs about 2.3 times as fast as SHA-256 (and 4 to 5 times as fast as BLAKE2b),
which matters when the checksum is most of the cost of a restore.

So ``safetensors.torch.load_file("model.safetensors")`` opens a TinyFlow checkpoint
in PyTorch, and a file written by PyTorch's ``save_file`` (which has no checksum, and
is read unchecked) restores into a TinyFlow model whose Variables have the same names,
shapes and dtypes.

Older checkpoints are still read: version 2 (the same file with a ``sha256`` of the
tensors instead of the ``crc32``), and version 1 (a numpy ``.npz`` zip with a JSON
manifest, written by TinyFlow 0.1 before safetensors; read through a strict reader of
its own, `_read_npz`, until TinyFlow 0.3; re-save them to convert). The format is
told by the file's first bytes, not its name.

Three choices make checkpoints safe to hand around:

* no pickle, ever: safetensors holds only raw numbers, and the old ``.npz`` files
  are read member by member without ``allow_pickle``;
* atomic writes: the file goes to a temporary file beside the target and is moved
  over it with `os.replace`, so a crash (even SIGKILL) mid-save leaves the old
  checkpoint, never half of a new one; the temporary file of a writer that died is
  removed by the next save to the same path;
* checked restores: the header, the checksum, and the names, shapes and dtypes the
  Variables expect are all checked before any Variable is touched, and every failure
  (a corrupt or truncated file, a header that claims more bytes than the file has, a
  missing Variable, a shape mismatch, a path that is not a regular file, such as a
  FIFO or /dev/zero, which would block or never end) is a `CheckpointError` that
  names the file and the problem, never a library's exception.

Values are written little-endian, as the format says, whatever their byte order in
the Session (a big-endian array is converted before its checksum is taken), and a
big-endian Variable restores from them: byte order is not a difference of dtype.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import math
import mmap
import operator
import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tinyflow import api, trace
from tinyflow.graph import Node, TinyFlowError
from tinyflow.registry import source_kind

FORMAT = "tinyflow.checkpoint"
VERSION = 3  # 3: safetensors + crc32; 2: safetensors + sha256; 1: .npz (until TinyFlow 0.3)
# The checksum each safetensors version carries in its metadata, under the name of its
# algorithm (version 1 files have none: a zip checks its members' CRCs itself).
_CHECKSUM_OF_VERSION = {"3": "crc32", "2": "sha256"}
_NPZ_VERSION = 1
_MANIFEST_KEY = "__manifest__"
_ZIP_MAGIC = b"PK\x03\x04"
# The safetensors reference implementation refuses headers over 100 MB; so do we,
# before reading anything else.
_MAX_HEADER_BYTES = 100_000_000
# safetensors' dtype names, and the numpy dtypes of their bytes. The format stores
# numbers little-endian, hence "<" (numpy's native order on x86 and ARM machines).
# BF16 and the float8 types have no numpy dtype, so TinyFlow cannot hold them.
_DTYPES = {"BOOL": np.dtype("?"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
           "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
           "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
           "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8")}

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
    dict {name in the file: Variable}; a single Variable is a list of one (TF1
    refuses it). None (the default) takes every Variable
    created so far, trainable or not (so an optimizer's slots, such as Adam's
    moments, are saved too and training can resume where it stopped). As in TF1,
    Variables created after the Saver are not included.
    """

    def __init__(self, var_list: Sequence[Node] | Mapping[str, Node] | Node | None = None
                 ) -> None:
        seen: dict[str, Node] = {}
        for name, var in _named_variables(var_list):
            if not isinstance(var, Node):  # a name or a number where a Variable goes
                raise CheckpointError(f"Saver: var_list holds {_brief(var)}, which is not "
                                      "a Variable (the graph node tf.Variable returns)")
            if source_kind(var) != "variable":
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
        path = _checked_path(path, "save to")
        if not str(path) or _is_dir(path):
            raise CheckpointError(f"cannot save to {str(path)!r}: it is a directory; "
                                  "give a file name such as model.safetensors")
        step = _step_text(path, global_step)
        tensors: dict[str, np.ndarray] = {}
        for name, var in self.variables.items():
            value = session.variables.get(var)
            if value is None:
                raise CheckpointError(
                    f"cannot save {path}: Variable {name!r} (created at {var.where}) has "
                    "no value in this session; run tf.global_variables_initializer() first")
            tensors[name] = _little_endian_copy(_to_numpy(value))
        metadata = _metadata(path, tensors, step)
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
        # Read-only views of the mapped file, already checked against its checksum:
        # the loop below copies each one once, straight into its Variable's buffer.
        values, _ = _load(_checked_path(path, "restore"))
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
            if var.dtype is not None and not _same_numbers(saved.dtype, var.dtype):
                problems.append(f"Variable {name!r}: the file has dtype {saved.dtype}, "
                                f"the model expects {var.dtype}")
        if problems:
            raise CheckpointError(f"cannot restore {path}: " + "; ".join(problems))

        for name, var in self.variables.items():
            _assign_host(session, var, values[name])


def _named_variables(var_list: Any) -> list[tuple[Any, Any]]:
    """(name in the file, Variable) pairs of a Saver's `var_list`, not yet checked.

    TF1 takes a list or a dict; a single Variable is taken as a list of one (TF1
    refuses it, but it cannot mean anything else). Anything else (a name, a number)
    is refused here, before `.name` or iteration could fail on it.
    """
    if var_list is None:
        var_list = api.global_variables()
    if isinstance(var_list, Node):
        var_list = [var_list]
    if isinstance(var_list, Mapping):
        return [(str(name), var) for name, var in var_list.items()]
    if isinstance(var_list, (str, bytes)) or not isinstance(var_list, Iterable):
        raise CheckpointError(f"Saver: var_list must be a list of Variables or a dict "
                              f"{{name: Variable}}, got {_brief(var_list)}")
    # A list item that is not a graph node has no .name (the caller refuses it).
    return [(getattr(var, "name", None), var) for var in var_list]


def _brief(value: Any) -> str:
    """repr(value), cut to 60 characters, for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_path(path: Any, action: str) -> Path:
    """`path` as a Path, refusing what no file system can hold (a NUL character),
    which Python would report as a bare ValueError from deep inside open()."""
    text = os.fspath(path)
    if ("\0" if isinstance(text, str) else b"\0") in text:
        raise CheckpointError(f"cannot {action} {text!r}: a file name cannot contain a "
                              "NUL character (\\0)")
    return Path(os.fsdecode(text))


def _is_dir(path: Path) -> bool:
    """Whether `path` is a folder; False when it cannot be looked at (a folder on
    the way that we may not enter): the write that follows then says why."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _step_text(path: Path, global_step: Any) -> str | None:
    """`global_step` as the metadata's decimal text; None when not given.

    Only whole numbers (int, numpy integers) are taken: int(1.7) would quietly store
    1, and int("abc") or int(nan) would fail with a bare ValueError.
    """
    if global_step is None:
        return None
    try:
        if isinstance(global_step, bool):
            raise TypeError  # True is an int to Python, but never a step
        return str(operator.index(global_step))
    except TypeError:
        raise CheckpointError(f"cannot save {path}: global_step must be a whole number, "
                              f"got {_brief(global_step)}") from None


def _little_endian_copy(value: np.ndarray) -> np.ndarray:
    """A C-ordered copy of `value` with little-endian bytes, as safetensors stores.

    A big-endian array (data read from a FITS file, say) would otherwise have its
    checksum computed on big-endian bytes while safetensors writes little-endian
    ones: a file that no restore accepts. (np.array, not np.ascontiguousarray: the
    latter turns 0-d values into (1,).)
    """
    return np.array(value, dtype=value.dtype.newbyteorder("<"), order="C", copy=True)


def _same_numbers(a: np.dtype, b: Any) -> bool:
    """Whether dtypes `a` and `b` hold the same numbers, whatever their byte order
    (">f4" and "<f4" are both float32: assigning one to the other converts)."""
    a, b = np.dtype(a), np.dtype(b)
    return a.newbyteorder("<") == b.newbyteorder("<")


def _expected_shape(session: Any, var: Node) -> tuple | None:
    held = session.variables.get(var)
    if held is not None:
        return tuple(held.shape)
    if var.shape is not None and None not in var.shape:
        return tuple(var.shape)
    return None  # a deferred-shape Variable (tf.nn.linear) takes the file's shape


def _assign_host(session: Any, var: Node, value: np.ndarray) -> None:
    """Copy `value` into the session's store for `var`, keeping its buffer if it has one.

    Compiled programs may hold on to a Variable's buffer across runs, so a value of
    the same shape is written into it rather than replacing it. `value` may be a
    read-only view of the checkpoint file, so it is always copied, never kept.
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
    else:  # a copy in the Variable's own dtype: its byte order may be ">" (the file's is "<")
        session.variables[var] = value.astype(var.dtype or value.dtype)


def _metadata(path: Path, tensors: dict[str, np.ndarray],
              step: str | None) -> dict[str, str]:
    """The header's ``__metadata__`` for `tensors`, after checking safetensors can hold
    them."""
    from tinyflow.version import VERSION as __version__
    metadata = {"format": FORMAT, "version": str(VERSION), "tinyflow_version": __version__}
    if step is not None:
        metadata["step"] = step
    for name, array in tensors.items():
        if name == "__metadata__":
            raise CheckpointError(f"cannot save {path}: '__metadata__' is reserved by the "
                                  "safetensors format; rename that Variable")
        if not _is_utf8(name):  # the header is JSON text in UTF-8
            raise CheckpointError(f"cannot save {path}: Variable name {name!r} cannot be "
                                  "written as UTF-8 (it holds a lone surrogate); rename it")
        if array.dtype.hasobject or array.dtype.kind not in "biuf":
            raise CheckpointError(f"cannot save {path}: Variable {name!r} has dtype "
                                  f"{array.dtype}, which safetensors cannot hold")
    metadata["crc32"] = _digest("crc32", tensors, metadata)  # last: it covers the rest
    return metadata


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Crc32:
    """zlib.crc32 behind hashlib's update()/hexdigest(), so one loop computes either."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)  # carries on from the bytes so far

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_CHECKSUMS = {"crc32": _Crc32, "sha256": hashlib.sha256}


def _digest(algorithm: str, tensors: Mapping[str, np.ndarray],
            metadata: Mapping[str, str]) -> str:
    """The checksum `algorithm` ("crc32" or "sha256") of a checkpoint, as hex text.

    It runs over every tensor's name, dtype, shape and bytes, in name order, so it
    does not depend on where safetensors put each tensor in the file; the bytes are
    fed straight from the arrays (views of the mapped file, when reading), never
    copied. Version 3's crc32 covers the metadata first (every entry but itself), so
    a flipped digit in "step" is caught too; version 2's sha256 did not, and is
    computed here exactly as version 2 wrote it.
    """
    digest = _CHECKSUMS[algorithm]()
    if algorithm == "crc32":
        for key in sorted(metadata):
            if key != algorithm:
                digest.update(f"{key}\0{metadata[key]}\0".encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])  # no copy: they are contiguous
        # Version 2 took the shape after np.ascontiguousarray, which makes a 0-d array
        # 1-d: its scalars went in as (1,). Version 3 uses the true shape, ().
        shape = tensors[name].shape if algorithm == "crc32" else array.shape
        digest.update(f"{name}\0{array.dtype.name}\0{shape}\0".encode())
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
    stem = _temporary_stem(path.name)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(directory, stem)
        handle, tmp_name = tempfile.mkstemp(prefix=f".{stem}.{os.getpid()}.",
                                            suffix=".tmp", dir=directory)
    except (FileExistsError, NotADirectoryError):  # mkdir met a file on the way
        raise CheckpointError(f"cannot save {path}: {directory} (or a folder above it) is "
                              "a file, not a folder") from None
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


# File names are limited to 255 bytes (NAME_MAX); the temporary name adds about 25
# (dot, pid, mkstemp's letters, ".tmp") to the target's, so a legal long target name
# would make an illegal temporary one. Names longer than this are shortened.
_MAX_STEM_BYTES = 120


def _temporary_stem(name: str) -> str:
    """The part of a temporary file's name that stands for the target `name`: the
    name itself, or for a long one its start and a checksum of the whole (so two long
    names that start alike still get their own temporaries)."""
    encoded = os.fsencode(name)
    if len(encoded) <= _MAX_STEM_BYTES:
        return name
    # 40 characters are at most 160 bytes, even if every one takes four.
    return f"{name[:40]}~{zlib.crc32(encoded):08x}"


def _remove_stale_temporaries(directory: Path, stem: str) -> None:
    """Delete `.STEM.PID.*.tmp` files in `directory` whose writer PID no longer runs."""
    # glob.escape: a name such as "model[1]" must match itself, not "model1".
    for leftover in directory.glob(f".{glob.escape(stem)}.*.tmp"):
        pid_text = leftover.name[len(stem) + 2:].split(".", 1)[0]
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


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load a checkpoint file into {name: array}, checking it is whole and well formed.

    Reads safetensors files (any, not only TinyFlow's) and TinyFlow's version-1
    ``.npz`` checkpoints. Raises CheckpointError for a missing file, a file that is
    not a checkpoint, a corrupt or truncated file, or one whose header disagrees with
    its data. Never unpickles anything.
    """
    tensors, _ = _load(Path(path))
    # Copies, writable and owning their memory (the views are of the mapped file).
    return {name: array.copy() for name, array in tensors.items()}


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors checkpoint ({} for a version-1 ``.npz``).

    The whole file is checked as by `read_checkpoint`: the checksum covers the metadata.
    """
    return _load(Path(path))[1]


def _load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of the checkpoint at `path`, checked and read-only, and its metadata.

    The file is mapped into memory (mmap), not read into a buffer: the tensors are
    views of the file's own pages, so computing the checksum copies nothing, and a
    restore copies each tensor once, from the file into its Variable's buffer. That
    copy comes only after the whole file has been checked. (Reading the file with
    readinto() straight into the Variables' buffers, checksumming as it goes, costs
    the same, but tells of a damaged file only once the Variables hold its data.)
    """
    data = _map(path)
    if data[:4] == _ZIP_MAGIC:
        return _read_npz(path, data[:]), {}  # the old format: the bytes, as it needs
    return _read_safetensors(path, data)


def _map(path: Path) -> mmap.mmap | bytes:
    """The file at `path`, mapped read-only into memory (or read, if it cannot be).

    The mapping is not closed here: it stays while any view of it is alive and goes
    with the last one. It is safe because TinyFlow never rewrites a checkpoint in
    place (`os.replace` puts a new file at the path; the mapped one stays as it was);
    a tool that truncated a file in place while it was mapped would crash the reader
    (SIGBUS), as it would numpy's or safetensors' own memory-mapped readers.
    """
    try:
        with trace.open_regular(path, CheckpointError, "a checkpoint") as f:
            try:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # an empty file, or one mmap cannot map
                return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror or err}"
                              ) from None


def _unreadable(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable checkpoint (corrupt, truncated, or "
                           f"another format): {problem}")


def _read_safetensors(path: Path, data: mmap.mmap | bytes
                      ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of safetensors `data`, as read-only views of it, and its metadata.

    Every check comes before the views are made, and the checksum right after.
    """
    if len(data) < 8:
        raise CheckpointError(f"{path} is not a checkpoint: {len(data)} bytes is too short "
                              "for a safetensors header (the file may be truncated)")
    header_size = int.from_bytes(data[:8], "little")
    if header_size > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise CheckpointError(f"{path} is not a readable checkpoint: its header claims "
                              f"{header_size} bytes, the file has {len(data) - 8} after the "
                              "length (truncated, or not a safetensors file)")
    body = np.frombuffer(data, np.uint8, offset=8 + header_size)  # all that follows
    entries, metadata = _parse_header(path, data[8:8 + header_size], len(body))
    tensors = {name: body[e.begin:e.end].view(e.dtype).reshape(e.shape)
               for name, e in entries.items()}
    _check_checksum(path, tensors, metadata)
    return tensors, metadata


class _Entry(NamedTuple):
    """One tensor of a safetensors header: its bytes are body[begin:end]."""
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_header(path: Path, text: bytes, body_size: int
                  ) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Decode and check a safetensors header: ({name: _Entry}, metadata).

    The rules are the safetensors reader's: metadata is strings only; each tensor
    has a dtype numpy has, a shape of non-negative integers, and a byte range exactly
    as long as dtype and shape need (a header claiming 1e11 elements over 24 bytes is
    refused, not allocated); and the ranges tile the data that follows the header,
    with no gap, overlap or byte left over, so that the checksum covers every byte.
    """
    try:
        # Decoded as UTF-8 first: json.loads would guess UTF-16 or 32 from raw bytes.
        header = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise _unreadable(path, f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _unreadable(path, "its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:  # absent (or null, which the format allows too)
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str)
                                                 for v in metadata.values()):
        raise _unreadable(path, "its __metadata__ is not an object of strings")
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    covered = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != covered:
            raise _unreadable(path, f"its tensors' byte ranges leave a gap or overlap at "
                                    f"byte {covered} of the data")
        covered = entry.end
    if covered != body_size:
        raise _unreadable(path, f"its tensors take {covered} bytes, the file holds "
                                f"{body_size} after the header")
    return entries, metadata


def _entry(path: Path, name: str, info: Any) -> _Entry:
    """The header's entry for tensor `name`, checked (see `_parse_header`)."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _unreadable(path, f"its entry {name!r} is not a tensor (an object with "
                                "dtype, shape and data_offsets)")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise CheckpointError(f"{path}: a tensor has dtype {dtype!r}, which numpy (and so "
                              f"TinyFlow) cannot hold (tensor {name!r}; TinyFlow reads "
                              f"{', '.join(_DTYPES)}); convert it to float32 first")
    if not (_counts(shape) and _counts(offsets) and len(offsets) == 2):
        raise _unreadable(path, f"tensor {name!r} has shape {shape!r} and data_offsets "
                                f"{offsets!r}; both must be lists of non-negative integers")
    begin, end = offsets
    # Python integers: no overflow, and nothing is allocated from what the file claims.
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise _unreadable(path, f"tensor {name!r} of shape {tuple(shape)} needs {nbytes} "
                                f"bytes, its data_offsets {offsets} give {end - begin}")
    return _Entry(_DTYPES[dtype], tuple(shape), begin, end)


def _counts(value: Any) -> bool:
    """Whether `value` is a list of non-negative integers (JSON's true is not one)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _check_checksum(path: Path, tensors: Mapping[str, np.ndarray],
                    metadata: Mapping[str, str]) -> None:
    """Refuse a file whose contents do not match the checksum saved with them.

    A TinyFlow file must carry the checksum its version names. Any checksum present
    is checked whatever "format" says, so a flipped bit there cannot switch the check
    off. Files of other writers (PyTorch's save_file) have none and are not checked.
    """
    if metadata.get("format") == FORMAT:
        version = metadata.get("version")
        if version not in _CHECKSUM_OF_VERSION:
            raise CheckpointError(f"{path}: TinyFlow checkpoint version {version!r} is not "
                                  f"supported (this TinyFlow reads {VERSION} and older, "
                                  f"down to {_NPZ_VERSION})")
        if _CHECKSUM_OF_VERSION[version] not in metadata:
            raise CheckpointError(f"{path} is damaged: a version {version} checkpoint "
                                  f"carries a {_CHECKSUM_OF_VERSION[version]} checksum, "
                                  "this one has none")
    for algorithm in _CHECKSUMS:
        if algorithm in metadata and metadata[algorithm] != _digest(algorithm, tensors,
                                                                    metadata):
            raise CheckpointError(f"{path} is damaged: its contents do not match the "
                                  f"{algorithm} checksum saved with them (a changed or "
                                  "corrupted file)")


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
                key = info.filename.removesuffix(".npy")
                if key in entries:  # a zip may list a name twice; which one is meant?
                    raise CheckpointError(f"{path}: member {info.filename!r} appears twice; "
                                          "not a checkpoint TinyFlow wrote (damaged or "
                                          "edited)")
                entries[key] = _npy_array(path, info.filename, archive.read(info))
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
    """One .npy member, checked: a plain dtype and exactly as many bytes as declared.

    The array is a read-only view of `raw`, like the safetensors tensors; its users copy.
    A big-endian member (np.savez keeps the byte order it was given) is converted to
    little-endian, the order of every other checkpoint, so that it matches float32.
    """
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
    return array.astype(dtype.newbyteorder("<"), copy=False)


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
