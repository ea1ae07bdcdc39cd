"""Regression tests for the debugger problems a usability probe found: parallel runs'
critical path and bars, the curves cursor's link to a timeline, busy shading, the
memory view's unlisted bytes and header, the overview's layers of gradients, and
small things (help scrolling, follow mode, search, cut text, focus). At the end, a
second probe's findings (tinyflow train mlp --trace, opened at 140x42 and 80x24): the
graph view's cut boxes, panning and footer, the curves of different scales, the
per-op table's cut flag, and ``5`` with one record."""

from __future__ import annotations

import copy
import re
import time

import numpy as np
import pytest
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets._footer import FooterKey
from textual_plot import PlotWidget

import tinyflow as tf
from tinyflow import trace
from tinyflow.rank_trace import collective_events, scheme_record
from viz import palette
from viz.app import HELP, DebuggerApp, HelpScreen
from viz.curves_view import CurvesView
from viz.graph_view import CanvasView, GraphView
from viz.inspector import Inspector
from viz.memory_view import MemoryView
from viz.model import RecordModel, fmt_bytes
from viz.overview import Overview, layers, overview_of
from viz.series import scale_groups
from viz.timeline_view import TimelineView, wrap_names
from viz_pilot import MLP, opened, pilot_test


def path_of(model: RecordModel, run: int = 0) -> list[str]:
    """The critical path's events in time order, each as node@rank (its lane's)."""
    path = model.critical_path(run)
    events = sorted((e for e in model.timelines[run]["events"] if id(e) in path),
                    key=lambda e: e["start"])
    return [f"{e['node']}@{model.streams[e['stream']].split('/')[0]}" for e in events]


# -- 1. parallel records: a lane per rank, the same event names on every rank ------------

def pipeline_record() -> dict:
    """Two pipeline stages, two microbatches, as tinyflow/pipeline.py records them
    (every rank has its own F0, F1, B0, B1), with transfer gaps between stages."""
    times = {0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 6, 7), ("B", 1, 8, 9)],
             1: [("F", 0, 2, 3), ("F", 1, 3, 4), ("B", 0, 4, 5), ("B", 1, 5, 6)]}
    events = [{"node": f"{kind}{mb}", "kind": kind, "microbatch": mb,
               "stream": f"rank{rank}/compute", "start": start, "end": end}
              for rank, steps in times.items() for kind, mb, start, end in steps]
    return scheme_record(events, "pp on 2 ranks")


def test_pipeline_critical_path_crosses_ranks_by_microbatch():
    """Keyed by name, every rank's "F0" was one event: the path was rank 0's own 8
    steps ("busy 667µs" of a 3.58 ms step). The chain goes from stage to stage."""
    model = RecordModel(pipeline_record())
    assert path_of(model) == ["F0@rank0", "F0@rank1", "F1@rank1", "B0@rank1",
                              "B0@rank0", "B1@rank0"]
    assert model.critical_busy(0) == pytest.approx(6.0)     # of a 9-unit run
    assert model.lane_busy(0) == {0: pytest.approx(4.0), 1: pytest.approx(4.0)}


def test_ring_steps_wait_on_the_rank_they_receive_from():
    """A ring step receives what the rank before it sent when that rank began its
    own step, so a slow rank 1 holds up rank 0's second step (which ran long,
    waiting inside). Built as rank_trace.collective_events builds comm.trace."""
    steps = {0: [(0, 0.0, 1.0), (1, 1.0, 5.5)], 1: [(0, 0.0, 4.0), (1, 4.0, 5.0)]}
    events = []
    for rank, ring in steps.items():
        events += collective_events([{"phase": "all-gather", "step": k, "start": start,
                                      "end": end, "bytes": 64, "dst": 1 - rank}
                                     for k, start, end in ring], rank)
    model = RecordModel(scheme_record(events, "ring on 2 ranks"))
    assert path_of(model) == ["all-gather[0]@rank1", "all-gather[1]@rank0"]
    # rank 0's step 1 counts from when rank 1's data was ready, not from its start
    assert model.critical_busy(0) == pytest.approx(4.0 + 1.5)
    last = max(model.timelines[0]["events"], key=lambda e: e["end"])
    assert "sends to rank 1" in model.event_facts(last)   # args one level down, read


