"""The terminal debugger: its record model, the graph drawing, every view and the
interactions that link them (driven with Textual's Pilot), a few screen snapshots,
and the exports."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tinyflow import trace
from viz import export, layout
from viz.app import DebuggerApp, HelpScreen
from viz.graph_view import CanvasView, GraphView
from viz.inspector import Inspector
from viz.memory_view import MemoryView
from viz.model import RecordModel
from viz.timeline_view import LABEL, TimelineView
from viz_pilot import FIXTURES, MLP, NAN, opened, pilot_test


@pytest.fixture(scope="module")
def record() -> dict:
    return trace.load(MLP)


@pytest.fixture(scope="module")
def model(record) -> RecordModel:
    return RecordModel(record)


# -- the model ---------------------------------------------------------------------------

def test_pass_infos_match_the_graphs(model, record):
    for info, graph in zip(model.passes, record["graphs"]):
        assert info.nodes_after == len(graph["nodes"])
        if info.index:
            before = {n["id"] for n in record["graphs"][info.index - 1]["nodes"]}
            after = {n["id"] for n in graph["nodes"]}
            assert set(info.added) == after - before
            assert set(info.removed) == before - after
            assert all(rw["pass"] == info.name for rw in info.rewrites)
    stops = model.changed_passes()
    assert stops[0] == 0
    folded = [p.index for p in model.passes if p.index and not p.changed]
    assert folded and not set(folded) & set(stops)


def test_critical_path_is_a_chain_that_ends_the_run(model):
    for run in range(len(model.timelines)):
        path = model.critical_path(run)
        events = [e for e in model.timelines[run]["events"] if id(e) in path]
        events.sort(key=lambda e: e["start"])
        assert events[-1]["end"] == max(e["end"] for e in model.timelines[run]["events"])
        for a, b in zip(events, events[1:]):
            assert a["end"] <= b["start"] + 1e-9, "each link finishes before the next starts"


def test_blame_names_the_freed_tensor_and_every_sharer(model):
    blocks = model.arena_tensors()
    checked = 0
    for tensor in blocks:
        blame = model.blame(tensor["node"])
        lo, hi = tensor["offset"], tensor["offset"] + tensor["nbytes"]
        expected = {t["node"] for t in blocks if t is not tensor
                    and t["offset"] < hi and lo < t["offset"] + t["nbytes"]}
        assert {t["node"] for t in blame.sharers} == expected
        if blame.took_from is not None:
            took = blame.took_from
            assert took["last_step"] < tensor["first_step"]
            assert took["node"] in expected
            checked += 1
    assert checked, "the fixture's plan reuses memory"


def test_first_nonfinite_and_fate(model):
    nan = RecordModel(trace.load(NAN))
    assert nan.first_nonfinite(0) == nan.record["check"]["node"]
    assert model.first_nonfinite(0) is None
    removed = next(p for p in model.passes if p.removed)
    gone = removed.removed[0]
    assert model.fate(gone).startswith(f"removed by {removed.name}")
    assert model.fate(model.schedule[0]["node"]) is None


def test_nonfinite_nodes_and_span_of_a_run(record):
    """Both are found once per run (asked on every cursor move): the nodes whose
    traced value held a NaN or Inf, and the run's first start and last end."""
    damaged = copy.deepcopy(record)
    events = damaged["timelines"][0]["events"]
    stepped = [e for e in events if e["step"] is not None]
    stepped[3]["summary"] = {"min": 0.0, "max": None, "mean": None, "nan": 2, "inf": 0}
    stepped[5]["summary"] = {"min": 0.0, "max": 1.0, "mean": 0.5, "nan": 0, "inf": 0}
    model = RecordModel(damaged)
    assert model.nonfinite(0) == {stepped[3]["node"]}
    assert model.span(0) == (min(e["start"] for e in events), max(e["end"] for e in events))
    assert RecordModel(record).nonfinite(0) == set()


