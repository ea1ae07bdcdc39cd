"""The DebugRecord: one versioned JSON file that says what the system did and why.

tinyflow writes it (`tinyflow/debug.py` assembles it from a compiled Program and its
runs); the terminal debugger (`viz/`) and the exporters only read it. It is the
contract between the two halves, so the schema is written down here, checked by
`validate`, and tested. The file is plain JSON (gzip when the name ends in ``.gz``),
never pickle: a record is something users send each other and open.

Schema, version 1 (``FORMAT = "tinyflow.debugrecord"``)::

    {
     "format": "tinyflow.debugrecord", "version": 1,
     "meta": {"title": str, "created": str (ISO time), "device": "cpu" | "cuda",
              "tinyflow_version": str, "command": str},
     "graphs": [   # one per pass, in order; graphs[0] is the input (after shapes)
       {"pass": str, "index": int, "seconds": float, "changed": bool,
        "nodes": [{"id": str (node name, unique in the graph), "op": str,
                   "inputs": [id], "shape": [int] | null, "dtype": str | null,
                   "bytes": int, "where": str ("file:line"),
                   "attrs": {str: json value}, "provenance": [str],
                   "phase": "forward" | "backward"}],
        "outputs": [id]}],
     "rewrites": [{"pass": str, "removed": [id], "added": [id], "reason": str}],
     "streams": [{"id": int, "name": str}],      # "compute0", "compute1", "comm"
     "schedule": [{"step": int, "node": id, "op": str, "stream": int,
                   "waits": [{"event": int, "stream": int, "step": int}],
                   "records_event": int | null}],
     "memory_plan": null | {"strategy": str, "arena_bytes": int, "naive_bytes": int,
                   "lower_bound_bytes": int, "alignment": int,
                   "strategies": {name: arena_bytes},
                   "tensors": [{"node": id, "offset": int | null, "nbytes": int,
                                "first_step": int, "last_step": int,
                                "inplace_of": id | null,
                                "kind": "intermediate" | "feed" | "variable" |
                                        "constant" | "output",
                                "reason": str}]},
     "timelines": [{"run": int, "label": str,
                    "events": [{"step": int | null, "node": id, "op": str,
                                "stream": int, "start": float, "end": float,
                                "bytes": int,
                                "summary": null | {"min": float, "max": float,
                                                   "mean": float, "nan": int, "inf": int},
                                "args": {...}}]}],     # args optional
     "scalars": {name: [[step, value], ...]},
     "check": null | {"node": id, "where": str, "message": str}
    }

Meaning of the cross references, which `validate` checks:

* a node's ``inputs`` and a graph's ``outputs`` name nodes of the same graph;
* ``schedule``, ``memory_plan.tensors`` and ``check`` name nodes of the *last* graph
  (the program that ran); ``waits[].step`` names a schedule step, and every stream
  number names an entry of ``streams``;
* ``timelines[].events[].step`` is a schedule step or null (an event that is not a
  step of the program, such as one chunk of a ring allreduce); times are seconds
  from the start of the run.

A shape with a dimension that is not known is written as null (the whole shape),
and its ``bytes`` as 0. Non-finite floats (a NaN loss, an Inf in a value summary) are
written as null, since JSON has no NaN. The Perfetto export (`to_perfetto`) turns a
timeline into Chrome's trace-event JSON, which ui.perfetto.dev and chrome://tracing
open.
"""

from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import zlib
from typing import Any

import numpy as np

from tinyflow.graph import Graph, Node, TinyFlowError

FORMAT = "tinyflow.debugrecord"
VERSION = 1

# Long attribute values (a 10,000-element tuple, a constant's array) are shortened
# to this many items, so a record stays small and readable.
MAX_ATTR_ITEMS = 16
MAX_ATTR_CHARS = 200


class RecordError(TinyFlowError, ValueError):
    """A DebugRecord that cannot be read or is not well formed; says where and why."""


