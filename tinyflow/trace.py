"""The DebugRecord: one versioned JSON file that says what the system did and why.

tinyflow writes it (`tinyflow/debug.py` assembles it from a compiled Program and its
runs); the terminal debugger (`viz/`) and the exporters only read it. It is the
contract between the two halves. The file is plain JSON (gzip when the name ends
in ``.gz``), never pickle: a record is something users send each other and open.

The reference for its structure is the JSON Schema beside this module,
``tinyflow/record.schema.json`` (draft 2020-12, ``FORMAT = "tinyflow.debugrecord"``,
version 1), with a description for every field; any JSON Schema tool can read it,
and `validate` checks records with it through `jsonschema-rs`. In short, a record has
``meta``; ``graphs`` (the graph after every pass: nodes with id, op, inputs, shape,
dtype, bytes, where, attrs, provenance, phase); ``rewrites``; ``streams``;
``schedule`` (steps with stream and cross-stream waits); ``memory_plan`` (or null);
``timelines`` (events with step, node, stream, start/end seconds, value summary);
``scalars`` ({name: [[step, value], ...]}); ``check`` (or null). Objects may carry
keys the schema does not list (tools extend the record); readers ignore them.

What a schema cannot say is checked by `_reference_problems`:

* a node's ``inputs`` name nodes listed before it, a graph's ``outputs`` its nodes;
* ``schedule``, ``memory_plan.tensors`` and ``check`` name nodes of the *last* graph
  (the program that ran); ``waits[].step`` names an earlier schedule step, and every
  stream number names an entry of ``streams``;
* ``timelines[].events[].step`` is a schedule step or null (an event that is not a
  step of the program, such as one chunk of a ring allreduce); times are seconds
  from the start of the run;
* schedule steps are below the number of steps, so a reader that walks the steps
  stops (the schema bounds every other number).

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
import re
import stat
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
        **({"grad_of": node.grad_of.name} if node.grad_of is not None else {}),
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
    from tinyflow.version import VERSION as __version__
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


# What json.loads makes of each kind of JSON value, named as JSON names it.
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# The schema is data shipped beside this module (package data in pyproject.toml).
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "record.schema.json")
_validator: list[Any] = []  # the compiled jsonschema validator, built on first use


def schema() -> dict:
    """The DebugRecord's JSON Schema (draft 2020-12), `record.schema.json`."""
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)


def _schema_validator() -> Any:
    # jsonschema-rs (Rust) rather than the pure-Python jsonschema: on a record of
    # 10,000 nodes it takes 0.05 s where jsonschema takes 8 s (benchmarks/run.py).
    if not _validator:
        import jsonschema_rs
        _validator.append(jsonschema_rs.Draft202012Validator(schema()))
    return _validator[0]