def test_fate_and_origin_are_the_first_pass_and_rewrite_that_list_a_node(model):
    """fate/origin come from an index built once; they must say what a plain scan of
    the passes and their rewrites says, for every node of every graph."""
    def scan(node_id: str, side: str) -> tuple[str, str | None] | None:
        for p in model.passes:
            if node_id in getattr(p, side):
                reasons = [rw["reason"] for rw in p.rewrites if node_id in rw[side]]
                return p.name, (reasons[0] if reasons else None)
        return None
    ids = {i for k in range(len(model.graphs)) for i in model.nodes(k)}
    changed = 0
    for node_id in sorted(ids):
        for side, said in (("removed", model.fate(node_id)), ("added", model.origin(node_id))):
            expected = scan(node_id, side)
            assert (said is None) == (expected is None), (node_id, side)
            if expected is not None:
                changed += 1
                verb = "removed" if side == "removed" else "added"
                assert said.startswith(f"{verb} by {expected[0]}"), (node_id, said)
                assert (expected[1] is None) or f": {expected[1]}" in said, (node_id, said)
    assert changed > 10


# -- the drawing -------------------------------------------------------------------------

def _draw(model, center, hops=2):
    nodes, users = model.nodes(), model.consumers()
    ids = layout.neighbourhood(center, lambda i: nodes[i]["inputs"], lambda i: users[i], hops)
    boxes = {i: layout.Box(i, nodes[i]["op"], i, "node",
                           w=layout.box_width(nodes[i]["op"], i)) for i in ids}
    edges = [(a, b) for b in ids for a in nodes[b]["inputs"] if a in boxes]
    return layout.draw(boxes, edges), edges


def test_drawing_boxes_do_not_overlap_and_arrows_enter_their_targets(model):
    center = max(model.nodes(), key=lambda i: len(model.nodes()[i]["inputs"]))
    canvas, edges = _draw(model, center)
    boxes = list(canvas.boxes.values())
    for a in boxes:
        for b in boxes:
            if a is not b and a.y == b.y:
                assert a.x + a.w <= b.x or b.x + b.w <= a.x, (a.key, b.key)
    for _, target in edges:
        box = canvas.boxes[target]
        above = canvas.chars[box.y - 1][box.x:box.x + box.w]
        assert "▼" in above, f"no arrow into {target}"
    again, _ = _draw(model, center)   # the same drawing every time (no set order)
    assert again.chars == canvas.chars
    for box in boxes:  # each label sits in its box
        assert "".join(canvas.chars[box.y + 1][box.x + 1:box.x + box.w - 1]).strip()[:5] \
            == box.label[:5]


def test_neighbourhood_collapse_and_outline():
    chain = {f"n{k}": [f"n{k - 1}"] if k else [] for k in range(10_000)}
    users = {f"n{k}": [f"n{k + 1}"] if k < 9_999 else [] for k in range(10_000)}
    near = layout.neighbourhood("n500", chain.__getitem__, users.__getitem__, hops=3)
    assert sorted(near) == sorted(f"n{k}" for k in range(497, 504))
    capped = layout.neighbourhood("n500", chain.__getitem__, users.__getitem__, 50, limit=9)
    assert len(capped) == 9
    # A 10,000-deep outline: no recursion limit, and every level indented once more.
    rows = layout.outline("n9999", chain.__getitem__, lambda i: "", depth=10_000, limit=20_000)
    assert len(rows) == 10_000 and rows[-1][0].strip().endswith("n0")
    keys = layout.collapse(["a/b/x", "a/b/y", "a/c", "d", "e/f"], keep_scope="e")
    assert keys == {"a/b/x": "a/b/", "a/b/y": "a/b/", "a/c": "a/c", "d": "d", "e/f": "e/f"}


# -- the app: views and interactions -----------------------------------------------------