# ----------------------------------------------------------------------------------
# Building records
# ----------------------------------------------------------------------------------


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` as plain JSON data: numbers, strings, lists, dicts (keys as strings).

    Arrays (and constants' values) become a list when small, else a short
    description such as ``"array(784x10 float32)"``; sequences longer than
    MAX_ATTR_ITEMS keep their first items and a ``"... (+N more)"`` marker; anything
    else unknown becomes its (shortened) repr. Non-finite floats are kept here and
    written as null by `save`.
    """
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and len(value) > MAX_ATTR_CHARS:
            return value[:MAX_ATTR_CHARS] + "..."
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, Node):
        return value.name
    array = getattr(value, "array", value)  # ops.ConstValue wraps its array
    if isinstance(array, np.ndarray):
        if array.size <= MAX_ATTR_ITEMS and array.dtype.kind in "biuf":
            return array.tolist()
        dims = "x".join(str(d) for d in array.shape) or "scalar"
        return f"array({dims} {array.dtype})"
    if depth >= 4:  # attrs are shallow; anything deeper is shown, not walked
        return _short_repr(value)
    if isinstance(value, (list, tuple)):
        items = [json_safe(v, depth + 1) for v in value[:MAX_ATTR_ITEMS]]
        if len(value) > MAX_ATTR_ITEMS:
            items.append(f"... (+{len(value) - MAX_ATTR_ITEMS} more)")
        return items
    if isinstance(value, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    return _short_repr(value)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_ATTR_CHARS else text[:MAX_ATTR_CHARS] + "..."


def node_bytes(shape: tuple | None, dtype: Any) -> int:
    """Bytes of a tensor of `shape` and `dtype`; 0 when either is not known."""
    if shape is None or dtype is None or any(d is None for d in shape):
        return 0
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def node_to_dict(node: Node) -> dict:
    """One node as the record's node entry (see the schema in the module docstring)."""
    known = node.shape is not None and all(d is not None for d in node.shape)
    return {
        "id": node.name,
        "op": node.op,
        "inputs": [i.name for i in node.inputs],
        "shape": [int(d) for d in node.shape] if known else None,
        "dtype": None if node.dtype is None else str(node.dtype),
        "bytes": node_bytes(node.shape, node.dtype),
        "where": node.where,
        "attrs": {str(k): json_safe(v) for k, v in node.attrs.items()},
        "provenance": [str(p) for p in node.provenance],
        "phase": node.phase,
    }


def graph_to_dict(graph: Graph, pass_name: str, index: int, seconds: float,
                  changed: bool) -> dict:
    """The record's entry for `graph` as it stands after pass `pass_name`.

    Nodes are listed in topological order (every input before its consumers), so a
    reader can lay them out without sorting. `index` is the pass's position in the
    pipeline (0 for the input graph), `seconds` the time the pass took, `changed`
    whether it rewrote anything.
    """
    return {
        "pass": pass_name,
        "index": int(index),
        "seconds": float(seconds),
        "changed": bool(changed),
        "nodes": [node_to_dict(n) for n in graph.nodes],
        "outputs": [o.name for o in graph.outputs],
    }


def empty_record(title: str, device: str = "cpu", command: str = "") -> dict:
    """A valid record with no graphs, runs or plan yet; callers fill the sections."""
    from tinyflow import __version__
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": {
            "title": title,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "device": device,
            "tinyflow_version": __version__,
            "command": command,
        },
        "graphs": [],
        "rewrites": [],
        "streams": [{"id": 0, "name": "compute0"}],
        "schedule": [],
        "memory_plan": None,
        "timelines": [],
        "scalars": {},
        "check": None,
    }


# ----------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: str, expected: str, value: Any) -> RecordError:
    return RecordError(f"{path}: expected {expected}, got {_show(value)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _need(obj: dict, key: str, path: str) -> Any:
    if key not in obj:
        raise RecordError(f"{path}: missing key {key!r}")
    return obj[key]


def _dict(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, "an object", value)
    return value


def _list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise _fail(path, "a list", value)
    return value


def _int(value: Any, path: str) -> int:
    if not _is_int(value):
        raise _fail(path, "an integer", value)
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, "a string", value)
    return value


def _finite(value: Any, path: str) -> float:
    if not _is_num(value) or not math.isfinite(value):
        raise _fail(path, "a finite number", value)
    return value


def _num_or_null(value: Any, path: str) -> None:
    if value is not None and not _is_num(value):
        raise _fail(path, "a number or null", value)


def _ref(name: Any, ids: set[str], path: str, what: str) -> None:
    _str(name, path)
    if name not in ids:
        raise RecordError(f"{path}: {what} {name!r} is not a node of {_graph_word(what)}")


def _graph_word(what: str) -> str:
    return "this graph" if what == "input" or what == "output" else "the last graph"


def _validate_graph(graph: Any, path: str) -> set[str]:
    graph = _dict(graph, path)
    _str(_need(graph, "pass", path), f"{path}.pass")
    _int(_need(graph, "index", path), f"{path}.index")
    _finite(_need(graph, "seconds", path), f"{path}.seconds")
    if not isinstance(_need(graph, "changed", path), bool):
        raise _fail(f"{path}.changed", "true or false", graph["changed"])
    ids: set[str] = set()
    nodes = _list(_need(graph, "nodes", path), f"{path}.nodes")
    for k, node in enumerate(nodes):
        where = f"{path}.nodes[{k}]"
        node = _dict(node, where)
        name = _str(_need(node, "id", where), f"{where}.id")
        if name in ids:
            raise RecordError(f"{where}.id: node id {name!r} appears twice in this graph")
        _str(_need(node, "op", where), f"{where}.op")
        for j, inp in enumerate(_list(_need(node, "inputs", where), f"{where}.inputs")):
            # Topological order: an input is listed before the node that reads it.
            if not isinstance(inp, str) or inp not in ids:
                _str(inp, f"{where}.inputs[{j}]")
                raise RecordError(f"{where}.inputs[{j}]: input {inp!r} is not a node listed "
                                  f"before {name!r} in this graph")
        shape = _need(node, "shape", where)
        if shape is not None:
            if not isinstance(shape, list):
                raise _fail(f"{where}.shape", "a list or null", shape)
            for j, d in enumerate(shape):
                if not _is_int(d) or d < 0:
                    raise _fail(f"{where}.shape[{j}]", "a non-negative integer", d)
        dtype = _need(node, "dtype", where)
        if dtype is not None:
            _str(dtype, f"{where}.dtype")
        if _int(_need(node, "bytes", where), f"{where}.bytes") < 0:
            raise _fail(f"{where}.bytes", "a non-negative integer", node["bytes"])
        _str(_need(node, "where", where), f"{where}.where")
        _dict(_need(node, "attrs", where), f"{where}.attrs")
        for j, p in enumerate(_list(_need(node, "provenance", where),
                                    f"{where}.provenance")):
            _str(p, f"{where}.provenance[{j}]")
        if _need(node, "phase", where) not in ("forward", "backward"):
            raise _fail(f"{where}.phase", "'forward' or 'backward'", node["phase"])
        ids.add(name)
    for j, out in enumerate(_list(_need(graph, "outputs", path), f"{path}.outputs")):
        _ref(out, ids, f"{path}.outputs[{j}]", "output")
    return ids


def validate(record: Any) -> None:
    """Check that `record` follows the DebugRecord schema; return None or raise.

    Raises RecordError naming the first offending place as a path, for example
    ``graphs[2].nodes[5].shape: expected a list or null, got 'x'``. Besides types it
    checks the cross references listed in the module docstring (inputs and schedule
    entries name existing nodes, streams exist, waits name earlier steps).
    """
    record = _dict(record, "record")
    fmt = _need(record, "format", "record")
    if fmt != FORMAT:
        raise RecordError(f"format: expected {FORMAT!r}, got {_show(fmt)}; "
                          "this is not a TinyFlow debug record")
    version = _int(_need(record, "version", "record"), "version")
    if version > VERSION:
        raise RecordError(f"version: this record was written by a newer TinyFlow (version "
                          f"{version} > {VERSION}); upgrade tinyflow to open it")
    if version < 1:
        raise _fail("version", f"an integer from 1 to {VERSION}", version)

    meta = _dict(_need(record, "meta", "record"), "meta")
    for key in ("title", "created", "device", "tinyflow_version", "command"):
        _str(_need(meta, key, "meta"), f"meta.{key}")

    last_ids: set[str] = set()
    for k, graph in enumerate(_list(_need(record, "graphs", "record"), "graphs")):
        last_ids = _validate_graph(graph, f"graphs[{k}]")

    for k, rw in enumerate(_list(_need(record, "rewrites", "record"), "rewrites")):
        path = f"rewrites[{k}]"
        rw = _dict(rw, path)
        _str(_need(rw, "pass", path), f"{path}.pass")
        for key in ("removed", "added"):
            for j, name in enumerate(_list(_need(rw, key, path), f"{path}.{key}")):
                _str(name, f"{path}.{key}[{j}]")
        _str(_need(rw, "reason", path), f"{path}.reason")

    stream_ids: set[int] = set()
    for k, stream in enumerate(_list(_need(record, "streams", "record"), "streams")):
        path = f"streams[{k}]"
        stream = _dict(stream, path)
        sid = _int(_need(stream, "id", path), f"{path}.id")
        if sid in stream_ids:
            raise RecordError(f"{path}.id: stream {sid} appears twice")
        _str(_need(stream, "name", path), f"{path}.name")
        stream_ids.add(sid)

    def stream_ref(value: Any, path: str) -> None:
        if _int(value, path) not in stream_ids:
            raise RecordError(f"{path}: stream {value} is not listed in 'streams'")

    steps: set[int] = set()
    for k, entry in enumerate(_list(_need(record, "schedule", "record"), "schedule")):
        path = f"schedule[{k}]"
        entry = _dict(entry, path)
        step = _int(_need(entry, "step", path), f"{path}.step")
        if step in steps:
            raise RecordError(f"{path}.step: step {step} appears twice in the schedule")
        _ref(_need(entry, "node", path), last_ids, f"{path}.node", "node")
        _str(_need(entry, "op", path), f"{path}.op")
        stream_ref(_need(entry, "stream", path), f"{path}.stream")
        for j, wait in enumerate(_list(_need(entry, "waits", path), f"{path}.waits")):
            where = f"{path}.waits[{j}]"
            wait = _dict(wait, where)
            _int(_need(wait, "event", where), f"{where}.event")
            stream_ref(_need(wait, "stream", where), f"{where}.stream")
            if _int(_need(wait, "step", where), f"{where}.step") not in steps:
                raise RecordError(f"{where}.step: step {wait['step']} is not an earlier "
                                  "step of the schedule")
        event = _need(entry, "records_event", path)
        if event is not None:
            _int(event, f"{path}.records_event")
        steps.add(step)

    plan = _need(record, "memory_plan", "record")
    if plan is not None:
        _validate_plan(plan, last_ids)

    for k, timeline in enumerate(_list(_need(record, "timelines", "record"), "timelines")):
        path = f"timelines[{k}]"
        timeline = _dict(timeline, path)
        _int(_need(timeline, "run", path), f"{path}.run")
        _str(_need(timeline, "label", path), f"{path}.label")
        for j, event in enumerate(_list(_need(timeline, "events", path), f"{path}.events")):
            where = f"{path}.events[{j}]"
            event = _dict(event, where)
            step = _need(event, "step", where)
            if step is not None and _int(step, f"{where}.step") not in steps:
                raise RecordError(f"{where}.step: step {step} is not in the schedule")
            _str(_need(event, "node", where), f"{where}.node")
            _str(_need(event, "op", where), f"{where}.op")
            stream_ref(_need(event, "stream", where), f"{where}.stream")
            start = _finite(_need(event, "start", where), f"{where}.start")
            if _finite(_need(event, "end", where), f"{where}.end") < start:
                raise RecordError(f"{where}.end: ends ({event['end']}) before it starts "
                                  f"({start})")
            _int(_need(event, "bytes", where), f"{where}.bytes")
            summary = _need(event, "summary", where)
            if summary is not None:
                summary = _dict(summary, f"{where}.summary")
                for key in ("min", "max", "mean"):
                    _num_or_null(_need(summary, key, f"{where}.summary"),
                                 f"{where}.summary.{key}")
                for key in ("nan", "inf"):
                    _int(_need(summary, key, f"{where}.summary"), f"{where}.summary.{key}")
            if "args" in event:
                _dict(event["args"], f"{where}.args")

    scalars = _dict(_need(record, "scalars", "record"), "scalars")
    for name, points in scalars.items():
        path = f"scalars[{name!r}]"
        for j, point in enumerate(_list(points, path)):
            if not isinstance(point, list) or len(point) != 2:
                raise _fail(f"{path}[{j}]", "a pair [step, value]", point)
            _int(point[0], f"{path}[{j}][0]")
            _num_or_null(point[1], f"{path}[{j}][1]")

    check = _need(record, "check", "record")
    if check is not None:
        check = _dict(check, "check")
        _ref(_need(check, "node", "check"), last_ids, "check.node", "node")
        _str(_need(check, "where", "check"), "check.where")
        _str(_need(check, "message", "check"), "check.message")


def _validate_plan(plan: Any, last_ids: set[str]) -> None:
    plan = _dict(plan, "memory_plan")
    _str(_need(plan, "strategy", "memory_plan"), "memory_plan.strategy")
    for key in ("arena_bytes", "naive_bytes", "lower_bound_bytes", "alignment"):
        _int(_need(plan, key, "memory_plan"), f"memory_plan.{key}")
    for name, size in _dict(_need(plan, "strategies", "memory_plan"),
                            "memory_plan.strategies").items():
        _int(size, f"memory_plan.strategies[{name!r}]")
    kinds = ("intermediate", "feed", "variable", "constant", "output")
    for k, tensor in enumerate(_list(_need(plan, "tensors", "memory_plan"),
                                     "memory_plan.tensors")):
        path = f"memory_plan.tensors[{k}]"
        tensor = _dict(tensor, path)
        _ref(_need(tensor, "node", path), last_ids, f"{path}.node", "node")
        offset = _need(tensor, "offset", path)
        if offset is not None and _int(offset, f"{path}.offset") < 0:
            raise _fail(f"{path}.offset", "a non-negative integer or null", offset)
        _int(_need(tensor, "nbytes", path), f"{path}.nbytes")
        first = _int(_need(tensor, "first_step", path), f"{path}.first_step")
        if _int(_need(tensor, "last_step", path), f"{path}.last_step") < first:
            raise RecordError(f"{path}.last_step: {tensor['last_step']} is before "
                              f"first_step {first}")
        shared = _need(tensor, "inplace_of", path)
        if shared is not None:
            _ref(shared, last_ids, f"{path}.inplace_of", "node")
        if _need(tensor, "kind", path) not in kinds:
            raise _fail(f"{path}.kind", " or ".join(repr(k) for k in kinds), tensor["kind"])
        _str(_need(tensor, "reason", path), f"{path}.reason")


# ----------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------


def _without_nonfinite(value: Any) -> Any:
    """A copy of `value` with NaN and +-Inf floats replaced by None (JSON null).

    The record's nesting is shallow and fixed by the schema (attrs were shortened
    by `json_safe`), so plain recursion is safe here.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _without_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nonfinite(v) for v in value]
    return value


def dumps(record: dict) -> str:
    """The record as JSON text (validated first; NaN/Inf written as null)."""
    validate(record)
    return json.dumps(_without_nonfinite(record), allow_nan=False, separators=(",", ":"))


def save(record: dict, path: str | os.PathLike) -> None:
    """Validate `record` and write it to `path` as JSON (gzip if it ends in ``.gz``).

    The file is written to a temporary name and renamed, so a reader never sees a
    half-written record.
    """
    text = dumps(record).encode("utf-8")
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(gzip.compress(text, compresslevel=6) if path.endswith(".gz") else text)
    os.replace(tmp, path)


def loads(data: bytes | str, name: str = "record") -> dict:
    """Parse and validate a record from bytes (gzip or plain) or text; see `load`."""
    if isinstance(data, bytes):
        if data[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError, zlib.error) as err:
                raise RecordError(f"{name}: the gzip data is truncated or damaged "
                                  f"({err})") from None
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError(f"{name}: not a DebugRecord (not JSON text; is it a binary "
                              "file?)") from None
    if not data.strip():
        raise RecordError(f"{name}: the file is empty")
    try:
        record = json.loads(data)
    except json.JSONDecodeError as err:
        text = data.strip()
        # A record is one JSON object: one that never closes was cut off.
        if err.pos >= len(text) - 1 or (text.startswith("{") and not text.endswith("}")):
            raise RecordError(f"{name}: the file is truncated (JSON ends early at line "
                              f"{err.lineno}, column {err.colno}); was it still being "
                              "written?") from None
        raise RecordError(f"{name}: not a DebugRecord: invalid JSON at line {err.lineno}, "
                          f"column {err.colno}: {err.msg}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise RecordError(f"{name}: not a TinyFlow debug record (format is {_show(found)}, "
                          f"expected {FORMAT!r})")
    version = record.get("version")
    if _is_int(version) and version > VERSION:
        raise RecordError(f"{name}: written by a newer TinyFlow (version {version} > "
                          f"{VERSION}); upgrade tinyflow to open it")
    try:
        validate(record)
    except RecordError as err:
        raise RecordError(f"{name}: malformed record: {err}") from None
    return record


def load(path: str | os.PathLike) -> dict:
    """Read and validate the record at `path`.

    Raises RecordError with a plain message (never a bare traceback) when the file
    is missing, empty, truncated, not JSON, not a DebugRecord, written by a newer
    TinyFlow, or malformed (the message then names the offending path).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise RecordError(f"{path}: is a directory, not a record file") from None
    except OSError as err:
        raise RecordError(f"{path}: cannot read: {err.strerror}") from None
    return loads(data, path)


# ----------------------------------------------------------------------------------
# Live records: the v1 document plus an append-only JSON-lines file beside it
# ----------------------------------------------------------------------------------
#
# Which versions load: `load` reads version 1 documents (plain or gzip). A live run
# (`tf.debug.record(PATH, live=True)`, `tinyflow train NAME --trace PATH --live`)
# writes, beside the version 1 document PATH, the file PATH + LIVE_SUFFIX: one JSON
# object per line, appended while training runs, so a viewer can follow it without
# re-reading the whole record:
#
#     {"kind": "scalar", "name": str, "step": int, "value": float | null}
#     {"kind": "timeline", "timeline": {"run": int, "label": str, "events": [...]}}
#
# The document is (re)written whenever the program being recorded changes and at the
# end; its optional key ``"live_lines": N`` says that it already holds the first N
# lines, so a reader applies only the lines after them. A timeline line refers to
# the schedule of the document written before it. `LiveReader` follows both files;
# `load_live` reads them once. A last line without its newline is still being
# written and is left for the next read.

LIVE_SUFFIX = ".live.jsonl"


def live_path(path: str | os.PathLike) -> str:
    """The JSON-lines file that goes with the record at `path`."""
    return os.fspath(path) + LIVE_SUFFIX


def live_line(kind: str, **fields: Any) -> str:
    """One line of the live file (with its newline); NaN/Inf written as null."""
    return json.dumps(_without_nonfinite({"kind": kind, **fields}), allow_nan=False,
                      separators=(",", ":")) + "\n"


class LiveReader:
    """Follows a live record: `poll()` reads what was appended since the last call
    and returns True when the record changed. `record` is the current state: the
    document with every later line applied (the last `max_runs` timelines kept)."""

    def __init__(self, path: str | os.PathLike, max_runs: int = 20) -> None:
        self.path = os.fspath(path)
        self.lines_path = live_path(path)
        self.max_runs = max_runs
        self.record: dict | None = None
        self._doc_stamp: tuple | None = None
        self._offset = 0        # bytes of the lines file already read
        self._lines = 0         # complete lines read so far
        self.scalars_seen = 0   # scalar points applied (for tests and the status line)

    def _stamp(self) -> tuple | None:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (info.st_mtime_ns, info.st_size)

    def poll(self) -> bool:
        """Read new data; True when `record` changed. Raises RecordError for a line
        that is not valid JSON or not a known kind (naming the line)."""
        changed = False
        stamp = self._stamp()
        if stamp is not None and stamp != self._doc_stamp:
            self.record = load(self.path)
            self._doc_stamp = stamp
            self._offset = self._lines = 0     # re-apply the lines after its own
            changed = True
        if self.record is None:
            if not os.path.exists(self.lines_path):
                return False
            self.record = empty_record(os.path.basename(self.path))
            changed = True
        return self._read_lines() or changed

    def _read_lines(self) -> bool:
        try:
            with open(self.lines_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return False
        end = data.rfind(b"\n")
        if end < 0:
            return False
        self._offset += end + 1
        skip = self.record.get("live_lines", 0) if self.record else 0
        changed = False
        for raw in data[:end].split(b"\n"):
            self._lines += 1
            if self._lines <= skip or not raw.strip():
                continue
            self._apply(raw, self._lines)
            changed = True
        return changed

    def _apply(self, raw: bytes, number: int) -> None:
        where = f"{self.lines_path}: line {number}"
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RecordError(f"{where}: not JSON ({err})") from None
        if not isinstance(line, dict):
            raise _fail(where, "a JSON object", line)
        record = self.record
        if line.get("kind") == "scalar":
            name = _str(_need(line, "name", where), f"{where}.name")
            step = _int(_need(line, "step", where), f"{where}.step")
            value = _need(line, "value", where)
            _num_or_null(value, f"{where}.value")
            record["scalars"].setdefault(name, []).append([step, value])
            self.scalars_seen += 1
        elif line.get("kind") == "timeline":
            timeline = _need(line, "timeline", where)
            candidate = {**record, "graphs": record["graphs"][-1:], "rewrites": [],
                         "timelines": [timeline], "scalars": {}, "check": None}
            try:
                validate(candidate)
            except RecordError as err:
                raise RecordError(f"{where}: {err}") from None
            record["timelines"] = (record["timelines"] + [timeline])[-self.max_runs:]
        else:
            raise _fail(f"{where}.kind", "'scalar' or 'timeline'", line.get("kind"))


def load_live(path: str | os.PathLike) -> dict:
    """The record at `path` with its live lines applied (what `LiveReader` shows)."""
    reader = LiveReader(path)
    reader.poll()
    if reader.record is None:
        raise RecordError(f"{os.fspath(path)}: no such file (nor {live_path(path)})")
    return reader.record


# ----------------------------------------------------------------------------------
# Perfetto / Chrome trace export
# ----------------------------------------------------------------------------------


def last_graph_nodes(record: dict) -> dict[str, dict]:
    """{node id: node entry} of the program that ran (the record's last graph)."""
    graphs = record.get("graphs") or []
    return {n["id"]: n for n in graphs[-1]["nodes"]} if graphs else {}


def live_bytes_per_step(record: dict) -> dict[int, int]:
    """{schedule step: arena bytes in use while it runs}, from the memory plan.

    A tensor counts from its first to its last step. One written in place over its
    input (``inplace_of``) shares that input's bytes at the step that writes it, so
    it counts from the step after. Tensors outside the arena (offset null) are not
    counted. Empty when there is no plan.
    """
    plan = record.get("memory_plan")
    steps = [e["step"] for e in record.get("schedule", [])]
    if not plan or not steps:
        return {}
    delta: dict[int, int] = {}
    for t in plan["tensors"]:
        first = t["first_step"] + (1 if t["inplace_of"] is not None else 0)
        if t["offset"] is None or first > t["last_step"]:
            continue
        delta[first] = delta.get(first, 0) + t["nbytes"]
        delta[t["last_step"] + 1] = delta.get(t["last_step"] + 1, 0) - t["nbytes"]
    live, result = 0, {}
    for step in range(min(steps), max(steps) + 1):
        live += delta.get(step, 0)
        result[step] = live
    return result


def to_perfetto(record: dict, run: int = -1) -> dict:
    """Chrome trace-event JSON of timeline `run` (an index into ``timelines``).

    Returns ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, which Perfetto
    (ui.perfetto.dev) and chrome://tracing open:

    * one thread (``tid``) per stream, named by ``thread_name`` metadata ("M");
    * an "X" (complete) event per step, ``ts``/``dur`` in microseconds, with the
      node's id, op, shape, bytes and value summary in ``args``;
    * a flow ("s" then "f") for every cross-stream wait of the schedule, from the
      step that recorded the event to the step that waited, drawn as an arrow;
    * a counter track ("C") "arena bytes in use" from the memory plan, sampled at
      each step's start.

    Raises RecordError when the record has no timeline `run`.
    """
    timelines = record.get("timelines") or []
    if not timelines:
        raise RecordError("the record has no timeline to export (run the program with "
                          "tracing on, e.g. tf.debug.record(...) around Session.run)")
    try:
        timeline = timelines[run]
    except IndexError:
        raise RecordError(f"the record has {len(timelines)} timeline(s); there is no run "
                          f"index {run}") from None
    pid = 1
    nodes = last_graph_nodes(record)
    names = {s["id"]: s["name"] for s in record.get("streams", [])}
    for event in timeline["events"]:
        names.setdefault(event["stream"], f"stream{event['stream']}")

    trace: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                          "args": {"name": f"tinyflow: {record['meta']['title']}"}}]
    for sid in sorted(names):
        trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": sid,
                      "args": {"name": names[sid]}})
        trace.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": sid,
                      "args": {"sort_index": sid}})

    def us(seconds: float) -> float:
        return round(seconds * 1e6, 3)

    by_step: dict[int, dict] = {}
    for event in timeline["events"]:
        node = nodes.get(event["node"], {})
        args = {"node": event["node"], "op": event["op"], "shape": node.get("shape"),
                "bytes": event["bytes"], "summary": event.get("summary")}
        if event.get("step") is not None:
            args["step"] = event["step"]
            by_step[event["step"]] = event
        args.update(event.get("args") or {})
        trace.append({"ph": "X", "name": event["node"], "cat": event["op"], "pid": pid,
                      "tid": event["stream"], "ts": us(event["start"]),
                      "dur": us(max(event["end"] - event["start"], 0.0)), "args": args})

    # Flows: an arrow from the producer's slice to the waiting consumer's slice.
    # "s" sits just inside the end of the producer slice; "f" with binding point
    # "e" attaches to the slice enclosing its timestamp (the consumer's start).
    flow_id = 0
    for entry in record.get("schedule", []):
        consumer = by_step.get(entry["step"])
        for wait in entry["waits"]:
            producer = by_step.get(wait["step"])
            if consumer is None or producer is None:
                continue
            flow_id += 1
            end = producer["end"]
            inside = max(producer["start"], end - min(1e-7, (end - producer["start"]) / 2))
            common = {"name": f"event {wait['event']}", "cat": "wait", "pid": pid,
                      "id": flow_id}
            trace.append({**common, "ph": "s", "tid": producer["stream"], "ts": us(inside)})
            trace.append({**common, "ph": "f", "bp": "e", "tid": consumer["stream"],
                          "ts": us(consumer["start"])})

    live = live_bytes_per_step(record)
    if live:
        samples = sorted((e["start"], live[e["step"]]) for e in timeline["events"]
                         if e.get("step") in live)
        for start, value in samples:
            trace.append({"ph": "C", "name": "arena bytes in use", "pid": pid,
                          "ts": us(start), "args": {"bytes": value}})
        if samples:
            end = max(e["end"] for e in timeline["events"])
            trace.append({"ph": "C", "name": "arena bytes in use", "pid": pid,
                          "ts": us(end), "args": {"bytes": 0}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"title": record["meta"]["title"], "run": timeline["run"],
                          "label": timeline["label"]}}
