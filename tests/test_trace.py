"""The DebugRecord contract: schema round trip, validation messages, load errors, and
the Perfetto export read back and checked event by event."""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import sys

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import trace
from tinyflow.graph import Graph, Node

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
sys.path.insert(0, FIXTURES)
import make_record  # noqa: E402


@pytest.fixture(scope="module")
def record() -> dict:
    return trace.load(os.path.join(FIXTURES, "mlp.record.json"))


@pytest.fixture(scope="module")
def fresh() -> dict:
    """A record built now from the current tinyflow (not the committed file), with a
    diverged loss and a non-finite value summary written in, as a NaN run has."""
    record = make_record.mlp_record()
    record["scalars"]["loss"].append([len(record["scalars"]["loss"]), float("nan")])
    event = next(e for e in record["timelines"][0]["events"] if e["summary"])
    event["summary"].update(min=float("-inf"), mean=float("nan"), nan=3, inf=1)
    return record


# -- building ---------------------------------------------------------------------------

def test_graph_to_dict_order_bytes_and_attrs():
    x = tf.placeholder(tf.float32, (4, 3), name="gx")
    c = tf.constant(np.arange(60, dtype=np.float32).reshape(20, 3))
    long_attr = Node("reshape", (x,), {"shape": tuple(range(40)), "dt": np.dtype("int64"),
                                       "k": np.int64(3)}, shape=(12,), dtype=np.float32)
    unknown = Node("relu", (long_attr,), shape=(None, 3), dtype=np.float32)
    y = unknown + 0.0
    entry = trace.graph_to_dict(Graph([y, c]), "input", 0, 0.5, False)
    ids = [n["id"] for n in entry["nodes"]]
    for position, node in enumerate(entry["nodes"]):
        for inp in node["inputs"]:
            assert ids.index(inp) < position, "inputs come before their consumers"
    by_id = {n["id"]: n for n in entry["nodes"]}
    assert by_id["gx"]["bytes"] == 4 * 3 * 4 and by_id["gx"]["shape"] == [4, 3]
    assert by_id[c.name]["bytes"] == 20 * 3 * 4
    assert by_id[c.name]["attrs"]["value"] == "array(20x3 float32)"
    shortened = by_id[long_attr.name]["attrs"]
    assert len(shortened["shape"]) == trace.MAX_ATTR_ITEMS + 1
    assert shortened["shape"][-1] == f"... (+{40 - trace.MAX_ATTR_ITEMS} more)"
    assert shortened["dt"] == "int64" and shortened["k"] == 3
    assert by_id[unknown.name]["shape"] is None and by_id[unknown.name]["bytes"] == 0
    assert entry["outputs"] == [y.name, c.name]
    json.dumps(entry, allow_nan=False)  # plain JSON all the way down


def test_fresh_record_from_current_tinyflow_is_valid(fresh):
    trace.validate(fresh)
    assert fresh["graphs"][0]["pass"] == "input"   # the contract: graphs[0] is the input
    assert len(fresh["timelines"]) == 3 and fresh["schedule"]
    ops = {n["op"] for n in fresh["graphs"][0]["nodes"]}
    assert {"matmul", "relu", "assign", "softmax_cross_entropy"} <= ops
    phases = {n["phase"] for n in fresh["graphs"][0]["nodes"]}
    assert phases == {"forward", "backward"}


# -- round trip ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["r.json", "r.json.gz"])
def test_save_load_round_trip(tmp_path, fresh, name):
    path = tmp_path / name
    trace.save(fresh, path)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")
    back = trace.load(path)
    # NaN (the diverged loss, the NaN summaries) comes back as null; all else equal.
    losses = [v for _, v in fresh["scalars"]["loss"]]
    assert any(math.isnan(v) for v in losses)
    assert [v for _, v in back["scalars"]["loss"]] == [None if math.isnan(v) else v
                                                       for v in losses]
    bad = [e for e in back["timelines"][0]["events"] if e["summary"] and e["summary"]["nan"]]
    assert bad and all(e["summary"]["mean"] is None for e in bad)
    assert back["graphs"] == json.loads(json.dumps(fresh["graphs"]))
    assert back["schedule"] == fresh["schedule"]
    assert back["memory_plan"] == fresh["memory_plan"]
    assert back["timelines"][1:] == fresh["timelines"][1:]
    assert back["meta"] == fresh["meta"]