@pilot_test
async def test_graph_view_steps_through_passes(model):
    app = DebuggerApp(MLP)
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        graph = app.query_one(GraphView)
        assert app.pass_index == model.last and app.view == "graph"
        await pilot.press("z")               # the k-hop neighbourhood mode
        assert not graph.overview_mode
        visited = [app.pass_index]
        for _ in range(len(model.passes)):
            await pilot.press("left_square_bracket")
            visited.append(app.pass_index)
        stops = sorted(set(visited))
        assert stops == sorted(set(model.changed_passes()) | {model.last})
        # A pass that removed nodes: they are drawn, struck through, where they were.
        info = next(p for p in model.passes if p.removed and p.added)
        app.pass_index = info.index
        app.select(info.added[0])
        await pilot.pause()
        kinds = {b.key: b.kind for b in graph.canvas.boxes.values()}
        assert kinds[info.added[0]] == "sel"
        assert "removed" in kinds.values()
        assert all(k in info.removed for k, kind in kinds.items() if kind == "removed")
        caption = str(app.query_one("#graph-caption").render())
        assert f"after {info.name}" in caption
        rewrites = str(app.query_one("#rewrites").render())
        assert info.rewrites[0]["reason"][:30] in rewrites.replace("\n", " ")
        # Unfold the no-op passes: now they are stops too.
        await pilot.press("f")
        app.pass_index = 0
        steps = [0]
        for _ in range(len(model.passes)):
            await pilot.press("right_square_bracket")
            steps.append(app.pass_index)
        assert sorted(set(steps)) == list(range(len(model.passes)))


@pilot_test
async def test_graph_cursor_keys_click_outline_and_hops(model):
    app = DebuggerApp(MLP)
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        graph = app.query_one(GraphView)
        await pilot.press("z")               # the k-hop neighbourhood mode
        start = model.schedule[0]["node"]
        app.select(start)
        await pilot.press("down")
        assert app.selected == model.consumers()[start][0]
        await pilot.press("up")
        assert app.selected == model.nodes()[model.consumers()[start][0]]["inputs"][0]
        before = len(graph.canvas.boxes)
        await pilot.press("plus")
        assert graph.hops == 3 and len(graph.canvas.boxes) >= before
        # Click a box that is not the selected one: it becomes the selection.
        view = app.query_one(CanvasView)
        ox, oy = view.origin()
        width, height = view.size
        target = next(b for b in graph.canvas.boxes.values() if b.key != app.selected
                      and 0 <= b.x + 2 - ox < width and 0 <= b.y + 1 - oy < height)
        await pilot.click(CanvasView, offset=(target.x + 2 - ox, target.y + 1 - oy))
        assert app.selected == target.key
        await pilot.press("o")
        assert graph.outline_mode
        assert any(app.selected in "".join(row) for row in graph.canvas.chars)


@pilot_test
async def test_timeline_select_a_bar_and_see_its_node(model):
    app = DebuggerApp(MLP, view="timeline")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        timeline = app.query_one(TimelineView)
        app.select(model.schedule[0]["node"])
        first = timeline.current_event()
        assert first["node"] == app.selected
        lane = model.lanes(app.run_index)[first["stream"]]
        await pilot.press("right")
        assert app.selected == lane[1]["node"] and timeline.current_event() == lane[1]
        assert app.selected in str(app.query_one(Inspector).render())
        # Click the first bar of the other compute lane: its node is selected.
        await pilot.press("0")
        await pilot.pause()
        other = next(s for s, events in model.lanes(app.run_index).items()
                     if events and s != first["stream"])
        row = next(r for r, s in timeline._lane_rows.items() if s == other)
        col = next(c for c, e in enumerate(timeline._cells[other]) if e is not None)
        owner = timeline._cells[other][col]
        await pilot.click(TimelineView, offset=(LABEL + col + 1, row))
        assert app.selected == owner["node"]
        assert timeline.current_event() is owner
        # A step that waited on another stream lists the event it waited on.
        waiting = next(e for e in model.schedule if e["waits"])
        app.select(waiting["node"])
        await pilot.pause()
        text = timeline.render().plain
        assert f"waits on event {waiting['waits'][0]['event']}" in text
        assert "critical path" in text
        # Zoom, pan, fit; the run selector.
        await pilot.press("plus", "plus")
        assert timeline.zoom == 4
        before = timeline.window()[0]
        await pilot.press("full_stop")
        assert timeline.window()[0] > before
        await pilot.press("0")
        assert timeline.zoom == 1
        run = app.run_index
        await pilot.press("r")
        assert app.run_index == (run + 1) % len(model.timelines)
        # One run number in the header: the program's own, said as such (it is not the
        # training step), with the position in words.
        header = timeline.render().plain.split("\n")[0]
        number = model.timelines[app.run_index]["run"]
        assert header.startswith(f"program run {number} (timeline {app.run_index + 1} of "
                                 f"{len(model.timelines)})")
        await pilot.press("R")                # and back
        assert app.run_index == run
        # The profiler's op table under the lanes, this run and then all runs.
        assert "ops over this run" in timeline.render().plain
        await pilot.press("a")
        assert f"ops over all {len(model.timelines)} recorded runs" in timeline.render().plain