@pilot_test
async def test_a_parallel_bar_shows_its_event_in_the_timeline_and_inspector():
    """A bar said "F0: no step in this run" and the inspector "F0: not in this record"."""
    app = DebuggerApp(record=pipeline_record(), view="timeline")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        await pilot.press("right")         # the first bar of the first lane
        await pilot.press("down")          # rank 1's bar nearest in time
        timeline = app.query_one(TimelineView)
        event = timeline.current_event()
        assert event is not None and app.model.rank_of(event) == 1
        text = timeline.render().plain
        assert f"{event['node']}@rank1" in text and "no step in this run" not in text
        assert f"microbatch {event['args']['microbatch']}" in text
        assert "received from" in text
        assert "critical path 6 steps on 2 lanes" in text.replace("\n", " ")
        inspector = str(app.query_one(Inspector).render())
        assert "not in this record" not in inspector
        assert "rank 1" in inspector and "microbatch" in inspector


# -- 2. the curves cursor and the timelines ----------------------------------------------

@pilot_test
async def test_the_step_cursor_does_not_pick_a_program_run_of_the_same_number():
    """Runs of one program are not training steps (an epoch's short last batch is
    another program): with no step recorded per timeline, no timeline is picked,
    the list says so, and the timeline calls its number a program run."""
    record = trace.load(MLP)
    runs = [t["run"] for t in record["timelines"]]
    record["scalars"] = {"loss": [[r, 1.0 / (r + 1)] for r in range(max(runs) + 1)]}
    app = DebuggerApp(record=record, view="curves")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        before = app.run_index
        for _ in range(3):
            await pilot.press("left")
        assert int(app.query_one(CurvesView).cursor_step) in runs
        assert app.run_index == before
        listing = " ".join(str(app.query_one("#series-list").render()).split())
        assert "not linked to steps" in listing
        await pilot.press("2")
        header = app.query_one(TimelineView).render().plain.split("\n")[0]
        assert header.startswith(f"program run {runs[before]} ")


# -- 3. busy shading ---------------------------------------------------------------------

@pilot_test
async def test_a_lane_busy_a_quarter_of_the_time_is_not_drawn_solid():
    """An eager run's lane (many short ops, Python between them) was one solid █."""
    events = [{"node": f"op{k}", "op": "mul", "stream": "compute", "start": 4.0 * k,
               "end": 4.0 * k + 1.0} for k in range(400)]
    app = DebuggerApp(record=scheme_record(events, "eager-like"), view="timeline")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        timeline = app.query_one(TimelineView)
        rows = timeline.render().plain.split("\n")
        row = next(iter(timeline._lane_rows))
        lane = rows[row][timeline.label_width:]
        assert "█" not in lane and set(lane.strip()) == {"░"}
        assert rows[row + 1].startswith("busy 25%")


# -- 4. the memory view: what the record does not list -----------------------------------

def allocator_record() -> dict:
    """The fixture's plan as a caching allocator's record: its blocks placed above
    bytes the record does not list (parameters allocated before recording), and the
    allocated peak (which counts those) as its bound."""
    record = trace.load(MLP)
    plan = record["memory_plan"]
    hidden = 4 * plan["arena_bytes"]
    for tensor in plan["tensors"]:
        if tensor["offset"] is not None:
            tensor["offset"] += hidden
    plan["arena_bytes"] = 8 * plan["arena_bytes"]            # reserved
    plan["lower_bound_bytes"] += hidden
    plan["strategy"] = "caching allocator"
    plan["strategies"] = {"caching allocator (reserved)": plan["arena_bytes"],
                          "allocated peak": plan["lower_bound_bytes"]}
    return record


@pilot_test
async def test_bytes_no_recorded_block_used_are_not_drawn_free():
    app = DebuggerApp(record=allocator_record(), view="memory")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        memory = app.query_one(MemoryView)
        text = memory.render().plain
        header = text.split("step →")[0].replace("\n", " ")
        # The bound that counts unlisted blocks is named as such, split, no "reuse".
        assert "lower bound" not in header and "reuse" not in header
        assert "allocated peak" in header and "in blocks the record does not list" in header
        top = text.split("\n")[memory._map_top]
        assert "0 B–" in top and "no block of the record used these bytes" in top
        assert "·" not in top