def test_save_validates_first_and_writes_nothing(tmp_path, record):
    broken = copy.deepcopy(record)
    broken["schedule"][3]["stream"] = 99
    path = tmp_path / "x.json"
    with pytest.raises(trace.RecordError, match=r"schedule\[3\]\.stream: stream 99"):
        trace.save(broken, path)
    assert not path.exists() and not list(tmp_path.iterdir())


# -- validation messages --------------------------------------------------------------------

def _set(path):
    """A mutation that sets the value at a path of keys/indices."""
    *parents, last = path

    def mutate(record, value):
        target = record
        for key in parents:
            target = target[key]
        target[last] = value
    return mutate


CASES = [
    (("graphs", 2, "nodes", 5, "shape"), "x",
     "graphs[2].nodes[5].shape: \"x\" is not of types \"null\", \"array\""),
    (("graphs", 0, "nodes", 2, "shape"), [3, -1],
     "graphs[0].nodes[2].shape[1]: -1 is less than the minimum of 0"),
    (("graphs", 1, "nodes", 4, "inputs"), ["nowhere"],
     "graphs[1].nodes[4].inputs[0]: input 'nowhere' is not a node listed before"),
    (("graphs", 0, "nodes", 3, "phase"), "sideways",
     "graphs[0].nodes[3].phase: \"sideways\" is not one of \"forward\" or \"backward\""),
    (("graphs", 0, "outputs"), ["ghost"],
     "graphs[0].outputs[0]: output 'ghost' is not a node of this graph"),
    (("graphs", 0, "changed"), 1, "graphs[0].changed: 1 is not of type \"boolean\""),
    (("schedule", 4, "node"), "ghost",
     "schedule[4].node: node 'ghost' is not a node of the last graph"),
    (("memory_plan", "tensors", 2, "inplace_of"), "ghost",
     "memory_plan.tensors[2].inplace_of: node 'ghost' is not a node of the last graph"),
    (("memory_plan", "tensors", 2, "kind"), "heap",
     "memory_plan.tensors[2].kind: \"heap\" is not one of \"intermediate\", \"feed\""),
    (("timelines", 0, "events", 7, "start"), float("nan"),
     "timelines[0].events[7].start: null is not of type \"number\""),
    (("timelines", 1, "events", 0, "end"), -1.0,
     "timelines[1].events[0].end: ends (-1.0) before it starts"),
    (("scalars", "loss", 2), [2], "scalars.loss[2]: [2] has less than 2 items"),
    (("meta", "title"), None, "meta.title: null is not of type \"string\""),
    (("check",), {"node": "ghost", "where": "", "message": ""},
     "check.node: node 'ghost' is not a node of the last graph"),
    (("format",), "something.else", "format: expected 'tinyflow.debugrecord'"),
    (("version",), 2, "written by a newer TinyFlow (version 2 > 1)"),
]


@pytest.mark.parametrize("path,value,message", CASES, ids=[".".join(map(str, c[0]))
                                                           for c in CASES])
def test_validate_names_the_offending_path(record, path, value, message):
    broken = copy.deepcopy(record)
    _set(path)(broken, value)
    with pytest.raises(trace.RecordError) as info:
        trace.validate(broken)
    assert message in str(info.value)


def test_validate_cross_references_of_waits_and_streams(record):
    broken = copy.deepcopy(record)
    waiting = next(e for e in broken["schedule"] if e["waits"])
    waiting["waits"][0]["step"] = waiting["step"]  # waits on itself: not an earlier step
    with pytest.raises(trace.RecordError, match=r"waits\[0\]\.step: step \d+ is not an earlier"):
        trace.validate(broken)
    broken = copy.deepcopy(record)
    broken["streams"] = broken["streams"][:1]
    with pytest.raises(trace.RecordError, match="is not listed in 'streams'"):
        trace.validate(broken)
    broken = copy.deepcopy(record)
    del broken["memory_plan"]
    with pytest.raises(trace.RecordError, match='record: missing key "memory_plan"'):
        trace.validate(broken)


