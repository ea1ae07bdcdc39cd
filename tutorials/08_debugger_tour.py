# %% [markdown]
# # Lesson 8: a tour of the debugger
#
# Every lesson so far asked one layer a question: what did the passes do, where
# did the memory go, what ran where and when. A **DebugRecord** keeps all the
# answers for one program in one file: the graph after every pass with the rewrite
# records, the schedule and its streams, the memory plan, the timelines of the
# last runs, scalars you logged (the loss), and the first NaN if check mode found
# one. TinyFlow writes it; the terminal debugger (`viz/`) only reads it. The file
# is plain JSON, versioned, so records can be mailed around and opened anywhere.
#
# In this lesson you will
#
# 1. record a few training steps with `tf.debug.record`;
# 2. open the record as data with `tinyflow.trace`: load, validate, look at each
#    section, export a timeline for Perfetto;
# 3. open it in the debugger (`tinyflow debug FILE`), and peek at the debugger's
#    first screen without leaving this script.
#
# **Read along:** `tinyflow/debug.py` (the recorder, short), the schema at the top
# of `tinyflow/trace.py` (it is the contract between the two halves), and
# `viz/app.py`'s docstring and help text for the keys.

# %%
import getpass
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

import tinyflow as tf
from tinyflow import trace
from tinyflow.backend import set_blas_threads

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

# The record stays after the lesson, for you to open in the debugger (section 3),
# in a folder of your own that every run of the lesson empties and refills: runs
# do not pile up in the temporary folder.
folder = Path(tempfile.gettempdir()) / f"tinyflow_lesson8_{getpass.getuser()}"
shutil.rmtree(folder, ignore_errors=True)
folder.mkdir()
record_path = folder / "mlp.tfdbg.json"

# %% [markdown]
# ## 1. Record a training run
#
# Inside `with tf.debug.record(path) as rec:` every `Session.run` is compiled with
# tracing on. When the block ends, the record of the program that ran most often
# (the training step) is written. `rec.scalar(name, step, value)` logs a curve.

# %%
rng = np.random.default_rng(0)
centers = rng.normal(size=(4, 16)).astype(np.float32) * 0.6
labels = rng.integers(0, 4, 256)
points = (centers[labels] + rng.normal(size=(256, 16))).astype(np.float32)

x = tf.placeholder(tf.float32, (None, 16), name="x")
y = tf.placeholder(tf.int64, (None,), name="y")
model = tf.nn.MLP([16, 32, 32, 4])
loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(model(x), y)
train_op = tf.train.AdamOptimizer(0.01).minimize(loss)

sess = tf.Session(streams=2)           # two streams, so the timeline has two lanes
sess.run(tf.global_variables_initializer())
with tf.debug.record(record_path, title="lesson 8 MLP") as rec:
    for step in range(20):
        batch = rng.choice(256, 64, replace=False)
        step_loss, _ = sess.run([loss, train_op], {x: points[batch], y: labels[batch]})
        rec.scalar("loss", step, step_loss)
print(f"wrote {record_path} ({record_path.stat().st_size / 1024:.0f} KiB)")

# %% [markdown]
# ## 2. The record is data
#
# `trace.load` reads and validates a record (a bad file gives a plain message
# naming what is wrong, never a traceback from deep inside). Here is what each
# section holds.

# %%
record = trace.load(record_path)
print("format:", record["format"], "version", record["version"])
print("meta:", {k: record["meta"][k] for k in ("title", "device", "tinyflow_version")})

print("\ngraphs, one per pass:")
for graph in record["graphs"]:
    print(f"  {graph['index']:>2} {graph['pass']:<17}{len(graph['nodes']):>4} nodes"
          f"{'  (changed)' if graph['changed'] else ''}")
print(f"rewrites: {len(record['rewrites'])}, e.g. {record['rewrites'][0]['reason']!r}")