@pilot_test
async def test_memory_select_a_block_and_see_its_sharers(model):
    app = DebuggerApp(MLP, view="memory")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        memory = app.query_one(MemoryView)
        target = max(model.arena_tensors(), key=lambda t: len(model.blame(t["node"]).sharers))
        app.select(target["node"])
        await pilot.pause()
        text = memory.render().plain
        sharers = model.blame(target["node"]).sharers
        assert f"over the whole run {len(sharers)} tensors" in text.replace("\n  ", " ")
        assert "alignment" in text and "(byte " in text   # MiB first, raw bytes after
        assert sharers[0]["node"] in text and f"why: {target['reason']}" in text
        # Right moves in time order, and the block is drawn where the plan put it.
        order = sorted(model.arena_tensors(), key=lambda t: (t["first_step"], t["offset"]))
        k = order.index(target)
        await pilot.press("right")
        if k + 1 < len(order):
            assert app.selected == order[k + 1]["node"]
        cell = next((r, c) for r, row in enumerate(memory._grid)
                    for c, owner in enumerate(row) if owner is memory.selected_tensor())
        # Clicking a cell of another block selects that block.
        other = next((r, c, o) for r, row in enumerate(memory._grid)
                     for c, o in enumerate(row) if o is not None and o is not
                     memory.selected_tensor())
        await pilot.click(MemoryView, offset=(other[1] + 9 + 1, other[0] + 3))
        assert app.selected == other[2]["node"]
        assert cell is not None


@pilot_test
async def test_one_cursor_links_the_three_views(model):
    app = DebuggerApp(MLP)
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(pilot)
        await pilot.press("z")               # the k-hop neighbourhood mode
        app.select(model.schedule[0]["node"])
        await pilot.press("down")            # graph: move to a consumer
        chosen = app.selected
        await pilot.press("2")
        assert app.query_one(TimelineView).current_event()["node"] == chosen
        await pilot.press("3")
        assert app.query_one(MemoryView).selected_tensor()["node"] == chosen
        await pilot.press("left")            # memory: another block ...
        picked = app.selected
        await pilot.press("1")               # ... is the node the graph centres on
        graph = app.query_one(GraphView)
        assert graph.canvas.boxes[picked].kind == "sel"
        assert picked in str(app.query_one(Inspector).render())
        # A node that fusion removed, selected at its pass, maps to what replaced it.
        info = next(p for p in model.passes if p.removed and p.added and
                    any(model.final_id(r) for r in p.removed))
        gone = next(r for r in info.removed if model.final_id(r))
        app.select(gone)
        await pilot.press("2")
        assert app.query_one(TimelineView).current_event()["node"] == model.final_id(gone)