# -- load errors --------------------------------------------------------------------------

def test_load_errors_are_plain_messages(tmp_path, record):
    text = json.dumps(record)
    cases = {
        "missing.json": (None, "no such file"),
        "empty.json": (b"", "the file is empty"),
        "notjson.json": (b"hello, I am a text file", "not a DebugRecord: invalid JSON"),
        "truncated.json": (text[: len(text) // 2].encode(), "the file is truncated"),
        "truncated.json.gz": (gzip.compress(text.encode())[:500], "gzip data is truncated"),
        # (it said "format is 'list'", as if the file had a format field: new-user pass)
        "list.json": (b"[1, 2, 3]", "not a TinyFlow debug record (the file holds a JSON "
                                    "array, not an object)"),
        "number.json": (b"3", "(the file holds a JSON number, not an object)"),
        "other.json": (b'{"format": "chrome.trace"}',
                       "not a TinyFlow debug record (format is 'chrome.trace'"),
        "newer.json": (json.dumps({**record, "version": 2}).encode(),
                       "written by a newer TinyFlow (version 2 > 1)"),
        "binary.bin": (bytes(range(256)), "not JSON text"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(trace.RecordError) as info:
            trace.load(path)
        assert message in str(info.value), name
        assert str(path) in str(info.value), name
    broken = copy.deepcopy(record)
    broken["graphs"][1]["nodes"][0]["bytes"] = "many"
    (tmp_path / "bad.json").write_text(json.dumps(broken))
    with pytest.raises(trace.RecordError, match=r"malformed record: graphs\[1\]\.nodes\[0\]"
                                                r"\.bytes: \"many\" is not of type \"integer\""):
        trace.load(tmp_path / "bad.json")


# -- Perfetto -----------------------------------------------------------------------------

def test_perfetto_export_loaded_back(tmp_path, record):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace.to_perfetto(record, run=1)))
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    timeline = record["timelines"][1]

    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {s["id"]: s["name"] for s in record["streams"]}
    assert "comm" in names.values()

    slices = [e for e in events if e["ph"] == "X"]
    for stream in names:
        want = sorted((ev["start"], ev["node"]) for ev in timeline["events"]
                      if ev["stream"] == stream)
        got = sorted((e["ts"], e["name"]) for e in slices if e["tid"] == stream)
        assert [n for _, n in got] == [n for _, n in want]
        assert all(abs(ts - s * 1e6) < 1e-2 for (ts, _), (s, _) in zip(got, want))
    shapes = {n["id"]: n["shape"] for n in record["graphs"][-1]["nodes"]}
    for e in slices:
        assert e["dur"] >= 0 and set(e["args"]) >= {"node", "op", "shape", "bytes", "summary"}
        assert e["args"]["shape"] == shapes[e["args"]["node"]]

    # Flows: one s/f pair per cross-stream wait, bound inside producer and consumer.
    at = {ev["step"]: ev for ev in timeline["events"] if ev["step"] is not None}
    waits = [(w["step"], e["step"]) for e in record["schedule"] for w in e["waits"]]
    assert waits, "the fixture has cross-stream waits"
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(finishes) == len(waits) and starts.keys() == finishes.keys()
    for (producer, consumer), flow in zip(waits, sorted(starts)):
        s, f = starts[flow], finishes[flow]
        p, c = at[producer], at[consumer]
        assert s["tid"] == p["stream"] != f["tid"] == c["stream"]
        assert p["start"] * 1e6 - 1e-3 <= s["ts"] <= p["end"] * 1e6 + 1e-3
        assert f["bp"] == "e" and abs(f["ts"] - c["start"] * 1e6) < 1e-2
        assert s["ts"] <= f["ts"] + 1e-3, "a step never starts before what it waits on"

    # Counter: arena bytes in use at each step's start, brute force from the plan.
    plan = record["memory_plan"]
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all(e["name"] == "arena bytes in use" for e in counters)
    def in_use(step: int) -> int:
        # An in-place tensor shares its input's bytes at the step that writes it.
        return sum(t["nbytes"] for t in plan["tensors"] if t["offset"] is not None
                   and t["first_step"] + (t["inplace_of"] is not None) <= step
                   <= t["last_step"])
    expected = sorted((round(ev["start"] * 1e6, 3), in_use(ev["step"]))
                      for ev in timeline["events"] if ev["step"] is not None)
    got = sorted((e["ts"], e["args"]["bytes"]) for e in counters[:-1])
    assert got == expected
    assert max(b for _, b in got) <= plan["arena_bytes"]
    assert counters[-1]["args"]["bytes"] == 0


def test_perfetto_needs_a_timeline(record):
    bare = {**record, "timelines": []}
    with pytest.raises(trace.RecordError, match="no timeline"):
        trace.to_perfetto(bare)
    with pytest.raises(trace.RecordError, match="no run index 5"):
        trace.to_perfetto(record, run=5)


# -- the JSON Schema (record.schema.json) -------------------------------------------------


def test_the_schema_file_is_a_valid_draft_2020_12_schema():
    import jsonschema
    import jsonschema_rs
    schema = trace.schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)  # the metaschema check
    jsonschema_rs.meta.validate(schema)
    # Every property documents itself.
    def undocumented(node, path):
        for key, sub in node.get("properties", {}).items():
            if "description" not in sub and "$ref" not in sub:
                yield f"{path}.{key}"
            yield from undocumented(sub, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from undocumented(node[key], path + "[]")
    found = list(undocumented(schema, "record"))
    for name, sub in schema["$defs"].items():
        found += undocumented(sub, name)
    assert found == []


def _records_tinyflow_writes(tmp_path) -> dict:
    """One record of every kind TinyFlow writes today."""
    from tinyflow import eager as E
    from tinyflow.rank_trace import merge_records, scheme_record
    records = {name: json.load(open(os.path.join(FIXTURES, name)))
               for name in ("mlp.record.json", "mlp_nan.record.json")}
    records["make_record.mlp_record"] = json.loads(trace.dumps(make_record.mlp_record()))
    records["merged two ranks"] = merge_records([make_record.mlp_record(),
                                                 make_record.mlp_record()])
    records["pipeline and collectives"] = scheme_record(
        [{"node": "F0", "stream": "rank0/compute", "start": 1.0, "end": 1.5, "op": "F"},
         {"node": "send", "stream": "rank1/comm", "start": 1.2, "end": 1.3,
          "bytes": 64, "args": {"rank": 1, "dst": 0}}], "scheme")
    model = E.to_eager(tf.nn.MLP([4, 3]))
    path = tmp_path / "eager.json"
    with tf.debug.record(path) as rec:
        loss = E.tensor(np.ones((2, 4), np.float32))
        out = model(loss).sum()
        out.backward()
        rec.scalar("loss", 0, out.item())
    records["eager"] = json.loads(path.read_text())
    script = os.path.join(os.path.dirname(FIXTURES), "..", "tutorials", "train_mlp.py")
    out = tmp_path / "train.json"
    import subprocess
    done = subprocess.run([sys.executable, script, "--quick", "--epochs", "1", "--trace",
                           str(out), "--checkpoint", str(tmp_path / "m.safetensors")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(
                              os.path.dirname(tf.__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    records["tinyflow train mlp --trace"] = json.loads(out.read_text())
    return records


def test_every_record_tinyflow_writes_matches_the_schema(tmp_path):
    import jsonschema
    validator = jsonschema.Draft202012Validator(trace.schema())
    records = _records_tinyflow_writes(tmp_path)
    assert records["eager"]["memory_plan"]["strategy"] == "caching allocator"
    assert records["eager"]["graphs"][0]["pass"] == "eager"
    assert any(s["name"].startswith("rank1/") for s in records["merged two ranks"]["streams"])
    for name, record in records.items():
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(record)]
        assert errors == [], name
        assert trace.problems(record) == [], name


def test_free_form_extensions_validate(record):
    """Tools add keys (another scalar series, a section of their own): still valid."""
    extended = copy.deepcopy(record)
    extended["live"] = {"format": "jsonl", "appended": 3}
    extended["scalars"]["throughput/images_per_s"] = [[0, 812.5], [1, None]]
    extended["timelines"][0]["events"][0]["args"] = {"anything": [1, {"x": 2}]}
    extended["meta"]["host"] = "box"
    trace.validate(extended)


def test_problems_lists_every_problem_with_its_path(record):
    broken = copy.deepcopy(record)
    broken["graphs"][0]["nodes"][1]["op"] = 3
    broken["streams"][0]["name"] = None
    del broken["meta"]["created"]
    found = trace.problems(broken)
    assert 'graphs[0].nodes[1].op: 3 is not of type "string"' in found
    assert 'streams[0].name: null is not of type "string"' in found
    assert 'meta: missing key "created"' in found
    with pytest.raises(trace.RecordError, match=r"\(and 2 more problems\)"):
        trace.validate(broken)


# -- issue 14 item 17: records that hung or escaped as other exceptions ----------------


def test_a_huge_schedule_step_is_refused_so_readers_cannot_loop(record):
    """Before: validate passed, then live_bytes_per_step looped over range(10**12)."""
    broken = copy.deepcopy(record)
    last = broken["schedule"][-1]["step"]
    broken["schedule"][-1]["step"] = 10**12
    for timeline in broken["timelines"]:  # keep every other reference consistent
        for event in timeline["events"]:
            if event["step"] == last:
                event["step"] = 10**12
    with pytest.raises(trace.RecordError, match=r"schedule\[\d+\]\.step: step 1000000000000 "
                                                r"is not below the number of steps"):
        trace.validate(broken)
    broken = copy.deepcopy(record)
    broken["memory_plan"]["tensors"][0]["last_step"] = 2**60
    with pytest.raises(trace.RecordError, match="is greater than the maximum"):
        trace.validate(broken)


@pytest.mark.parametrize("text,message", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "tinyflow.debugrecord", "version": 1, "x": ' + "9" * 5000 + "}",
     "not a DebugRecord"),
    ('{"format": "tinyflow.debugrecord", "version": 1, "x": NaN}', "not a DebugRecord"),
], ids=["deep_nesting", "5000_digit_int", "nan_literal"])
def test_hostile_json_is_a_record_error(tmp_path, text, message):
    path = tmp_path / "hostile.json"
    path.write_text(text)
    with pytest.raises(trace.RecordError, match=message):
        trace.load(path)


def test_a_401_digit_number_in_a_record_is_a_record_error(tmp_path, record):
    text = json.dumps(record).replace('"start":', '"start":' + "1" * 401 + ",\"s\":", 1)
    path = tmp_path / "big.json"
    path.write_text(text)
    with pytest.raises(trace.RecordError, match=r"start: 1{20,}.* is greater than the maximum"):
        trace.load(path)


def test_a_gzip_bomb_is_refused_without_inflating_it_all(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "MAX_RECORD_BYTES", 1 << 20)
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b'{"format": "tinyflow.debugrecord", "x": "'
                                   + b" " * (8 << 20) + b'"}'))
    assert path.stat().st_size < 100_000
    with pytest.raises(trace.RecordError, match="inflates to more than 1 MiB"):
        trace.load(path)


# -- regression tests for probes of bad input ---------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    # A FIFO blocked trace.load forever (and `debug --check`); /dev/zero never ended.
    path = {"fifo": tmp_path / "fifo", "device": "/dev/zero", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    message = "is a directory" if kind == "directory" else "not a regular file"
    with pytest.raises(trace.RecordError, match=message):
        trace.load(path)
    assert message in trace.check_file(path)[0]


def test_a_live_lines_file_that_is_a_fifo_is_refused(tmp_path, record):
    path = tmp_path / "live.json"
    trace.save(record, path)
    os.mkfifo(trace.live_path(path))
    with pytest.raises(trace.RecordError, match="not a regular file"):
        trace.load_live(path)


@pytest.mark.parametrize("old,new", [
    ('"end":', '"end":1e999,"x":'),
    ('"max":', '"max":-1e999,"x":'),
], ids=["event_end", "summary_max"])
def test_a_number_too_large_for_a_float_is_refused(record, old, new):
    # 1e999 parsed as inf and was accepted (or reported as `null is not of type
    # "number"`); the Perfetto export then wrote the invalid JSON `Infinity`.
    text = json.dumps(record).replace(old, new, 1)
    with pytest.raises(trace.RecordError, match=r"the number '-?1e999' at line 1, column "
                                                r"\d+ is too large in magnitude for a float"):
        trace.loads(text, "r.json")


def test_a_scalar_value_too_large_for_a_float_is_refused(record):
    text = json.dumps(record)
    text = text.replace('"scalars": {', '"scalars": {"big": [[0, 1e999]], ', 1)
    assert "1e999" in text
    with pytest.raises(trace.RecordError, match="too large in magnitude"):
        trace.loads(text, "r.json")


def test_a_file_of_one_garbage_character_is_not_json_not_truncated(tmp_path):
    path = tmp_path / "onechar.json"
    path.write_text("x")
    with pytest.raises(trace.RecordError, match="the file is not JSON .it starts with 'x'"):
        trace.load(path)
    path.write_text('{"format": 1} x')  # a whole value, then more: not truncated either
    with pytest.raises(trace.RecordError, match="Extra data"):
        trace.load(path)


def _live(tmp_path, record, lines="", **extra):
    path = tmp_path / "live.json"
    path.write_text(json.dumps({**record, **extra}))
    (tmp_path / ("live.json" + trace.LIVE_SUFFIX)).write_text(lines)
    return path


@pytest.mark.parametrize("count", ["3", {}, None, -5, True])
def test_live_lines_that_is_not_a_count_is_a_record_error(tmp_path, record, count):
    # It was compared with an int: a bare TypeError, which --follow did not catch.
    path = _live(tmp_path, record, live_lines=count)
    with pytest.raises(trace.RecordError, match="live_lines must be a whole number >= 0"):
        trace.load_live(path)


@pytest.mark.parametrize("step,value", [(10**400, 1), (-10**300, 1), (2**53, 1),
                                        (1, 10**400)])
def test_a_live_scalar_out_of_a_float_range_is_a_record_error(tmp_path, record, step, value):
    # A step of 10**400 passed LiveReader and overflowed in the curves view.
    line = json.dumps({"kind": "scalar", "name": "loss", "step": step, "value": value})
    path = _live(tmp_path, record, line + "\n")
    with pytest.raises(trace.RecordError, match="a scalar line needs name"):
        trace.load_live(path)


def test_a_live_scalar_at_the_bounds_is_read(tmp_path, record):
    lines = trace.live_scalar_lines([("loss", 2**53 - 1, 1e300), ("loss", -(2**53 - 1), -1e300)])
    path = _live(tmp_path, record, lines)
    assert trace.load_live(path)["scalars"]["loss"][-2:] == [[2**53 - 1, 1e300],
                                                             [-(2**53 - 1), -1e300]]


def test_a_recorded_timeline_says_which_training_step_it_was(tmp_path):
    # Timelines were numbered by their program's own runs only; after an epoch's
    # short last batch (another program) run N was no longer step N, and the
    # debugger's curves cursor picked the wrong timeline. The run before a scalar
    # of step N is logged is step N's.
    x = tf.placeholder(tf.float32, (None, 2))
    y = tf.reduce_sum(x * 2.0)
    sess = tf.Session()
    path = tmp_path / "steps.tfdbg.json"
    with tf.debug.record(path):
        for step, batch in enumerate([4, 4, 3, 4]):      # the 3 compiles a second program
            loss = sess.run(y, {x: np.ones((batch, 2), np.float32)})
            tf.debug.scalar("loss", step + 10, loss)
    record = tf.trace.load(path)
    steps = {t["run"]: t.get("step") for t in record["timelines"]}
    assert steps == {0: 10, 1: 11, 2: 13}    # the main program's runs, by step


def test_a_followed_live_record_says_when_the_run_finished(tmp_path):
    # A follower could not tell a run that ended from one still running ("following"
    # stayed on); the final document now says live_finished.
    x = tf.placeholder(tf.float32, (2,))
    sess = tf.Session()
    path = tmp_path / "live.tfdbg.json"
    recorder = tf.debug.record(path, live=True)
    with recorder:
        sess.run(x * 2.0, {x: np.ones(2, np.float32)})
        tf.debug.scalar("loss", 0, 1.0)
        tf.debug.current().flush()
        reader = tf.trace.LiveReader(path)
        reader.poll()
        assert reader.record is not None and not reader.finished
    reader.poll()
    assert reader.finished


def test_a_diverging_loss_beyond_the_schemas_bound_is_recorded_as_null(tmp_path):
    # Review: a finite loss of 1e301 (a run blowing up) was written into the live
    # lines, which the follower then refused (the schema bounds shown values at
    # 1e300), and the record's final save failed its own validation: the whole
    # record was lost at the end of training. It is null now, as NaN and Inf are.
    x = tf.placeholder(tf.float64, (2,))
    y = tf.reduce_sum(x * x)
    sess = tf.Session()
    path = tmp_path / "big.tfdbg.json"
    with tf.debug.record(path, live=True):
        for step, loss in enumerate([1.0, 1e301, -1e305]):
            sess.run(y, {x: [1.0, 0.0]})
            tf.debug.scalar("loss", step, loss)
    assert tf.trace.load(path)["scalars"]["loss"] == [[0, 1.0], [1, None], [2, None]]
    reader = tf.trace.LiveReader(path)
    reader.poll()
    assert reader.record["scalars"]["loss"][1:] == [[1, None], [2, None]]


def test_a_timeline_is_tied_to_its_step_with_an_evaluation_run_in_between(tmp_path):
    # Review: the step went to the very last run before the scalar; with an
    # evaluation run in between (sess.run(train); sess.run(loss); scalar) that was
    # the other program's, and the training program's timelines got no step.
    x = tf.placeholder(tf.float32, (4, 2))
    w = tf.Variable(np.ones((2, 1), np.float32))
    loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    path = tmp_path / "eval.tfdbg.json"
    feed = {x: np.ones((4, 2), np.float32)}
    with tf.debug.record(path):
        for step in range(3):
            for _ in range(2):
                sess.run(train, feed)          # the main program runs most
            tf.debug.scalar("loss", step, sess.run(loss, feed))
    steps = [t.get("step") for t in tf.trace.load(path)["timelines"]]
    assert steps == [None, 0, None, 1, None, 2]   # each step's last training run


def test_a_gradient_node_names_its_forward_op_in_the_record(tmp_path):
    # The debugger placed gradients in layers by a heuristic (the values they read),
    # which misplaced some; the record now says which op's rule built each one.
    x = tf.placeholder(tf.float32, (2, 3))
    w = tf.Variable(np.ones((3, 4), np.float32), name="w")
    hidden = tf.tanh(tf.matmul(x, w))
    (g,) = tf.gradients(tf.reduce_sum(hidden), [w])
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    path = tmp_path / "grad_of.tfdbg.json"
    with tf.debug.record(path):
        sess.run(g, {x: np.ones((2, 3), np.float32)})
    record = tf.trace.load(path)
    nodes = {n["id"]: n for n in record["graphs"][0]["nodes"]}
    of = {n["op"]: nodes[n["grad_of"]]["op"] for n in nodes.values() if "grad_of" in n}
    assert of["matmul"] == "matmul" and of["sub"] == "tanh"   # tanh's 1 - y^2
    assert all(nodes[n["grad_of"]]["phase"] == "forward"
               for n in nodes.values() if "grad_of" in n)