print("\nstreams:", [s["name"] for s in record["streams"]])
waits = sum(len(entry["waits"]) for entry in record["schedule"])
print(f"schedule: {len(record['schedule'])} steps, {waits} cross-stream waits")

plan = record["memory_plan"]
print(f"memory plan: {plan['strategy']}, arena {plan['arena_bytes']} B, "
      f"lower bound {plan['lower_bound_bytes']} B, naive {plan['naive_bytes']} B")

timelines = record["timelines"]
print(f"timelines: {len(timelines)} runs, {len(timelines[-1]['events'])} events in the last")
losses = record["scalars"]["loss"]
print(f"scalars: loss from {losses[0][1]:.3f} (step 0) to {losses[-1][1]:.3f} "
      f"(step {losses[-1][0]})")

assert len(record["graphs"]) >= 2 and record["graphs"][0]["pass"] == "input"
assert len(losses) == 20 and losses[-1][1] < losses[0][1]
assert len(record["streams"]) == 2
assert record["check"] is None

# %% [markdown]
# Every cross reference is checked by `trace.validate`: a schedule step must name a
# node of the last graph, a wait must name a schedule step, and so on. Break one
# on purpose:

# %%
broken = json.loads(json.dumps(record))
broken["schedule"][0]["node"] = "no_such_node"
try:
    trace.validate(broken)
    raise AssertionError("validate accepted a broken record")
except trace.RecordError as err:
    print("RecordError:", err)
    assert "no_such_node" in str(err)

# %% [markdown]
# ### Exercise: find the slowest step
#
# Using only the record, find the op whose steps took the most time in the last
# timeline, summed over its steps. (Solution filled in; then try the same for
# bytes: which op touched the most memory?)

# %%
seconds_by_op: dict[str, float] = {}
for event in timelines[-1]["events"]:
    seconds_by_op[event["op"]] = seconds_by_op.get(event["op"], 0.0) + \
        event["end"] - event["start"]
slowest = max(seconds_by_op, key=seconds_by_op.get)
print(f"most time: {slowest} ({seconds_by_op[slowest] * 1e3:.3f} ms over the run)")
assert slowest in {node["op"] for node in record["graphs"][-1]["nodes"]}

# %% [markdown]
# ## 3. Exports and the debugger
#
# `trace.to_perfetto` turns a timeline into Chrome's trace-event JSON: one track
# per stream, arrows for the waits between streams, and a counter of arena bytes
# in use. Open the file at https://ui.perfetto.dev or in `chrome://tracing`.

# %%
perfetto = trace.to_perfetto(record)
perfetto_path = folder / "mlp.perfetto.json"
perfetto_path.write_text(json.dumps(perfetto))
kinds: dict[str, int] = {}
for event in perfetto["traceEvents"]:
    kinds[event["ph"]] = kinds.get(event["ph"], 0) + 1
print(f"wrote {perfetto_path}: {kinds.get('X', 0)} slices, {kinds.get('s', 0)} wait arrows, "
      f"{kinds.get('C', 0)} memory counter samples")
assert kinds.get("X", 0) == len(timelines[-1]["events"])

# %% [markdown]
# To open the record in the terminal debugger, run one of these in a shell (the
# debugger is a full-screen app, so this lesson does not start it for you). The
# files stay where they are until you run the lesson again:

# %%
print(f"the record and the Perfetto file stay in {folder} (replaced by the next run)")
print(f"  tinyflow debug {record_path}")
print(f"  python -m viz {record_path}")
print(f"  tinyflow export {record_path} --dot graph.svg     # the graph, with Graphviz")

# %% [markdown]
# ## 4. Watching a run live, and comparing two runs
#
# `tf.debug.record(path, live=True)` also appends every scalar, and ten times a
# second the latest timeline, to `path + ".live.jsonl"` (one JSON object a line),
# so `tinyflow debug --follow path` can watch the run while it trains.
# `trace.LiveReader` is what the debugger polls; `trace.load_live` reads it once.
# `tf.debug.scalar(name, step, value)` logs to whichever recorder is active.

