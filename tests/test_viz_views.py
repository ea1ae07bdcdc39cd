"""The debugger beyond one post-hoc record (issue 16): the curves view and its series
math, the live format and `--follow`, comparing two records (view 5 and `tinyflow
diff`), the folded graph overview, search, the per-op table, and the exports."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import tinyflow as tf
from tinyflow import trace
from textual.widgets._footer import FooterKey

from viz import export
from viz.app import DebuggerApp
from viz.compare import compare, match, report
from viz.curves_view import CurvesView
from viz.graph_view import GraphView
from viz.model import RecordModel
from viz.overview import Overview, layers, phases
from viz.series import Series, ema, spikes, thin
from viz_pilot import FIXTURES, MLP, NAN, opened, pilot_test


def with_curves(record: dict, points: int = 2000) -> dict:
    """`record` with deterministic scalar series: a decaying loss with one spike and a
    NaN, and an accuracy logged every 100 steps."""
    record = copy.deepcopy(record)
    steps = np.arange(points)
    loss = 2.0 * np.exp(-steps / 400) + 0.05 * np.sin(steps / 3)
    loss[1200] = 4.0
    series = [[int(s), float(v)] for s, v in zip(steps, loss)]
    series[1500][1] = None
    record["scalars"] = {"loss": series,
                         "accuracy": [[int(s), float(1 - np.exp(-s / 500))]
                                      for s in steps[::100]]}
    return record


# -- series math -----------------------------------------------------------------------

def test_thin_keeps_every_bucket_extreme_and_shrinks_a_million_points():
    rng = np.random.default_rng(0)
    steps = np.arange(1_000_000, dtype=float)
    values = rng.standard_normal(1_000_000)
    values[123_457] = 50.0          # a spike must survive thinning
    values[800_000] = np.nan
    xs, ys = thin(steps, values, 150)
    assert len(xs) == len(ys) <= 2 * 150 + 2
    assert np.nanmax(ys) == 50.0 and np.nanmin(ys) == np.nanmin(values)
    assert np.all(np.diff(xs) >= 0), "x stays in step order"
    short = np.arange(10.0)
    assert thin(short, short, 150)[0] is short


def test_ema_matches_tensorboard_and_skips_nan():
    values = np.array([1.0, 2.0, np.nan, 4.0])
    out = ema(values, 0.5)
    # debiased: the first point is the value itself, then weighted averages
    assert out[0] == pytest.approx(1.0)
    assert out[1] == pytest.approx((0.5 * 0.5 * 1 + 0.5 * 2) / (1 - 0.25))
    assert out[2] == pytest.approx(out[1])
    assert np.array_equal(ema(values, 0.0), values, equal_nan=True)


def test_spikes_and_nan_steps():
    record = with_curves(trace.load(MLP))
    series = Series.from_points("loss", record["scalars"]["loss"])
    assert list(series.bad_steps) == [1500.0]
    assert 1200 in spikes(series.values).tolist()
    assert len(spikes(np.ones(500))) == 0


# -- the curves view -------------------------------------------------------------------

@pilot_test
async def test_curves_view_draws_series_toggles_and_moves_the_step_cursor():
    record = with_curves(trace.load(MLP))
    app = DebuggerApp(record=record, view="curves")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        curves = app.query_one(CurvesView)
        assert curves.drawn == ["loss", "accuracy"]
        listing = str(app.query_one("#series-list").render())
        assert "NaN/Inf from step 1500" in listing and "spike" in listing
        await pilot.press("space")                  # hide loss
        assert curves.drawn == ["accuracy"]
        await pilot.press("space", "s")             # show it again; next smoothing
        assert curves.drawn == ["loss", "accuracy"] and curves.smoothing == 2
        await pilot.press("left")                   # the step cursor, from the end
        assert curves.cursor_step is not None and curves.cursor_step < 1999
        await pilot.press("down")
        assert curves.selected_name() == "accuracy"


@pilot_test
async def test_a_step_on_the_curve_selects_the_timeline_tied_to_that_step():
    """The cursor selects a timeline only where the record ties it to the step (a
    "step" key); a program run whose number equals the step is not that step."""
    record = trace.load(MLP)
    runs = [t["run"] for t in record["timelines"]]
    record["scalars"] = {"loss": [[r, 1.0 / (r + 1)] for r in range(max(runs) + 1)]}
    for timeline in record["timelines"]:
        timeline["step"] = timeline["run"]       # as tinyflow would need to record it
    app = DebuggerApp(record=record, view="curves")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        assert app.run_index == len(runs) - 1
        await pilot.press("left")
        step = int(app.query_one(CurvesView).cursor_step)
        assert record["timelines"][app.run_index]["step"] == step


# -- live records ------------------------------------------------------------------------

def _tiny_model():
    x = tf.placeholder(tf.float32, shape=(None, 4), name="x")
    w = tf.Variable(np.ones((4, 2), np.float32), name="w")
    loss = tf.reduce_mean(tf.matmul(x, w))
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    return sess, x, loss, train


def test_live_record_lines_and_final_document_agree(tmp_path):
    path = str(tmp_path / "live.json")
    sess, x, loss, train = _tiny_model()
    feed = {x: np.ones((3, 4), np.float32)}
    with tf.debug.record(path, live=True) as rec:
        for step in range(12):
            value, _ = sess.run([loss, train], feed)
            rec.scalar("loss", step, value)
        rec.flush()
        middle = trace.load_live(path)     # while the block still runs
        assert len(middle["scalars"]["loss"]) == 12 and middle["graphs"]
    final = trace.load(path)
    assert final["live_lines"] >= 12
    assert trace.load_live(path)["scalars"] == final["scalars"], "no line applied twice"
    assert len(final["scalars"]["loss"]) == 12
    # Timelines are sampled (10 Hz) in live mode, each with the number of its run.
    runs = [t["run"] for t in final["timelines"]]
    assert runs and runs == sorted(set(runs)) and runs[-1] <= 12 and runs[0] >= 0


def test_live_scalar_lines_are_the_json_lines():
    """The scalar lines are formatted by hand (a training loop logs one a step): the
    text must be exactly what the JSON encoder writes, NaN and Inf as null."""
    points = [("loss", 0, 0.1), ('l\u00e9"ss\n', 7, float("nan")), ("acc", 10**12, float("inf")),
              ("a", 3, -float("inf")), ("x", 1, 1e300), ("x", 2, -0.0), ("x", 3, 1e-7),
              ("x", 4, 123456789.0), ("x", 5, 5e-324), ("\u2603", 6, 0.1 + 0.2)]
    assert trace.live_scalar_lines(points) == "".join(
        trace.live_line("scalar", name=n, step=s, value=v) for n, s, v in points)


def test_live_document_rewrite_counts_the_scalars_not_yet_written(tmp_path):
    """Scalars wait for the next tick to be written; a document written in between
    (the program to show changed) holds them, so its live_lines must count them or a
    reader applies them twice."""
    path = str(tmp_path / "live.json")
    sess, x, loss, train = _tiny_model()
    feed = {x: np.ones((3, 4), np.float32)}
    with tf.debug.record(path, live=True) as rec:
        for step in range(3):
            rec.scalar("loss", step, sess.run(loss, feed))
        for step in range(3, 9):    # another program, run more often: a new document
            value, _ = sess.run([loss, train], feed)
            rec.scalar("loss", step, value)
            if step == 5:
                rec.flush()
        rec.flush()
        assert trace.load_live(path)["scalars"] == rec.scalars
    assert trace.load_live(path)["scalars"] == trace.load(path)["scalars"] == rec.scalars


def test_live_traces_one_run_per_tick(tmp_path, monkeypatch):
    """Live mode samples timelines at LIVE_HZ: one traced run per tick, not every run
    that might end near it (a traced run costs the step a dict per node)."""
    clock = [0.0]
    monkeypatch.setattr(tf.debug, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    sess, x, loss, train = _tiny_model()
    feed = {x: np.ones((3, 4), np.float32)}
    with tf.debug.record(tmp_path / "live.json", live=True, max_runs=100) as rec:
        for step in range(60):
            clock[0] += 0.03     # a 30 ms step: three or four steps a tick (10 Hz)
            value, _ = sess.run([loss, train], feed)
            rec.scalar("loss", step, value)
    runs = [t["run"] for t in trace.load(tmp_path / "live.json")["timelines"]]
    ticks = 60 * 0.03 * tf.debug.LIVE_HZ
    assert ticks - 2 <= len(runs) <= ticks + 1, runs


def test_live_reader_rejects_bad_lines_and_waits_for_partial_ones(tmp_path):
    path = str(tmp_path / "r.json")
    lines = tmp_path / "r.json.live.jsonl"
    lines.write_text(trace.live_line("scalar", name="loss", step=0, value=1.5) +
                     '{"kind": "scalar", "name": "loss", "st')
    reader = trace.LiveReader(path)
    assert reader.poll() and reader.record["scalars"]["loss"] == [[0, 1.5]]
    with open(lines, "a") as f:
        f.write('ep": 1, "value": null}\n')
    assert reader.poll() and reader.record["scalars"]["loss"][-1] == [1, None]
    with open(lines, "a") as f:
        f.write('{"kind": "weights"}\n')
    with pytest.raises(trace.RecordError, match="line 3.kind: expected 'scalar' or "):
        reader.poll()


def test_scalar_step_must_be_whole(tmp_path):
    with tf.debug.record(tmp_path / "r.json") as rec:
        rec.scalar("loss", 3, 0.5)
        with pytest.raises(tf.TinyFlowError, match="order is name, step, value"):
            tf.debug.scalar("loss", 0.42, 7)
    assert trace.load(tmp_path / "r.json")["scalars"]["loss"] == [[3, 0.5]]


@pilot_test
async def test_follow_shows_scalars_a_training_thread_appends(tmp_path):
    """A training loop appends to a live record while the app follows it: the
    app's own state (its record's scalars) catches up with what was written."""
    path = str(tmp_path / "live.json")
    sess, x, loss, train = _tiny_model()
    feed = {x: np.ones((3, 4), np.float32)}
    written = threading.Event()
    proceed = threading.Event()
    done = threading.Event()

    def training() -> None:
        with tf.debug.record(path, live=True) as rec:
            for step in range(20):
                value, _ = sess.run([loss, train], feed)
                rec.scalar("loss", step, value)
                if step == 9:
                    rec.flush()
                    written.set()
                    proceed.wait(30)
            rec.flush()
        done.set()

    thread = threading.Thread(target=training)
    app = DebuggerApp(path, follow=True, view="curves")
    async with app.run_test(size=(100, 30)) as pilot:
        await opened(pilot)
        thread.start()

        async def until(condition) -> bool:
            for _ in range(200):        # polls every FOLLOW_SECONDS; a generous bound
                if condition():
                    return True
                await pilot.pause(0.05)
            return False

        assert await until(written.is_set)
        seen = lambda n: app.model is not None and \
            len(app.model.record["scalars"].get("loss", [])) == n
        assert await until(lambda: seen(10)), "the first 10 points appear"
        assert app.model.graphs, "the program's graph arrived with them"
        assert app.query_one(CurvesView).drawn == ["loss"]
        proceed.set()
        assert await until(done.is_set)
        assert await until(lambda: seen(20)), "and then the rest"
        # (the run's final document says it finished)
        assert await until(lambda: "run finished" in str(app.query_one("#status").render()))
    thread.join()


@pilot_test
async def test_follow_of_a_missing_file_says_it_is_waiting(tmp_path):
    """`--follow` of a path no run has written yet (or a typo) says it waits for that
    file, not "This record holds no graph."; the record opens once it appears."""
    path = tmp_path / "missing.json"
    app = DebuggerApp(str(path), follow=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        await pilot.pause(0.3)          # a poll or so: still nothing there
        status = str(app.query_one("#status").render())
        assert f"waiting for {path} to appear" in status
        assert f"Waiting for {path} to appear" in str(app.query_one("#loading").render())
        assert app.model is None
        trace.save(trace.load(MLP), path)
        for _ in range(100):
            if app.model is not None:
                break
            await pilot.pause(0.05)
        assert app.model is not None and app.model.graphs and app.view == "graph"
        assert "waiting" not in str(app.query_one("#status").render())


# -- comparing two records ---------------------------------------------------------------

def test_match_pairs_nodes_by_op_and_source_line():
    a = trace.load(MLP)
    b = trace.load(NAN)
    ma, mb = RecordModel(a), RecordModel(b)
    pairs, only_a, only_b = match(ma.nodes(), mb.nodes())
    assert pairs and len(pairs) + len(only_a) == len(ma.nodes())
    for aid, bid in pairs.items():
        assert ma.nodes()[aid]["op"] == mb.nodes()[bid]["op"]
    same = match(ma.nodes(), ma.nodes())
    assert same[1] == same[2] == [] and all(k == v for k, v in same[0].items())


def record_tiny_mlp(path, **options) -> dict:
    """A real two-step MLP training record, compiled with `options`."""
    x = tf.placeholder(tf.float32, (8, 6), name="x")
    y = tf.placeholder(tf.int64, (8,), name="labels")
    loss = tf.nn.mean_sparse_softmax_cross_entropy_with_logits(tf.nn.MLP([6, 16, 3])(x), y)
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    sess = tf.Session(**options)
    sess.run(tf.global_variables_initializer())
    rng = np.random.default_rng(0)
    feed = {x: rng.standard_normal((8, 6)).astype(np.float32), y: rng.integers(0, 3, 8)}
    with tf.debug.record(path) as rec:
        for step in range(2):
            value, _ = sess.run([loss, train], feed)
            rec.scalar("loss", step, value)
    return trace.load(path)


def test_diff_report_names_what_fusion_changed(tmp_path):
    """Fusion off vs on: the nodes only in the fused record are the fused ones, each
    with the rewrite record that made it; the unfused nodes are only in A."""
    off = record_tiny_mlp(tmp_path / "off.json", disable=("fuse_dense", "fuse_elementwise"))
    on = record_tiny_mlp(tmp_path / "on.json")
    a, b = RecordModel(off), RecordModel(on)
    sections = {s.title.split(" ")[0]: s for s in compare(a, b)}
    assert {"Graphs", "Memory", "Timelines", "Scalars"} <= set(sections)
    _, only_a, only_b = match(a.nodes(), b.nodes())
    assert only_b and all(b.nodes()[i]["op"].startswith("fused") for i in only_b)
    assert {"matmul", "add"} <= {a.nodes()[i]["op"] for i in only_a}, "what fusion ate"
    text = report(a, b, "off.json", "on.json")
    assert "only B:" in text and "added by fuse_" in text
    assert "fuse_dense" in text and "≠" in text      # the pass table shows where
    assert "loss" in sections["Scalars"].lines[0]


def test_diff_columns_line_up_with_long_node_names():
    """softmax_cross_entropy_28 (24 characters) pushed its row's times right: every
    row of a table is as wide as its longest name."""
    a = trace.load(MLP)
    b = copy.deepcopy(a)
    for timeline in b["timelines"]:
        for event in timeline["events"]:
            event["end"] += 0.01 if event["node"].startswith("softmax_cross") else 1e-6
    text = report(RecordModel(a), RecordModel(b))
    rows = [line for line in text.split("\n") if " -> " in line and "(+" in line]
    assert any("softmax_cross_entropy_28 " in line for line in rows)
    assert len(rows) > 1 and len({line.index(" -> ") for line in rows}) == 1
    moved = [line for line in text.split("\n") if ": " in line and " -> " in line
             and "(+" not in line]
    assert len({line.index(" -> ") for line in moved}) <= 1


def test_tinyflow_diff_command(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] + sys.path))
    done = subprocess.run([sys.executable, "-m", "tinyflow.cli", "diff", MLP, NAN],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Graphs (after each pass" in done.stdout and "Memory plans" in done.stdout
    done = subprocess.run([sys.executable, "-m", "tinyflow.cli", "diff", MLP,
                           str(tmp_path / "missing.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "no such file" in done.stderr


@pilot_test
async def test_compare_view_opens_with_two_records_and_overlays_curves():
    app = DebuggerApp(MLP, other=with_curves(trace.load(MLP), 1600))
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        assert app.view == "compare" and app.other is not None
        text = str(app.query_one("#compare-text").render())
        assert "Memory plans" in text and "matched 48 nodes" in text
        await pilot.press("4")
        assert app.query_one(CurvesView).drawn == ["A:loss", "B:loss", "B:accuracy"]
        await pilot.press("5", "down")
        assert app.view == "compare"


# -- the folded overview -----------------------------------------------------------------

def test_overview_groups_by_phase_and_layer():
    record = trace.load(MLP)
    graph = record["graphs"][-1]
    phase = phases(graph)
    assert set(phase.values()) == {"forward", "backward", "optimizer"}
    assert phase[graph["outputs"][0]] == "forward"
    layer = layers(graph)
    assert layer["mlp1_w"] == "mlp1"
    overview = Overview(graph)
    assert sum(len(g.members) for g in overview.groups.values()) == len(graph["nodes"])
    assert len(overview.groups) < len(graph["nodes"]) / 2


def test_an_eager_tape_of_several_steps_has_its_forward_backward_and_optimizer(tmp_path):
    # Two SGD steps recorded eagerly: each step's forward reads the parameters (updated
    # in place, so still the inputs), the updates read the gradients.
    from tinyflow import eager as E
    w = E.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    x = E.tensor(np.ones((4, 3), np.float32))
    optimizer = E.Adam([w], lr=0.1)   # its step size reads no gradient: marked
    with tf.debug.record(tmp_path / "eager.json"):
        for _ in range(2):
            optimizer.zero_grad()
            loss = tf.reduce_sum(tf.tanh(x @ w))
            loss.backward()
            optimizer.step()
    graph = trace.load(tmp_path / "eager.json")["graphs"][0]
    phase = phases(graph)
    ops_by_phase = {}
    for node in graph["nodes"]:
        ops_by_phase.setdefault(phase[node["id"]], []).append(node["op"])
    assert ops_by_phase["forward"].count("tanh") == 2, ops_by_phase
    assert ops_by_phase["optimizer"].count("sqrt") == 4, ops_by_phase  # 2 per Adam step
    assert "tanh" not in ops_by_phase["optimizer"]
    assert "sqrt" not in ops_by_phase["forward"] and "pow" not in ops_by_phase["forward"]


def test_repeated_layers_fold_into_one_box_with_a_count():
    nodes, previous = [], "x"
    nodes.append({"id": "x", "op": "placeholder", "inputs": [], "phase": "forward",
                  "shape": [2], "where": "m.py:1", "provenance": ["x"]})
    for k in range(6):
        for op in ("matmul", "relu"):
            node_id = f"block{k}/{op}"
            nodes.append({"id": node_id, "op": op, "inputs": [previous], "phase": "forward",
                          "shape": [2], "where": "m.py:2", "provenance": [node_id]})
            previous = node_id
    overview = Overview({"nodes": nodes, "outputs": [previous]})
    # The input x joins the box of its first reader, block0, which then differs
    # from the other five: block1..block5 fold into one box.
    assert overview.group_of["x"] == "forward:block0"
    folded = [g for g in overview.groups.values() if g.repeats > 1]
    assert len(folded) == 1 and folded[0].repeats == 5
    assert overview.title(folded[0]) == "block{1..5} ×5 · forward"
    canvas = overview.draw(lambda i: "node", folded[0].key)
    assert len(canvas.boxes) == 2
    overview.toggle(folded[0].key)
    assert len(overview.draw(lambda i: "node", None).boxes) == 1 + 10


@pilot_test
async def test_overview_opens_on_the_loss_expands_and_searches():
    record = trace.load(MLP)
    loss = record["graphs"][-1]["outputs"][0]
    app = DebuggerApp(MLP)
    async with app.run_test(size=(160, 48)) as pilot:
        await opened(pilot)
        graph = app.query_one(GraphView)
        assert app.selected == loss and graph.overview_mode
        overview = graph.overview()
        group = overview.group_of[loss]
        assert graph.canvas.boxes[group].kind == "sel"
        assert "[overview]" in str(app.query_one("#status").render())
        await pilot.press("enter")                      # expand the loss's box
        assert group in overview.expanded and app.selected in graph.canvas.boxes
        await pilot.press("enter")                      # and collapse it
        assert group not in overview.expanded
        await pilot.press("down")
        assert app.selected is not None
        await pilot.press("slash")
        for ch in "matmul":
            await pilot.press(ch)
        await pilot.press("enter")
        assert app.matches and all("matmul" in m or "matmul" in
                                   app.model.nodes()[m]["op"] for m in app.matches)
        assert app.selected == app.matches[0] and app.selected in graph.canvas.boxes
        if len(app.matches) > 1:
            await pilot.press("n")
            assert app.selected == app.matches[1]
        await pilot.press("z")
        assert "neighbourhood" in str(app.query_one("#status").render())


@pilot_test
async def test_nan_hint_previous_run_and_the_failed_run_opens_first():
    record = trace.load(MLP)
    for timeline in record["timelines"]:
        for event in timeline["events"]:
            event["summary"] = None
    app = DebuggerApp(record=record)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        await pilot.press("N")
        assert "--check-numerics" in "".join(str(n.message) for n in app._notifications)
        for view in ("1", "2", "3", "4"):      # at 80 columns "? help" and "q quit" fit
            await pilot.press(view)
            await pilot.pause()
            shown = {k.description: k.region for k in app.query(FooterKey)}
            assert shown["help"].right <= 80 and shown["quit"].right <= 80
    bad = trace.load(MLP)
    event = next(e for e in bad["timelines"][0]["events"] if e["summary"])
    event["summary"]["nan"] = 2
    app = DebuggerApp(record=bad)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        assert app.run_index == 0, "opens on the run that held a NaN"


# -- exports -------------------------------------------------------------------------------

def test_perfetto_export_holds_every_run_and_the_scalars(tmp_path):
    record = trace.load(MLP)
    out = tmp_path / "t.json"
    export.write_perfetto(record, str(out))
    data = json.loads(out.read_text())
    runs = {e["args"]["run"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert runs == {t["run"] for t in record["timelines"]}
    counters = [e for e in data["traceEvents"] if e["ph"] == "C" and e["name"] == "loss"]
    assert len(counters) == len(record["scalars"]["loss"])
    export.write_perfetto(record, str(out), run=0)
    assert {e["args"].get("run") for e in json.loads(out.read_text())["traceEvents"]
            if e["ph"] == "X"} == {None}


def test_big_graphs_export_their_overview_with_progress(tmp_path, monkeypatch):
    sys.path.insert(0, FIXTURES)
    import make_record
    record = make_record.big_record(layers=60)
    said = []
    export.write_dot(record, str(tmp_path / "g.dot"), progress=said.append)
    text = (tmp_path / "g.dot").read_text()
    assert "folded overview" in said[0] and text.count("->") < 200
    export.write_dot(record, str(tmp_path / "all.dot"), all_nodes=True)
    assert (tmp_path / "all.dot").read_text().count("->") > text.count("->")


def test_export_errors_name_the_command_typed(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), VIZ_PROG="tinyflow")
    done = subprocess.run([sys.executable, "-m", "viz", "export", MLP, "--dot",
                           str(tmp_path / "x.png")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("tinyflow export: ")


# -- snapshots -----------------------------------------------------------------------------

async def _ready(pilot) -> None:
    await opened(pilot)
    await pilot.pause()


@pytest.mark.parametrize("view,size", [
    ("curves", (80, 24)), ("curves", (160, 48)),
    ("compare", (80, 24)), ("compare", (160, 48)),
    ("overview", (80, 24)), ("overview", (160, 48)),
])
def test_snapshots(snap_compare, view, size, monkeypatch):
    """The new screens, at the smallest supported terminal and a big one."""
    monkeypatch.chdir(FIXTURES)   # the compare view shows the path: same in every checkout
    if view == "curves":
        app = DebuggerApp(record=with_curves(trace.load(MLP)), view="curves", theme="dark")
    elif view == "compare":
        app = DebuggerApp("mlp.record.json", other=with_curves(trace.load(MLP), 1600),
                          theme="dark")
    else:
        app = DebuggerApp(MLP, view="graph", theme="dark")   # opens on the overview
    assert snap_compare(app, terminal_size=size, run_before=_ready)


# -- the command line --------------------------------------------------------------------

def test_debug_command_passes_view_theme_two_records_and_check_numerics(tmp_path,
                                                                       monkeypatch):
    from tinyflow import cli
    opened_with, records_seen = [], []

    def fake_viz(arguments):
        opened_with.append(list(arguments))
        if Path(arguments[0]).is_file():   # --run's record lives only while it is open
            records_seen.append(trace.load(arguments[0]))
        return 0

    monkeypatch.setattr(cli, "_viz", fake_viz)
    assert cli.main(["debug", MLP, NAN, "--view", "curves", "--theme", "light"]) == 0
    assert opened_with[-1] == [MLP, NAN, "--view", "curves", "--theme", "light"]
    assert cli.main(["debug", "--follow", str(tmp_path / "live.json")]) == 0
    assert opened_with[-1] == [str(tmp_path / "live.json"), "--follow"]
    script = tmp_path / "nan.py"
    seen = tmp_path / "env.txt"
    script.write_text(
        "import os, numpy as np, tinyflow as tf\n"
        f"open({str(seen)!r}, 'w').write(os.environ.get('TINYFLOW_CHECK_NUMERICS', ''))\n"
        "x = tf.placeholder(tf.float32, (2,), name='x')\n"
        "try:\n"
        "    tf.Session().run(tf.log(x), {x: np.array([1.0, -1.0], np.float32)})\n"
        "except tf.TinyFlowError as err:\n"
        "    print('stopped:', err)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    assert cli.main(["debug", "--run", "--check-numerics", str(script)]) == 0
    assert seen.read_text() == "1"
    assert not Path(opened_with[-1][0]).exists(), "--run removes its temporary record"
    record = records_seen[-1]
    assert record["check"] is not None, "check mode stopped at the NaN and recorded it"


# -- loading a big record --------------------------------------------------------------

@pilot_test
async def test_the_loaded_record_is_frozen_from_the_collector_until_the_app_closes():
    """Loading pauses the cyclic collector and freezes what it built (a big record is
    millions of objects each collection would walk again); closing the app gives
    them back, so apps opened one after another in a process leak nothing."""
    import gc
    frozen_before = gc.get_freeze_count()
    app = DebuggerApp(MLP)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        assert gc.isenabled()                                # on again after loading
        assert gc.get_freeze_count() > frozen_before + 1000  # the record's objects
        assert app.model.graphs
    assert gc.get_freeze_count() == 0