@pilot_test
async def test_first_nan_key_help_and_theme():
    nan_record = trace.load(NAN)
    app = DebuggerApp(NAN, view="timeline")
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        app.select(nan_record["graphs"][-1]["outputs"][0])
        await pilot.press("N")
        assert app.selected == nan_record["check"]["node"]
        assert "check_numerics" in str(app.query_one(Inspector).render())
        dark = app.dark
        await pilot.press("d")
        assert app.dark != dark
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pytest.mark.parametrize("damage,message", [
    ("truncate", "the file is truncated"),
    ("newer", "written by a newer TinyFlow (version 2 > 1)"),
    ("garbage", "not a DebugRecord"),
    ("schema", "malformed record: graphs[0].nodes[0].op"),
])
@pilot_test
async def test_bad_records_give_a_message_not_a_traceback(tmp_path, record, damage, message):
    path = tmp_path / "bad.json"
    text = json.dumps(record)
    if damage == "truncate":
        path.write_text(text[: len(text) // 3])
    elif damage == "newer":
        path.write_text(json.dumps({**record, "version": 2}))
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01 not json at all")
    else:
        broken = copy.deepcopy(record)
        broken["graphs"][0]["nodes"][0]["op"] = 7
        path.write_text(json.dumps(broken))
    app = DebuggerApp(str(path))
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        assert app.model is None and message in app.error
        assert message in str(app.query_one("#error").render())
        await pilot.press("1", "down", "N")  # keys do nothing harmful
        assert app.model is None


@pilot_test
async def test_a_2000_node_record_opens(tmp_path):
    sys.path.insert(0, FIXTURES)
    import make_record
    record = make_record.big_record(layers=110)
    assert len(record["graphs"][0]["nodes"]) >= 2000
    path = tmp_path / "big.json.gz"
    trace.save(record, path)
    app = DebuggerApp(str(path))
    async with app.run_test(size=(160, 48)) as pilot:
        await opened(pilot)
        assert app.model is not None and app.load_seconds > 0
        graph = app.query_one(GraphView)
        assert 0 < len(graph.canvas.boxes) <= layout.MAX_LAYOUT
        for key in ("down", "right", "2", "right", "3", "right", "1", "left_square_bracket"):
            await pilot.press(key)
        assert app.selected is not None


def _canvas_lines(view: CanvasView) -> list[list[tuple[str, object]]]:
    return [[(seg.text, seg.style) for seg in view.render_line(y)]
            for y in range(view.size.height)]


@pilot_test
async def test_canvas_rows_kept_across_moves_are_the_rows_drawn_afresh():
    """A cursor move keeps the strips of the canvas rows it did not change (only the
    two restyled boxes are rebuilt): what the view shows must be what a view with no
    kept strips shows, after moves, a box expanded, the other mode and the theme."""
    app = DebuggerApp(MLP)
    async with app.run_test(size=(160, 48)) as pilot:
        await opened(pilot)
        view = app.query_one("#graph-canvas", CanvasView)
        for key in ("down", "up", "up", "enter", "down", "d", "left", "z", "down", "d", "up"):
            await pilot.press(key)
            await pilot.pause()
            kept = _canvas_lines(view)
            view._rows.clear()
            assert kept == _canvas_lines(view), f"after {key!r}"


def parallel_record() -> dict:
    """A pipeline run on 2 ranks as `rank_trace.scheme_record` builds it (what
    tutorials/train_parallel.py --trace writes): a compute and a comm lane per rank,
    no step schedule, and each rank's arrays as the memory plan."""
    import numpy as np

    from tinyflow.rank_trace import scheme_record
    events = []
    for rank in range(2):
        for k, stream in enumerate(("compute", "comm")):
            start = 0.001 * (rank + k)
            events.append({"node": f"F{rank}{k}", "op": "F", "stream": f"rank{rank}/{stream}",
                           "start": start, "end": start + 0.0008})
    held = {0: {"w0": np.zeros((64, 32)), "b0": np.zeros(32)},
            1: {"w1": np.zeros((32, 10))}}
    return scheme_record(events, "pp on 2 ranks", held=held)


@pilot_test
async def test_parallel_lane_names_are_whole_and_distinct():
    """rank0/compute and rank0/comm were both cut to "rank0/com": the label column
    is as wide as the longest lane name."""
    app = DebuggerApp(record=parallel_record(), view="timeline")
    async with app.run_test(size=(140, 42)) as pilot:
        await opened(pilot)
        timeline = app.query_one(TimelineView)
        rows = timeline.render().plain.split("\n")
        labels = [rows[r].split()[0] for r in sorted(timeline._lane_rows)]
        assert labels == ["rank0/comm", "rank0/compute", "rank1/comm", "rank1/compute"]
        # A click just right of the longer labels still lands on the bar there.
        row, stream = next(iter(timeline._lane_rows.items()))
        col = next(c for c, e in enumerate(timeline._cells[stream]) if e is not None)
        await pilot.click(TimelineView, offset=(timeline.label_width + col + 1, row))
        assert app.selected == timeline._cells[stream][col]["node"]


@pilot_test
async def test_memory_of_a_parallel_record_shows_bytes_per_rank():
    """A parallel record's plan holds each rank's bytes (no strategies) and no step
    schedule (no live bytes): the header says so instead of "peak live 0 B"."""
    app = DebuggerApp(record=parallel_record(), view="memory")
    async with app.run_test(size=(140, 42)) as pilot:
        await opened(pilot)
        text = app.query_one(MemoryView).render().plain
        header = "\n".join(text.split("\n")[:2])
        assert "strategies" not in header and "peak live 0 B" not in header
        assert "held by 2 ranks 18.8 KiB" in header
        assert "per rank: rank 0 16.2 KiB · rank 1 2.5 KiB" in header
        assert "peak live not recorded" in header
        live = next(line for line in text.split("\n") if line.startswith("live "))
        assert "not recorded" in live and "▁" not in live


# -- snapshots ---------------------------------------------------------------------------

async def _ready(pilot) -> None:
    await opened(pilot)
    await pilot.pause()


@pytest.mark.parametrize("view,size,theme", [
    ("graph", (80, 24), "dark"), ("graph", (160, 48), "dark"),
    ("timeline", (80, 24), "dark"), ("timeline", (160, 48), "light"),
    ("memory", (80, 24), "light"), ("memory", (160, 48), "dark"),
])
def test_snapshots(snap_compare, view, size, theme):
    app = DebuggerApp(MLP, view=view, theme=theme)
    assert snap_compare(app, terminal_size=size, run_before=_ready)


# -- exports -----------------------------------------------------------------------------

def test_to_dot_marks_what_a_pass_did(record):
    info = RecordModel(record).passes
    changed = next(p for p in info if p.removed and p.added)
    source = export.to_dot(record, after_pass=changed.name)
    for gone in changed.removed:
        assert f'"{gone}"' in source or f"{gone} [" in source
    assert "dashed" in source and "#2e7d32" in source
    last = export.to_dot(record)
    assert "dashed" not in last or info[-1].removed
    with pytest.raises(export.ExportError, match="no pass 'nope'"):
        export.to_dot(record, after_pass="nope")


def test_export_command_line(tmp_path, monkeypatch):
    out = tmp_path / "g.dot"
    assert export.main([MLP, "--dot", str(out), "--after", "1"]) == 0
    assert out.read_text().startswith("digraph")
    perfetto = tmp_path / "t.json"
    assert export.main([MLP, "--perfetto", str(perfetto), "--run", "0"]) == 0
    events = json.loads(perfetto.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)
    svg = tmp_path / "g.svg"
    if export.find_dot():
        assert export.main([MLP, "--dot", str(svg)]) == 0
        assert "<svg" in svg.read_text()
    monkeypatch.setattr(export, "find_dot", lambda: None)
    monkeypatch.delenv("TINYFLOW_DOT", raising=False)
    with pytest.raises(export.ExportError, match="pip install graphviz-pure"):
        export.write_dot(trace.load(MLP), str(tmp_path / "x.svg"))


def test_python_m_viz_errors_are_plain(tmp_path):
    bad = tmp_path / "newer.json"
    bad.write_text(json.dumps({"format": trace.FORMAT, "version": 9}))
    done = subprocess.run([sys.executable, "-m", "viz", "export", str(bad), "--perfetto",
                           str(tmp_path / "p.json")], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "written by a newer TinyFlow (version 9 > 1)" in done.stderr
    done = subprocess.run([sys.executable, "-m", "viz", str(tmp_path / "missing.json")],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "no such file" in done.stderr


@pilot_test
async def test_sparse_records_open_in_every_view(record):
    """A record with no graph at all, and one with graphs but no runs or plan
    (compile(debug=...) before the first run), open without errors in every view."""
    bare = trace.empty_record("empty")
    graphs_only = {**trace.empty_record("graphs only"), "graphs": record["graphs"],
                   "rewrites": record["rewrites"]}
    for rec in (bare, graphs_only):
        app = DebuggerApp(record=copy.deepcopy(rec))
        async with app.run_test(size=(80, 24)) as pilot:
            await opened(pilot)
            assert app.error is None and app.model is not None
            for key in ("down", "left_square_bracket", "2", "right", "plus", "3", "left",
                        "N", "r", "1", "o"):
                await pilot.press(key)
            await pilot.press("2")
            assert "no timeline" in app.query_one(TimelineView).render().plain
            await pilot.press("3")
            assert "no memory plan" in app.query_one(MemoryView).render().plain
