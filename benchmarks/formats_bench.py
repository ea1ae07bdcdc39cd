"""The cost of the file formats: DebugRecord validation and safetensors checkpoints.

Issue 22 moved two hand-written formats onto libraries: the DebugRecord is checked
against ``tinyflow/record.schema.json`` (with jsonschema-rs) and checkpoints are
safetensors files. These figures say what that costs, each as a ratio to a reference
measured in the same run:

``record_validate_over_pure_python_jsonschema``
    `trace.validate` (the schema through jsonschema-rs, plus the reference and step
    checks) on a 10,000-node record, over the pure-Python ``jsonschema`` validating
    the same record against the same schema (why the Rust one was chosen).
``record_load_over_json_parse``
    `trace.loads` (parse + validate) over a bare ``json.loads`` of the same text.
``checkpoint_save_over_np_save`` / ``checkpoint_restore_over_np_load``
    `Saver.save` (safetensors, CRC-32, fsync, atomic rename) and `Saver.restore`
    (map the file, header and CRC-32 checks, shape checks, one copy into each
    Variable's buffer) of 64 MiB of float32 Variables, over ``np.save`` (with fsync)
    / ``np.load`` of the same arrays to one ``.npy`` each; the median over rounds in
    which both run, one after the other, so that load from other processes hits both.

``--quick`` uses 1,000 nodes and 4 MiB.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from core_bench import paired_ratio, time_interleaved  # benchmarks/ is on sys.path


def best_of(fn: Any, repeat: int = 3) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def synthetic_record(n: int) -> dict:
    """A valid record of an `n`-node chain: graph, schedule, plan and a timeline."""
    from tinyflow import trace
    record = trace.empty_record(f"chain of {n}")
    nodes = [{"id": f"n{i}", "op": "tanh" if i else "placeholder",
              "inputs": [f"n{i - 1}"] if i else [], "shape": [32, 64], "dtype": "float32",
              "bytes": 8192, "where": "bench.py:1", "attrs": {"k": i},
              "provenance": [], "phase": "forward"} for i in range(n)]
    record["graphs"] = [{"pass": "input", "index": 0, "seconds": 0.0, "changed": False,
                         "nodes": nodes, "outputs": [f"n{n - 1}"]}]
    record["schedule"] = [{"step": i, "node": f"n{i}", "op": "tanh", "stream": 0,
                           "waits": [], "records_event": None} for i in range(n)]
    record["memory_plan"] = {
        "strategy": "greedy", "arena_bytes": 16384, "naive_bytes": 8192 * n,
        "lower_bound_bytes": 16384, "alignment": 64, "strategies": {"greedy": 16384},
        "tensors": [{"node": f"n{i}", "offset": 8192 * (i % 2), "nbytes": 8192,
                     "first_step": i, "last_step": min(i + 1, n - 1), "inplace_of": None,
                     "kind": "intermediate", "reason": "reuse"} for i in range(n)]}
    record["timelines"] = [{"run": 0, "label": "run 0", "events": [
        {"step": i, "node": f"n{i}", "op": "tanh", "stream": 0, "start": i * 1e-5,
         "end": i * 1e-5 + 5e-6, "bytes": 8192,
         "summary": {"min": -1.0, "max": 1.0, "mean": 0.0, "nan": 0, "inf": 0}}
        for i in range(n)]}]
    record["scalars"] = {"loss": [[i, 1.0 / (i + 1)] for i in range(100)]}
    return record


def record_figures(n: int) -> list[dict]:
    from tinyflow import trace
    record = synthetic_record(n)
    text = trace.dumps(record)
    ours = best_of(lambda: trace.validate(record))
    try:
        import jsonschema
    except ImportError:
        python_ratio, python_note = math.nan, "skipped: jsonschema is not installed"
    else:
        validator = jsonschema.Draft202012Validator(trace.schema())
        reference = best_of(lambda: list(validator.iter_errors(record)), repeat=1)
        python_ratio = ours / reference
        python_note = (f"{n} nodes: trace.validate {ours * 1e3:.0f} ms, pure-Python "
                       f"jsonschema {reference * 1e3:.0f} ms")
    load = best_of(lambda: trace.loads(text))
    parse = best_of(lambda: json.loads(text))
    return [
        {"name": "record_validate_over_pure_python_jsonschema", "value": python_ratio,
         "goal": "<= 0.2", "unit": "x", "note": python_note},
        {"name": "record_load_over_json_parse", "value": load / parse, "goal": "<= 6",
         "unit": "x", "note": f"{n} nodes, {len(text) / 1e6:.1f} MB: trace.loads "
         f"{load * 1e3:.0f} ms, json.loads {parse * 1e3:.0f} ms"},
    ]


def checkpoint_figures(mib: int) -> list[dict]:
    import tinyflow as tf
    from tinyflow.saver import Saver
    count = 8
    size = mib * 2**20 // 4 // count
    variables = [tf.Variable(np.random.default_rng(k).random(size, np.float32),
                             name=f"bench_w{k}") for k in range(count)]
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    saver = Saver(variables)
    arrays = [sess.variables[v] for v in variables]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.safetensors")

        def np_save() -> None:  # flushed to disk too, as Saver.save is
            for k, a in enumerate(arrays):
                with open(os.path.join(folder, f"a{k}.npy"), "wb") as f:
                    np.save(f, a)
                    f.flush()
                    os.fsync(f.fileno())

        def np_load() -> list[np.ndarray]:
            return [np.load(os.path.join(folder, f"a{k}.npy")) for k in range(count)]

        # The warm-up round writes the files that the restores and loads then read.
        times = time_interleaved({"save": lambda: saver.save(sess, path),
                                  "np_save": np_save}, warmup=1, rounds=7)
        times |= time_interleaved({"restore": lambda: saver.restore(sess, path),
                                   "np_load": np_load}, warmup=1, rounds=11)
    ms = {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()}
    note = f"{count} float32 Variables, {mib} MiB, medians"
    return [
        {"name": "checkpoint_save_over_np_save", "goal": "<= 3", "unit": "x",
         "value": paired_ratio(times["save"], times["np_save"]),
         "note": f"{note}: Saver.save {ms['save']:.0f} ms, np.save {ms['np_save']:.0f} ms"},
        {"name": "checkpoint_restore_over_np_load", "goal": "<= 3", "unit": "x",
         "value": paired_ratio(times["restore"], times["np_load"]),
         "note": f"{note}: Saver.restore {ms['restore']:.0f} ms, np.load "
                 f"{ms['np_load']:.0f} ms"},
    ]


def figures(quick: bool = False) -> list[dict]:
    return record_figures(1_000 if quick else 10_000) + checkpoint_figures(4 if quick else 64)


if __name__ == "__main__":
    for row in figures():
        print(f"{row['name']:48s} {row['value']:8.3f} {row['goal']:>8s}  {row['note']}")