@pilot_test
async def test_an_eager_runs_bound_is_named_as_its_own_beside_a_smaller_static_plan():
    """Second new-user pass: an eager record said "lower bound 612 KiB" above
    "static plan (traced step) 408 KiB", a plan below its own lower bound; the
    bound is the eager run's ops', the plan another (traced, fused) program's."""
    record = trace.load(MLP)
    plan = record["memory_plan"]
    plan["strategy"] = "caching allocator"
    plan["strategies"] = {"caching allocator (reserved)": plan["arena_bytes"],
                          "allocated peak": plan["lower_bound_bytes"],
                          "static plan (traced step)": plan["lower_bound_bytes"] // 2}
    app = DebuggerApp(record=record, view="memory")
    async with app.run_test(size=(160, 40)) as pilot:
        await opened(pilot)
        header = " ".join(app.query_one(MemoryView).render().plain.split("step →")[0].split())
        assert "this run's lower bound" in header and "static plan (traced step)" in header


@pilot_test
async def test_peak_live_and_lower_bound_count_the_same_aligned_sizes():
    """"peak live 320.0 KiB" under "lower bound 320.1 KiB": live bytes were raw."""
    app = DebuggerApp(MLP, view="memory")
    async with app.run_test(size=(160, 40)) as pilot:
        await opened(pilot)
        header = " ".join(app.query_one(MemoryView).render().plain.split("step →")[0].split())
        bound = re.search(r"lower bound (\S+ \S+)", header).group(1)
        assert f"peak live {bound}" in header


@pilot_test
async def test_memory_header_wraps_instead_of_cutting_numbers():
    """At 80 columns "refcount 388.0 KiB" was cut to "refcount 38"."""
    app = DebuggerApp(MLP, view="memory")
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        memory = app.query_one(MemoryView)
        rows = memory.render().plain.split("\n")
        header = " ".join(rows[:memory._map_top])
        for name, size in app.model.stats()["strategies"].items():
            assert f"{name} {fmt_bytes(size)}" in header
        assert all(len(row) <= memory.size.width for row in rows[:memory._map_top])


# -- 5. the overview's layers ------------------------------------------------------------

def test_a_weight_gradient_is_in_its_own_layer_after_fusion():
    """mlp1_w's gradient sat in "mlp2 · backward": judged on the fused graph, it
    took the layer of whichever input came last."""
    record = trace.load(MLP)
    graph = record["graphs"][-1]
    nodes = {n["id"]: n for n in graph["nodes"]}
    overview = overview_of(record["graphs"], len(record["graphs"]) - 1)
    for k in range(3):
        assign = next(n for n in graph["nodes"]
                      if n["op"] == "assign" and n["inputs"][0] == f"mlp{k}_w")
        update = nodes[assign["inputs"][1]]
        gradient = next(i for i in update["inputs"] if nodes[i]["phase"] == "backward")
        assert overview.group_of[gradient] == f"backward:mlp{k}", gradient


def four_block_record(tmp_path) -> dict:
    """A 4-block model of equal blocks between an input projection and a head whose
    variables name no layer, trained one step under tf.debug.record, as
    train_charlm's blocks sit between its embeddings and its unembedding."""
    x = tf.placeholder(tf.float32, (8, 6), name="x")
    labels = tf.placeholder(tf.int64, (8,), name="labels")
    embed = tf.Variable(np.full((6, 6), 0.1, np.float32), name="embedding")
    h = tf.matmul(x, embed)
    for k in range(4):
        w = tf.Variable(np.full((6, 6), 0.1, np.float32), name=f"block{k}_w")
        b = tf.Variable(np.zeros(6, np.float32), name=f"block{k}_b")
        h = h + tf.tanh(tf.matmul(h, w) + b)
    head = tf.Variable(np.full((6, 3), 0.1, np.float32), name="unembedding")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=tf.matmul(h, head)))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    path = tmp_path / "blocks.json"
    with tf.debug.record(path):
        sess.run([loss, train], {x: np.ones((8, 6), np.float32),
                                 labels: np.zeros(8, np.int64)})
    return trace.load(path)