# %%
live_path = folder / "live.tfdbg.json"
with tf.debug.record(live_path, title="lesson 8 live", live=True) as rec:
    for step in range(6):
        batch = rng.choice(256, 64, replace=False)
        step_loss, _ = sess.run([loss, train_op], {x: points[batch], y: labels[batch]})
        tf.debug.scalar("loss", step, step_loss)
        tf.debug.scalar("lr", step, 0.1)
    rec.flush()
    reader = trace.LiveReader(live_path)
    reader.poll()                      # what a viewer sees before the block ends
    print(f"while training: {reader.scalars_seen} scalar points, "
          f"{len(reader.record['timelines'])} timeline(s)")
    assert len(reader.record["scalars"]["loss"]) == 6
print("after:", sorted(trace.load(live_path)["scalars"]))

# %% [markdown]
# Two records compare node by node: ids differ between runs, so nodes are matched by
# op and source line (`viz.compare.match`); what is left over is the difference, and
# the rewrite records say why. `tinyflow diff A B` prints this report and
# `tinyflow debug A B` shows it as view `5`, with the curves of both overlaid.

# %%
try:
    from viz.compare import report
    from viz.model import RecordModel
except ImportError as missing:
    print(f"viz is not installed ({missing}); pip install 'tinyflow[viz]'")
else:
    text = report(RecordModel(record), RecordModel(trace.load(live_path)))
    print("\n".join(text.splitlines()[:12]))
    assert "matched" in text
live_path.unlink()                          # the lesson keeps only its main record
Path(trace.live_path(live_path)).unlink()

# %% [markdown]
# In the debugger: `1` to `4` switch between the graph, timeline, memory and curves
# views (`5` compares two records); the graph opens on the loss as a folded overview
# of layers and phases (`enter` expands a box, `z` shows a node's neighbourhood);
# `[` and `]` step through the passes (added nodes green, removed red); the arrow
# keys move one shared cursor, so the node you select in the graph is also
# highlighted in the timeline and in the arena; `N` jumps to the first NaN; `?`
# lists every key. Any script can be recorded without changing it:
# `tinyflow debug --run my_script.py`.
#
# The debugger is a Textual app, and Textual can run an app *headless*, as its
# tests do. Here is the first screen's status line and the inspector, read from a
# headless run (skipped when the `viz` extra is not installed):

# %%
try:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from textual.widgets import Static

    from viz.app import DebuggerApp
except ImportError as missing:
    print(f"viz is not installed ({missing}); pip install 'tinyflow[viz]'")
else:
    async def peek(path: Path) -> tuple[str, str | None]:
        app = DebuggerApp(str(path))
        async with app.run_test(size=(120, 36)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            status = str(app.query_one("#status", Static).render())
            return status, app.selected

    # On a worker thread with its own event loop: the same in a script and in a
    # notebook (whose event loop is already running, so asyncio.run would refuse).
    with ThreadPoolExecutor(max_workers=1) as pool:
        status, selected = pool.submit(asyncio.run, peek(record_path)).result()
    print("status line:", status)
    print("cursor on:", selected)
    assert "lesson 8 MLP" in status and selected is not None

# %% [markdown]
# ## What to remember
#
# * `with tf.debug.record(path):` around your training loop records everything;
#   `tinyflow debug path` opens it; `live=True` (or `tinyflow train NAME --trace
#   path --live`) lets the debugger follow the run; `tinyflow diff a b` compares two.
# * The record is versioned JSON with a documented schema (`trace.py`): load it,
#   validate it, compute with it, export it.
#
# That is the whole stack: graph, autodiff, passes, memory, streams, allreduce,
# devices, and the record that explains them. The training scripts
# (`tinyflow train mlp`, `cnn`, `charlm`, `data_parallel`) put it all to work.