def json_path(parts: Any) -> str:
    """``graphs[2].nodes[5].shape`` from a sequence of keys and indices."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif str(part).isidentifier():
            text += f".{part}" if text else str(part)
        else:
            text += f"[{str(part)!r}]"
    return text or "record"


def _schema_problems(record: Any) -> list[str]:
    validator = _schema_validator()
    if validator.is_valid(record):  # the fast path: every record read from a file
        return []
    # NaN and Inf (only in records built in memory) are checked as the null they are
    # written as in the file; jsonschema-rs refuses the floats themselves.
    errors = sorted(validator.iter_errors(_without_nonfinite(record)),
                    key=lambda e: [str(p) for p in e.instance_path])
    problems = []
    for error in errors:
        where = json_path(error.instance_path)
        if error.message.endswith(" is a required property"):  # the key it lacks
            missing = error.message.removesuffix(" is a required property")
            problems.append(f"{where}: missing key {missing}")
        else:
            problems.append(f"{where}: {_short(error.message)}")
    return problems


_LONG_NUMBER = re.compile(r"\d{25,}")   # longer than any number a real record holds


def _short(message: str) -> str:
    """A long message (it quotes the offending value) made readable: each long run of
    digits cut to its first 20 and a count (jsonschema-rs versions print a huge bound
    or value in full), then, if still long, cut in the middle: its end says what the
    rule was."""
    message = _LONG_NUMBER.sub(lambda m: f"{m[0][:20]}...({len(m[0])} digits)", message)
    return message if len(message) <= 160 else message[:80] + " ... " + message[-75:]


def problems(record: Any) -> list[str]:
    """Every way `record` breaks the DebugRecord's rules, each as ``PATH: what``.

    First the JSON Schema (`record.schema.json`: types, required keys, enums,
    number ranges); when the structure is sound, the rules a schema cannot state
    (`_reference_problems`). Empty when the record is valid.
    """
    if isinstance(record, dict):
        if record.get("format") != FORMAT:
            return [f"format: expected {FORMAT!r}, got {_show(record.get('format'))}; "
                    "this is not a TinyFlow debug record"]
        version = record.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            return [f"version: this record was written by a newer TinyFlow (version "
                    f"{version} > {VERSION}); upgrade tinyflow to open it"]
    found = _schema_problems(record)
    return found or _reference_problems(record)


def validate(record: Any) -> None:
    """Check that `record` follows the DebugRecord's rules; return None or raise.

    Raises RecordError naming the first offending place as a path, for example
    ``graphs[2].nodes[5].shape: 'x' is not of type 'array', 'null'``, and how many
    more problems there are (`problems` lists them all).
    """
    found = problems(record)
    if found:
        more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
        raise RecordError(found[0] + more)


def _reference_problems(record: dict) -> list[str]:
    """The rules a JSON Schema cannot say, for a record the schema accepted.

    Names that point elsewhere must exist (a node's inputs listed before it, a
    graph's outputs; schedule, plan and check nodes in the last graph; streams);
    schedule steps must be unique and below the number of steps, so that a reader
    that walks from the first step to the last (`live_bytes_per_step`, the
    debugger's memory view) does at most one iteration per step of the schedule.
    (A plan's lifetimes are only compared and scaled, never walked; the schema
    bounds them.)
    """
    found: list[str] = []
    last_ids: set[str] = set()
    for k, graph in enumerate(record["graphs"]):
        last_ids = _graph_ids(graph, f"graphs[{k}]", found)
    stream_ids = [s["id"] for s in record["streams"]]
    if len(set(stream_ids)) != len(stream_ids):
        found.append(f"streams: a stream id appears twice ({sorted(stream_ids)})")
    streams = set(stream_ids)
    steps = _schedule_problems(record["schedule"], last_ids, streams, found)
    plan = record["memory_plan"]
    for k, tensor in enumerate(plan["tensors"] if plan else []):
        path = f"memory_plan.tensors[{k}]"
        _need_node(tensor["node"], last_ids, f"{path}.node", found)
        if tensor["inplace_of"] is not None:
            _need_node(tensor["inplace_of"], last_ids, f"{path}.inplace_of", found)
        first, last = tensor["first_step"], tensor["last_step"]
        if last < first:
            found.append(f"{path}.last_step: {last} is before first_step {first}")
    for k, timeline in enumerate(record["timelines"]):
        for j, event in enumerate(timeline["events"]):
            where = f"timelines[{k}].events[{j}]"
            if event["step"] is not None and event["step"] not in steps:
                found.append(f"{where}.step: step {event['step']} is not in the schedule")
            if event["stream"] not in streams:
                found.append(f"{where}.stream: stream {event['stream']} is not listed in "
                             "'streams'")
            if not (math.isfinite(event["start"]) and math.isfinite(event["end"])):
                found.append(f"{where}: start and end must be finite numbers, got "
                             f"{event['start']} and {event['end']}")
            elif event["end"] < event["start"]:
                found.append(f"{where}.end: ends ({event['end']}) before it starts "
                             f"({event['start']})")
    if record["check"] is not None:
        _need_node(record["check"]["node"], last_ids, "check.node", found)
    return found


def _need_node(name: str, ids: set[str], path: str, found: list[str]) -> None:
    if name not in ids:
        found.append(f"{path}: node {name!r} is not a node of the last graph")


def _graph_ids(graph: dict, path: str, found: list[str]) -> set[str]:
    """The graph's node ids; notes duplicates and inputs not listed before use."""
    ids: set[str] = set()
    for k, node in enumerate(graph["nodes"]):
        where = f"{path}.nodes[{k}]"
        for j, inp in enumerate(node["inputs"]):
            if inp not in ids:  # topological order: inputs come first
                found.append(f"{where}.inputs[{j}]: input {inp!r} is not a node listed "
                             f"before {node['id']!r} in this graph")
        if node["id"] in ids:
            found.append(f"{where}.id: node id {node['id']!r} appears twice in this graph")
        ids.add(node["id"])
    for j, out in enumerate(graph["outputs"]):
        if out not in ids:
            found.append(f"{path}.outputs[{j}]: output {out!r} is not a node of this graph")
    return ids


def _schedule_problems(schedule: list, last_ids: set[str], streams: set[int],
                       found: list[str]) -> set[int]:
    """Steps unique and below len(schedule); nodes, streams and waits that exist."""
    steps: set[int] = set()
    for k, entry in enumerate(schedule):
        path, step = f"schedule[{k}]", entry["step"]
        if step in steps:
            found.append(f"{path}.step: step {step} appears twice in the schedule")
        if step >= len(schedule):
            found.append(f"{path}.step: step {step} is not below the number of steps "
                         f"({len(schedule)})")
        _need_node(entry["node"], last_ids, f"{path}.node", found)
        if entry["stream"] not in streams:
            found.append(f"{path}.stream: stream {entry['stream']} is not listed in "
                         "'streams'")
        for j, wait in enumerate(entry["waits"]):
            where = f"{path}.waits[{j}]"
            if wait["stream"] not in streams:
                found.append(f"{where}.stream: stream {wait['stream']} is not listed in "
                             "'streams'")
            if wait["step"] not in steps:
                found.append(f"{where}.step: step {wait['step']} is not an earlier step "
                             "of the schedule")
        steps.add(step)
    return steps


# ----------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------


def _without_nonfinite(value: Any) -> Any:
    """A copy of `value` with NaN and +-Inf floats, and those beyond +-MAX_VALUE (the
    schema's bound on a shown value: a float32 would be inf), replaced by None (JSON
    null).

    The record's nesting is shallow and fixed by the schema (attrs were shortened
    by `json_safe`), so plain recursion is safe here.
    """
    if isinstance(value, float):
        return value if -MAX_VALUE <= value <= MAX_VALUE else None   # (NaN: False)
    if isinstance(value, dict):
        return {k: _without_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nonfinite(v) for v in value]
    return value


# One encoder for every write: json.dumps with options builds a new one per call,
# which costs more than encoding a live scalar line itself.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _to_json(value: Any) -> str:
    """`value` as compact JSON, NaN and +-Inf written as null."""
    try:   # nearly always every number is finite: one pass of the C encoder
        return _ENCODER.encode(value)
    except ValueError:   # a NaN or an Inf somewhere (the encoder refuses them)
        return _ENCODER.encode(_without_nonfinite(value))


def dumps(record: dict) -> str:
    """The record as JSON text (validated first; NaN/Inf written as null)."""
    validate(record)
    return _to_json(record)


def save(record: dict, path: str | os.PathLike) -> None:
    """Validate `record` and write it to `path` as JSON (gzip if it ends in ``.gz``).

    The file is written to a temporary name and renamed, so a reader never sees a
    half-written record.
    """
    text = dumps(record).encode("utf-8")
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(gzip.compress(text, compresslevel=6) if path.endswith(".gz") else text)
        os.replace(tmp, path)
    except OSError as err:
        if os.path.isfile(tmp):
            os.unlink(tmp)
        raise RecordError(f"cannot write {path}: {err.strerror or err}") from None


# A record larger than this (after gzip) is refused rather than read: a small gzip
# file can inflate to gigabytes (a "zip bomb").
MAX_RECORD_BYTES = 256 * 2**20


def _inflate(data: bytes, name: str) -> bytes:
    """Decompress gzip `data`, refusing to produce more than MAX_RECORD_BYTES."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip framing
    try:
        out = inflater.decompress(data, MAX_RECORD_BYTES + 1)
    except zlib.error as err:
        raise RecordError(f"{name}: the gzip data is truncated or damaged ({err})") from None
    if len(out) > MAX_RECORD_BYTES:
        raise RecordError(f"{name}: the record inflates to more than "
                          f"{MAX_RECORD_BYTES >> 20} MiB; refusing to read it")
    if not inflater.eof:
        raise RecordError(f"{name}: the gzip data is truncated or damaged (it ends "
                          "early)")
    return out


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: JSON has no such number


class _NotFinite(ValueError):
    """A JSON number too large for a float, such as 1e999 (`_finite_float`)."""

    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _finite_float(literal: str) -> float:
    """json's parse_float: a number literal as a float, refusing one that overflows.

    JSON has no infinity, so a record holds none; but float("1e999") is inf, which
    would pass where a NaN literal is refused, and come out of an export as the
    invalid JSON ``Infinity``.
    """
    value = float(literal)
    if math.isinf(value):
        raise _NotFinite(literal)
    return value


def parse(data: bytes | str, name: str = "record") -> Any:
    """The JSON value in `data` (gzip or plain bytes, or text), not yet validated.

    Raises RecordError for anything that is not one JSON document: binary, empty,
    truncated, too large, nested too deeply, NaN literals, numbers too long.
    """
    if isinstance(data, bytes):
        if data[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
            data = _inflate(data, name)
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError(f"{name}: not a DebugRecord (not JSON text; is it a binary "
                              "file?)") from None
    if not data.strip():
        raise RecordError(f"{name}: the file is empty")
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as err:
        raise RecordError(f"{name}: {_json_problem(data, err)}") from None
    except RecursionError:
        raise RecordError(f"{name}: not a DebugRecord: the JSON is nested too deeply"
                          ) from None
    except _NotFinite as err:
        line, column = _position(data, data.find(err.literal))
        raise RecordError(f"{name}: the number {_show(err.literal)} at line {line}, column "
                          f"{column} is too large in magnitude for a float (it would read "
                          "as infinity; JSON has no infinity)") from None
    except ValueError as err:  # an integer of thousands of digits, a NaN literal
        raise RecordError(f"{name}: not a DebugRecord: {err}") from None


def _json_problem(data: str, err: json.JSONDecodeError) -> str:
    """What is wrong with `data`, which json could not parse: not JSON at all, cut
    off (a record is one JSON object: one that never closes was cut off), or
    invalid somewhere inside."""
    text = data.strip()
    first = len(data) - len(data.lstrip())  # where the first non-blank character is
    if err.pos == first and err.msg == "Expecting value":  # not even the start of one
        return (f"not a DebugRecord: invalid JSON at line {err.lineno}, column "
                f"{err.colno}: the file is not JSON (it starts with {_show(text[:20])})")
    cut_off = err.pos >= len(data.rstrip()) - 1 or not text.endswith(("}", "]"))
    if cut_off and err.msg != "Extra data":  # extra data: something after a whole value
        return (f"the file is truncated (JSON ends early at line {err.lineno}, column "
                f"{err.colno}); was it still being written?")
    return f"not a DebugRecord: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}"


def _position(text: str, offset: int) -> tuple[int, int]:
    """(line, column), both from 1, of character `offset` of `text`."""
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def loads(data: bytes | str, name: str = "record") -> dict:
    """Parse and validate a record from bytes (gzip or plain) or text; see `load`."""
    record = parse(data, name)
    if not isinstance(record, dict):   # (a record is a JSON object)
        raise RecordError(f"{name}: not a TinyFlow debug record (the file holds a JSON "
                          f"{_JSON_KINDS.get(type(record), type(record).__name__)}, not an "
                          "object)")
    if record.get("format") != FORMAT:
        raise RecordError(f"{name}: not a TinyFlow debug record (format is "
                          f"{_show(record.get('format'))}, expected {FORMAT!r})")
    version = record.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise RecordError(f"{name}: written by a newer TinyFlow (version {version} > "
                          f"{VERSION}); upgrade tinyflow to open it")
    try:
        validate(record)
    except RecordError as err:
        raise RecordError(f"{name}: malformed record: {err}") from None
    return record


def read_file(path: str | os.PathLike) -> bytes:
    """The bytes of the record file at `path`; RecordError when it cannot be read."""
    path = os.fspath(path)
    try:
        with open_regular(path) as f:
            if os.fstat(f.fileno()).st_size > MAX_RECORD_BYTES:
                raise RecordError(f"{path}: larger than {MAX_RECORD_BYTES >> 20} MiB; "
                                  "refusing to read it")
            return f.read()
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except OSError as err:
        raise RecordError(f"{path}: cannot read: {err.strerror}") from None


def open_regular(path: str | os.PathLike, error: type[TinyFlowError] | None = None,
                 holds: str = "a record") -> Any:
    """`path` opened for reading in binary, refused unless it is a regular file (the
    saver opens checkpoints with it too: `error` CheckpointError, `holds` "a
    checkpoint").

    A FIFO would block the open (or the read) until another process writes to it,
    and /dev/zero never ends. O_NONBLOCK lets the open of a FIFO return at once, so
    the check is made on what was opened (fstat), not on a name that could change in
    between; for a regular file the flag changes nothing. Raises `error` (default
    RecordError) for a directory or a special file, OSError (FileNotFoundError, ...)
    as open() would.
    """
    error = error or RecordError
    path = os.fspath(path)
    if "\0" in path:  # open() would raise a bare ValueError
        raise error(f"{path!r}: a file name cannot contain a NUL character")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = (f"is a directory, not {holds}" if stat.S_ISDIR(mode) else
                f"not a regular file (a device, FIFO or socket cannot hold {holds})")
        raise error(f"{path}: {what}")
    return os.fdopen(fd, "rb")


def load(path: str | os.PathLike) -> dict:
    """Read and validate the record at `path`.

    Raises RecordError with a plain message (never a bare traceback) when the file
    is missing, empty, truncated, not JSON, too large, not a DebugRecord, written by
    a newer TinyFlow, or malformed (the message then names the offending path).
    """
    return loads(read_file(path), os.fspath(path))


def check_file(path: str | os.PathLike) -> list[str]:
    """Every problem of the record file at `path` (`tinyflow debug --check`); [] if valid.

    A file that cannot be read or parsed gives one problem, the reason; a parsed
    one gives every schema and reference problem, each with its JSON path.
    """
    try:
        record = parse(read_file(path), os.fspath(path))
    except RecordError as err:
        return [str(err)]
    return problems(record)


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
# lines, so a reader applies only the lines after them, and the document written at
# the end says ``"live_finished": true`` (nothing more will come). A timeline line refers to
# the schedule of the document written before it. `LiveReader` follows both files;
# `load_live` reads them once. A last line without its newline is still being
# written and is left for the next read.

LIVE_SUFFIX = ".live.jsonl"


def live_path(path: str | os.PathLike) -> str:
    """The JSON-lines file that goes with the record at `path`."""
    return os.fspath(path) + LIVE_SUFFIX


def live_line(kind: str, **fields: Any) -> str:
    """One line of the live file (with its newline); NaN/Inf written as null."""
    return _to_json({"kind": kind, **fields}) + "\n"


def live_scalar_lines(points: list[tuple[str, int, float]]) -> str:
    """The lines of scalar `points` ((name, step, value) each): the same text as
    ``live_line("scalar", name=name, step=step, value=value)`` one by one, built with
    a format string instead of the JSON encoder (a third of the cost: a training
    loop logs points every step). Python's float repr is the JSON encoder's."""
    quoted: dict[str, str] = {}
    lines = []
    for name, step, value in points:
        if name not in quoted:
            quoted[name] = json.dumps(name)
        number = repr(float(value)) if -MAX_VALUE <= value <= MAX_VALUE else "null"
        lines.append(f'{{"kind":"scalar","name":{quoted[name]},"step":{int(step)},'
                     f'"value":{number}}}\n')
    return "".join(lines)


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

    @property
    def finished(self) -> bool:
        """Whether the run wrote its final document (nothing more will be appended)."""
        return bool(self.record) and self.record.get("live_finished") is True

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
            _check_live_lines(self.record, self.path)
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
            with open_regular(self.lines_path) as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return False
        except OSError as err:
            raise RecordError(f"{self.lines_path}: cannot read: {err.strerror}") from None
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
        line = parse(raw, where)  # the same guards as a record (depth, huge numbers)
        kind = line.get("kind") if isinstance(line, dict) else None
        if kind not in ("scalar", "timeline"):
            raise RecordError(f"{where}.kind: expected 'scalar' or 'timeline', got "
                              f"{_brief(kind if isinstance(line, dict) else line)}")
        if kind == "scalar":
            self._apply_scalar(line, where)
        else:
            self._apply_timeline(line, where)

    def _apply_scalar(self, line: dict, where: str) -> None:
        name, step, value = line.get("name"), line.get("step"), line.get("value")
        if not (isinstance(name, str) and _is_step(step) and _is_value(value)):
            raise RecordError(f"{where}: a scalar line needs name (text), step (a whole "
                              f"number of at most {_MAX_STEP}) and value (a number of "
                              f"magnitude at most {MAX_VALUE:g}, or null), got "
                              f"{_brief(line)}")
        self.record["scalars"].setdefault(name, []).append([step, value])
        self.scalars_seen += 1

    def _apply_timeline(self, line: dict, where: str) -> None:
        record = self.record
        timeline = line.get("timeline")
        if timeline is None:
            raise RecordError(f"{where}: a timeline line needs its 'timeline'")
        candidate = {**record, "graphs": record["graphs"][-1:], "rewrites": [],
                     "timelines": [timeline], "scalars": {}, "check": None}
        try:
            validate(candidate)
        except RecordError as err:
            raise RecordError(f"{where}: {err}") from None
        record["timelines"] = (record["timelines"] + [timeline])[-self.max_runs:]


# The bounds record.schema.json puts on a scalar's step and value, so that a reader
# can turn them into floats (a step of 10**400 made the curves view overflow).
_MAX_STEP = 2**53 - 1
MAX_VALUE = 1e300


def _is_step(step: Any) -> bool:
    return type(step) is int and -_MAX_STEP <= step <= _MAX_STEP  # type(): not True


def _is_value(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and -MAX_VALUE <= value
                             <= MAX_VALUE)


def _check_live_lines(record: dict, path: str) -> None:
    """The document's ``live_lines`` (how many lines it already holds) must be a
    count; anything else would break the reader in the middle of a comparison."""
    count = record.get("live_lines", 0)
    if type(count) is not int or count < 0:
        raise RecordError(f"{path}: live_lines must be a whole number >= 0 (the lines of "
                          f"{live_path(path)} the document holds), got {_brief(count)}")


def _brief(value: Any) -> str:
    """`value` as JSON, cut to 80 characters, for an error message."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


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