def test_repeated_blocks_fold_in_every_phase(tmp_path):
    """The backward pass was assigned one layer too high (and the head to the last
    block), so 4 blocks folded as block{1..2} x2 with block0 and block3 apart."""
    record = four_block_record(tmp_path)
    for index in (0, len(record["graphs"]) - 1):
        overview = overview_of(record["graphs"], index)
        titles = [overview.title(g) for g in overview.groups.values()]
        for phase in ("forward", "backward"):
            assert f"block{{0..3}} ×4 · {phase}" in titles, (index, titles)


def test_a_gradient_naming_its_forward_op_takes_that_layer():
    """Forward-compatible: a record whose gradient nodes say which op they
    differentiate ("grad_of") is followed, whatever they read."""
    node = lambda i, op, inputs, phase="forward", **extra: {
        "id": i, "op": op, "inputs": inputs, "phase": phase, "shape": [2],
        "where": "m.py:1", "provenance": [i], **extra}
    graph = {"nodes": [node("x", "placeholder", []), node("l0_w", "variable", []),
                       node("matmul_a", "matmul", ["x", "l0_w"]),
                       node("l1_w", "variable", []),
                       node("matmul_b", "matmul", ["matmul_a", "l1_w"]),
                       node("ones_c", "ones_like", ["matmul_b"], "backward"),
                       # the weight gradient of l1 reads l0's output: by its reads
                       # alone it is l1's too, so point it at l0's op to tell
                       node("matmul_d", "matmul", ["matmul_a", "ones_c"], "backward",
                            grad_of="matmul_a")],
             "outputs": ["matmul_b"]}
    assert layers(graph)["matmul_d"] == "l0"
    assert Overview(graph).group_of["matmul_d"] == "backward:l0"


# -- 6. small things ---------------------------------------------------------------------

@pilot_test
async def test_help_scrolls_at_80x24():
    app = DebuggerApp(MLP)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        scroll = app.screen.query_one(VerticalScroll)
        assert scroll.max_scroll_y > 0, "taller than the screen"
        await pilot.press("end")
        await pilot.pause()
        assert scroll.scroll_y == scroll.max_scroll_y > 0
        assert "Memory" in str(app.screen.query_one("Static").render())


@pilot_test
async def test_follow_says_when_nothing_new_arrives_and_when_the_run_finished(tmp_path):
    """After the writer finished, the header still said "following"."""
    path = tmp_path / "live.json"
    trace.save(trace.load(MLP), path)
    app = DebuggerApp(str(path), follow=True)

    def status() -> str:
        return str(app.query_one("#status").render())

    async def until(text: str) -> None:
        for _ in range(40):
            await pilot.pause(0.05)
            if text in status():
                return

    async with app.run_test(size=(120, 30)) as pilot:
        await opened(pilot)
        assert "· following" in status()
        app.last_change = time.monotonic() - 60     # a minute with nothing new
        await pilot.pause(0.6)                      # a poll or two
        assert re.search(r"no new data for 6\ds", status()) and "· following" not in status()
        trace.save(trace.load(MLP), path)           # the record grows again
        await until("· following")
        assert "· following" in status()
        # the run's final document says it finished (live_finished)
        trace.save({**trace.load(MLP), "live_lines": 0, "live_finished": True}, path)
        await until("run finished")
        assert "· run finished" in status() and "following" not in status()


def test_search_finds_memory_labels_such_as_scratch():
    record = copy.deepcopy(trace.load(MLP))
    plan = record["memory_plan"]
    owner = next(t for t in plan["tensors"] if t["kind"] == "intermediate")
    plan["tensors"].append({**owner, "kind": "scratch", "inplace_of": None,
                            "reason": "scratch of its kernel"})
    assert RecordModel(record).search("scratch") == [owner["node"]]
    assert RecordModel(trace.load(MLP)).search("scratch") == []


def test_a_cut_row_ends_in_an_ellipsis():
    row = Text("refcount 388.0 KiB")
    assert palette.elide(row, 12).plain == "refcount 38…"
    assert palette.elide(row, 40).plain == "refcount 388.0 KiB"


