"""Checkpoints: save a Session's Variables to one `.npz` file and restore them.

`Saver` follows TF1's `tf.train.Saver`: build it once over a list of Variables (all
of them by default), then `saver.save(sess, path)` and `saver.restore(sess, path)`.
(The module is `saver`, not `checkpoint`: `tf.checkpoint` is the gradient
checkpointing marker, and a submodule of that name would replace it on import.)

The file is a plain numpy `.npz` archive (a zip of `.npy` arrays) plus one manifest
entry, a JSON document that names every array with its shape and dtype:

    __manifest__   uint8 bytes of {"format": "tinyflow.checkpoint", "version": 1,
                                   "names": [...], "shapes": [[...], ...],
                                   "dtypes": ["float32", ...]}
    v0, v1, ...    the values, in the manifest's order

Three choices make checkpoints safe to hand around:

* no pickle, ever: arrays are written and read with ``allow_pickle=False``, so
  loading a file from someone else cannot run code (an object array is refused);
* atomic writes: the archive goes to a temporary file beside the target and is
  moved over it with `os.replace`, so a crash mid-save leaves the old checkpoint,
  never half of a new one;
* checked restores: names, shapes and dtypes are compared with the manifest before
  any Variable is touched, and every failure (a corrupt or truncated file, a missing
  Variable, a shape mismatch) is a `CheckpointError` that says which file and which
  Variable, never a numpy traceback.
"""

from __future__ import annotations

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
VERSION = 1
_MANIFEST_KEY = "__manifest__"

__all__ = ["Saver", "CheckpointError", "read_checkpoint"]


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
    def save(self, session: Any, path: str | os.PathLike) -> str:
        """Write the Variables' current values in `session` to `path`; return the path.

        The path is used as given (no suffix is added). The write is atomic.
        """
        path = Path(path)
        names, arrays = [], []
        for name, var in self.variables.items():
            value = session.variables.get(var)
            if value is None:
                raise CheckpointError(
                    f"cannot save {path}: Variable {name!r} (created at {var.where}) has "
                    "no value in this session; run tf.global_variables_initializer() first")
            names.append(name)
            # np.array, not np.ascontiguousarray: the latter turns 0-d values into (1,).
            arrays.append(np.array(_to_numpy(value), order="C", copy=True))
        for name, array in zip(names, arrays):
            if array.dtype.hasobject:
                raise CheckpointError(f"cannot save Variable {name!r}: object arrays "
                                      "would need pickle")
        manifest = {"format": FORMAT, "version": VERSION, "names": names,
                    "shapes": [list(a.shape) for a in arrays],
                    "dtypes": [a.dtype.name for a in arrays]}
        entries = {f"v{i}": a for i, a in enumerate(arrays)}
        entries[_MANIFEST_KEY] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)

        directory = path.parent if str(path.parent) else Path(".")
        directory.mkdir(parents=True, exist_ok=True)
        handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                            dir=directory)
        try:
            # mkstemp makes the file private (0600); give it the mode a plain open()
            # would have (0666 less the umask), as users expect of a saved model.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_name, 0o666 & ~umask)
            with os.fdopen(handle, "wb") as tmp:
                np.savez(tmp, **entries)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
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


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load a checkpoint file into {name: array}, checking it is whole and well formed.

    Raises CheckpointError for a missing file, a file that is not a TinyFlow
    checkpoint, a corrupt or truncated archive, or arrays that disagree with the
    manifest. Never unpickles anything.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):  # .npz archives are zip files; a cut one is not
        raise CheckpointError(f"{path} is not a TinyFlow checkpoint (not an .npz archive; "
                              "the file may be truncated or of another format)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            # Read every member now: zip members are checked (CRC) as they are read,
            # so a damaged file fails here and not halfway through a restore.
            entries = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{path} is not a readable TinyFlow checkpoint (corrupt, "
                              f"truncated, or another format): {type(err).__name__}: {err}"
                              ) from None
    manifest_bytes = entries.pop(_MANIFEST_KEY, None)
    if manifest_bytes is None:
        raise CheckpointError(f"{path} has no {_MANIFEST_KEY} entry: not a TinyFlow "
                              "checkpoint")
    try:
        manifest = json.loads(manifest_bytes.tobytes().decode())
        names, shapes, dtypes = manifest["names"], manifest["shapes"], manifest["dtypes"]
        fmt, version = manifest["format"], manifest["version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: the manifest is damaged ({err})") from None
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: format {fmt!r} is not {FORMAT!r}")
    if version != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {version} is not supported "
                              f"(this TinyFlow reads version {VERSION})")
    if not (len(names) == len(shapes) == len(dtypes)):
        raise CheckpointError(f"{path}: the manifest's names, shapes and dtypes differ in "
                              "length")
    values: dict[str, np.ndarray] = {}
    for i, (name, shape, dtype) in enumerate(zip(names, shapes, dtypes)):
        array = entries.get(f"v{i}")
        if array is None:
            raise CheckpointError(f"{path}: the array for {name!r} is missing")
        if list(array.shape) != list(shape) or array.dtype.name != dtype:
            raise CheckpointError(f"{path}: the array for {name!r} is {array.dtype.name} "
                                  f"{tuple(array.shape)}, the manifest says {dtype} "
                                  f"{tuple(shape)}")
        values[name] = array
    return values