def test_the_critical_path_wraps_between_names_and_says_how_many_are_left():
    names = [f"step{k}" for k in range(30)]
    lines = wrap_names(names, 40, "critical path: ", 3)
    assert len(lines) == 3 and all(len(line) <= 40 for line in lines)
    assert lines[-1].endswith(" more")
    shown = " ".join(lines).replace("→", " ").split()
    left = int(lines[-1].split("+")[1].split()[0])
    assert sum(1 for word in shown if word.startswith("step")) + left == len(names)


@pilot_test
async def test_arrows_move_the_overview_cursor_at_80x24():
    """The pass list took the focus and, overflowing at 80x24, the arrow keys: ↓
    scrolled it instead of moving to the next box."""
    app = DebuggerApp(MLP)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        await pilot.press("left_square_bracket")    # a pass whose rewrites overflow
        await pilot.pause()
        graph = app.query_one(GraphView)
        before = graph.overview().box_of(app.selected)
        await pilot.press("down")
        await pilot.pause()
        assert graph.overview().box_of(app.selected) != before


def test_an_expanded_box_draws_the_selected_node_even_past_its_first_nodes():
    """An expanded box draws its first 80 nodes; a search hit past them had no box,
    so the view could not scroll to it."""
    nodes, previous = [{"id": "x", "op": "placeholder", "inputs": [], "phase": "forward",
                        "shape": [2], "where": "m.py:1", "provenance": ["x"]}], "x"
    for k in range(100):
        node_id = f"block0/op{k}"
        nodes.append({"id": node_id, "op": "relu", "inputs": [previous], "phase": "forward",
                      "shape": [2], "where": "m.py:2", "provenance": [node_id]})
        previous = node_id
    overview = Overview({"nodes": nodes, "outputs": [previous]})
    overview.toggle("forward:block0")
    assert "block0/op95" not in overview.draw(lambda i: "node", None).boxes
    assert "block0/op95" in overview.draw(lambda i: "node", None, keep="block0/op95").boxes


def test_a_timeline_tied_to_a_step_says_its_step():
    from viz.timeline_view import run_label
    assert run_label({"run": 1319, "label": "run 1319"}) == "program run 1319"
    assert run_label({"run": 1319, "label": "run 1319", "step": 1349}) == \
        "step 1349, program run 1319"


@pilot_test
async def test_the_memory_map_zooms_and_pans_over_the_steps():
    """An eager run's thousands of steps were squeezed into ~100 columns with no way
    to look closer (debugger probe): + - zoom around the selected block, , . pan,
    0 fits, as on the timeline."""
    app = DebuggerApp(MLP, view="memory")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        memory = app.query_one(MemoryView)
        steps = app.model.steps
        await pilot.press("right")                  # select a block
        block = memory.selected_tensor()
        assert memory.window() == (0, steps)
        await pilot.press("plus", "plus")
        first, span = memory.window()
        assert span == -(-steps // 4) and first <= block["first_step"] < first + span
        assert f"steps {first}–{first + span - 1} of {steps} · zoom 4x" in \
            memory.render().plain
        await pilot.press("full_stop")
        assert memory.window()[0] > first or first + span == steps
        await pilot.press("0")
        assert memory.window() == (0, steps) and "zoom" not in memory.render().plain


# -- 6. a second probe: tinyflow debug on a fresh `train mlp --trace` record -------------

def footer(app: DebuggerApp) -> dict[str, str]:
    """{key as shown: description} of the footer's keys."""
    return {key.key_display: key.description for key in app.query(FooterKey)}


def box_in_view(view: CanvasView, key: str) -> bool:
    """Whether the whole box `key` is on screen (screen column c shows canvas column
    ox + c - 1; the first and last columns may hold a ◀ ▶ mark)."""
    box = view.canvas.boxes[key]
    ox, oy = view.origin()
    width, height = view.size
    return ox <= box.x and box.x + box.w <= ox + width - 2 and \
        oy <= box.y and box.y + 3 <= oy + height


@pilot_test
async def test_the_footer_names_what_the_keys_do_in_the_graph():
    """↑↓←→ move was missing from the footer until a search (Textual had focused the
    compare view's hidden scroll, whose own arrow keys hid the app's), and + - said
    "zoom" in the graph, where the help says (and the keys do) more / fewer hops."""
    assert "+ -  more / fewer hops" in HELP
    app = DebuggerApp(MLP)
    async with app.run_test(size=(140, 42)) as pilot:
        await opened(pilot)
        assert app.focused is None
        keys = footer(app)
        assert keys["↑↓←→"] == "move" and keys[",."] == "pan"
        assert "+-" not in keys, "the overview has no hops"
        assert keys["z"] == "neighbourhood"
        await pilot.press("z")
        await pilot.pause()
        keys = footer(app)
        assert keys["+-"] == "hops" and keys["z"] == "overview" and keys["↑↓←→"] == "move"
        hops = app.query_one(GraphView).hops
        await pilot.press("plus")
        assert app.query_one(GraphView).hops == hops + 1
        await pilot.press("2")
        await pilot.pause()
        assert footer(app)["+-"] == "zoom"
        await pilot.press("plus")
        assert app.query_one(TimelineView).zoom == 2
    app = DebuggerApp(MLP)
    async with app.run_test(size=(80, 24)) as pilot:   # all of them fit at 80 columns
        await opened(pilot)
        await pilot.press("z")
        await pilot.pause()
        assert max(key.region.right for key in app.query(FooterKey)) <= 80
        assert "r" in footer(app)


@pilot_test
async def test_a_drawing_wider_than_the_view_pans_sideways_and_marks_its_cut_edges():
    """Boxes were cut at the panel's edges ("┌mlp1▏") with no way to see the rest:
    , . pan sideways (0 goes back), and ◀ ▶ mark the rows whose boxes go on."""
    app = DebuggerApp(MLP)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        view = app.query_one(CanvasView)
        width = view.size.width
        assert view.canvas.width + 2 > width, "the overview is wider than the view"
        start = view.origin()[0]
        rows = "\n".join(view.render_line(y).text for y in range(view.size.height))
        assert "▶" in rows or "◀" in rows
        for _ in range(8):
            await pilot.press("full_stop")
        right = view.origin()[0]
        assert right > start and right == view.canvas.width + 2 - width, "to the end"
        rows = [view.render_line(y).text for y in range(view.size.height)]
        assert not any(row.endswith("▶") for row in rows), "nothing more to the right"
        await pilot.press("comma")
        assert view.origin()[0] == right - round(0.25 * width), "back at once"
        await pilot.press("0")
        assert view.origin()[0] == start


@pilot_test
async def test_the_node_the_cursor_came_from_stays_in_view():
    """↑ from an update to the learning rate it reads (a constant read by six
    updates) drew the six updates side by side, the one come from far off the view.
    It is drawn next to the cursor, and ↓ goes back to it (not to the first reader)."""
    app = DebuggerApp(MLP)
    async with app.run_test(size=(140, 42)) as pilot:
        await opened(pilot)
        graph, view = app.query_one(GraphView), app.query_one(CanvasView)
        await pilot.press("z")
        app.select("fused_sub_67")
        await pilot.press("up")
        await pilot.pause()
        assert app.selected == "constant_57"
        assert len(graph.canvas.boxes) > 6 and box_in_view(view, "constant_57")
        assert box_in_view(view, "fused_sub_67")
        came, here = graph.canvas.boxes["fused_sub_67"], graph.canvas.boxes["constant_57"]
        assert came.center == here.center, "right under it"
        await pilot.press("down")
        assert app.selected == "fused_sub_67"


def test_series_of_different_scales_get_plots_of_their_own():
    assert scale_groups([("loss", 0.6, 2.2), ("test_accuracy", 0.90, 0.99)]) == \
        [["loss"], ["test_accuracy"]]
    assert scale_groups([("train_loss", 0.5, 2.3), ("lr", 0.1, 0.1),
                         ("test_loss", 0.6, 2.0), ("bad", None, None)]) == \
        [["train_loss", "test_loss"], ["lr"], ["bad"]]


@pilot_test
async def test_loss_and_accuracy_are_each_readable_in_the_curves_view():
    """Loss (0.6–2.2) and test accuracy (0.90–0.99) on one y axis: accuracy was a
    flat line along the top. Each gets a plot of its own, on the same steps."""
    record = trace.load(MLP)
    record["scalars"] = {
        "loss": [[s, 0.6 + 1.6 * float(np.exp(-s / 40))] for s in range(225)],
        "test_accuracy": [[s, 0.90 + 0.09 * s / 224] for s in range(0, 225, 56)]}
    for size in ((140, 42), (80, 24)):
        app = DebuggerApp(record=record, view="curves")
        async with app.run_test(size=size) as pilot:
            await opened(pilot)
            await pilot.pause()
            curves = app.query_one(CurvesView)
            assert curves.plotted == [["loss"], ["test_accuracy"]]
            plots = [p for p in app.query(PlotWidget) if p.display]
            assert len(plots) == 2 and all(p.size.height >= 5 for p in plots)
            accuracy = plots[1]
            assert accuracy._y_max - accuracy._y_min < 0.2, "accuracy fills its plot"
            assert plots[0]._x_min == accuracy._x_min and plots[0]._x_max == accuracy._x_max
            assert "test_accuracy" in str(app.query_one("#plot-title-1").render())


@pilot_test
async def test_a_flat_series_draws_on_a_plot_of_its_own_and_plots_that_do_not_fit_wait():
    """A constant learning rate, alone on its plot, made textual-plot fail on ticks
    1e-6 apart. At 80x24 two plots fit: ↓ to the third series brings its plot in."""
    record = trace.load(MLP)
    record["scalars"] = {"loss": [[s, 2.0 - s / 100] for s in range(150)],
                         "accuracy": [[s, 0.9 + s / 10000] for s in range(0, 150, 10)],
                         "lr": [[s, 0.01] for s in range(150)]}
    app = DebuggerApp(record=record, view="curves")
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        await pilot.pause()
        curves = app.query_one(CurvesView)
        assert curves.plotted == [["loss"], ["accuracy"]] and curves.hidden_plots == 1
        assert "1 more plot" in str(app.query_one("#series-list").render())
        await pilot.press("down", "down")
        await pilot.pause()
        assert curves.selected_name() == "lr" and curves.plotted[-1] == ["lr"]
        lr = [p for p in app.query(PlotWidget) if p.display][-1]
        assert lr._y_min < 0.01 < lr._y_max


@pilot_test
async def test_the_outlier_flag_of_the_op_table_is_on_screen():
    """The "slowest step" column came last and was cut ("fused_assign_178
    260.3µs…"): a step 7.8x its op's mean was flagged where no one could see it.
    Its ratio and ⚠ now come before the step's name, at 140 and at 80 columns."""
    record = trace.load(MLP)
    run = len(record["timelines"]) - 1
    events = [e for e in record["timelines"][run]["events"] if e["op"] == "fused_elementwise"]
    lengths = sorted(e["end"] - e["start"] for e in events)
    events[0]["end"] = events[0]["start"] + 20 * lengths[len(lengths) // 2]
    row = RecordModel(record).op_table([run])[0]
    assert row["op"] == "fused_elementwise" and row["outlier"] >= 5
    # 80 columns, 40 rows: at 24 rows this record's three lanes leave the table no room.
    for size in ((140, 42), (80, 40)):
        app = DebuggerApp(record=record, view="timeline")
        async with app.run_test(size=size) as pilot:
            await opened(pilot)
            timeline = app.query_one(TimelineView)
            assert app.run_index == run
            lines = timeline.render().plain.split("\n")
            shown = next(line for line in lines if line.startswith("fused_elementwise"))
            shown = shown[:timeline.size.width]                # what fits on screen
            assert f"⚠{row['outlier']:.1f}x" in shown and events[0]["node"] in shown
            header = next(line for line in lines if line.startswith("op "))
            assert "slowest" in header[:timeline.size.width]
            if size[0] >= 140:
                assert "bytes" in header, "the bytes column fits at 140"


@pilot_test
async def test_five_with_one_record_says_the_compare_view_needs_two():
    app = DebuggerApp(MLP)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        await pilot.press("5")
        await pilot.pause()
        assert app.view == "graph"
        said = " ".join(str(n.message) for n in app._notifications)
        assert "needs two records" in said and "tinyflow debug A B" in said
