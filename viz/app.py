"""The debugger app: five views of one or two records, one shared cursor.

A student asks three questions of a compiled program: what did the passes do to my
graph, what ran where and when, and where did the memory go. Tools answer them
separately (tinygrad's rewrite viewer, Perfetto, PyTorch's memory_viz); here the
answers are linked. The cursor is one node id, `DebuggerApp.selected`: moving it in
any view (graph, timeline, memory) moves it in the other two (its box, its bar, its
block), and the inspector shows everything the record knows about it.

The record is read by a worker thread, so a big record never freezes the screen; a
bad, truncated or newer record ends in a plain message, not a traceback. Keys are
listed in the footer and in the help screen (``?``). The layout adapts: at 80x24
the inspector sits under the views, from 140 columns on beside them.

Beyond one post-hoc record: the curves view (``4``) plots the record's scalars;
``follow=True`` re-reads a live record (trace.LiveReader) four times a second, so
new scalars, runs and timelines appear while the script trains; a second record
(`other`) opens the compare view (``5``) and overlays its curves.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import ContentSwitcher, Footer, Input, Static

from tinyflow import trace
from viz import palette
from viz.compare_view import CompareView
from viz.curves_view import CurvesView
from viz.graph_view import GraphView
from viz.inspector import Inspector
from viz.memory_view import MemoryView
from viz.model import RecordModel
from viz.timeline_view import TimelineView

VIEWS = ("graph", "timeline", "memory", "curves", "compare")
FOLLOW_SECONDS = 0.25   # how often --follow looks for new lines
STALE_SECONDS = 5.0     # --follow: no new data for this long is worth saying
WIDE = 140   # from this many columns on, the inspector goes beside the views

HELP = """\
[b]tinyflow debug[/b]: five views of a DebugRecord, one shared cursor.
A node selected in one view is selected in the others.
(↑ ↓ PgUp PgDn Home End scroll this help; escape closes it.)

[b]Views[/b]
  1  graph     overview: layers and phases as boxes (×N = N repeated
               layers folded into one box); z: neighbourhood of a node
  2  timeline  lanes per stream, ━ critical path; below: the per-op table
  3  memory    the arena, offset by step; ▓ = shared the selected bytes
  4  curves    every scalar series (loss, accuracy, ...), smoothed; series
               of different scales get plots of their own
  5  compare   two records (tinyflow debug A B): graphs, memory, runs

[b]Everywhere[/b]
  ↑ ↓ ← →   move the cursor (graph: ↑ input, ↓ consumer, ← → same row)
  [ ]       previous / next pass (no-op passes are skipped; f shows them)
  /         search nodes by name, op, source line or memory label
            ("scratch", "variable"); n next match
  N         jump to the first node whose value held a NaN or Inf
  r R       next / previous run (when the record holds several)
  d         dark / light theme
  ?         this help          q  quit

[b]Graph[/b]     z  overview / neighbourhood   enter  expand/collapse a box
           + -  more / fewer hops   o  outline   f  show no-op passes
           , .  pan sideways (◀ ▶: more there)   0  back to the cursor
  The node the cursor came from is drawn next to it; ↓ after ↑ goes back.
[b]Timeline[/b]  + -  zoom   , .  pan   0  fit   a  op table: this run/all
  Op table: ×mean is the slowest step over its op's mean, ⚠ from 5x.
  A cell is shaded by how busy its column was: █ ▓ ▒ ░ (7/8, 5/8, 3/8 of
  its time, less); "busy N%" under a lane is its share of the run.
  ━ critical path: the chain of events that decided the run's length;
  "busy" is the work on it, the rest of the run it spent waiting. In a
  parallel run (lanes rank<r>/...) the chain crosses ranks where one
  received from another (pipeline F/B, ring steps); "F0@rank1" names the
  event of one rank. "program run N" counts runs of one compiled program:
  not the training step (an epoch's short last batch is another program).
[b]Memory[/b]    ← →  previous / next block in time   ↑ ↓  block above / below
           at the same step; click a block to select it
           + -  zoom into the steps (around the block)   , .  pan   0  fit
  █ a block of the plan  · bytes free at that step (used at others)
  ░ bytes no block of the record ever used: what held them is not recorded
  naive: every tensor its own bytes · lower bound / peak live: the most
  bytes alive at once (sizes aligned as planned) · reuse: naive / arena
[b]Curves[/b]    ↑ ↓  series   ← →  step cursor (selects the timeline the record
           ties to that step, if it ties one)
           space  show/hide series   s  smoothing (EMA weight)
Mouse: click a box, a bar or a block to select it.
Values are traced (min/max/mean/NaN per node) with
  tinyflow debug --run --check-numerics SCRIPT
"""


class HelpScreen(ModalScreen):
    """The help, scrollable: at 80x24 it is taller than the screen."""

    # The app focuses nothing (DebuggerApp.AUTO_FOCUS); here the scroll takes the
    # focus, so ↑ ↓ PgUp PgDn Home End scroll the help.
    AUTO_FOCUS = "VerticalScroll"
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 80; max-width: 100%; height: auto;
                                  max-height: 100%; border: round $accent; padding: 0 1;
                                  background: $surface; }
    HelpScreen Static { width: 100%; }
    """

    def compose(self) -> ComposeResult:
        # A scroll container takes the focus, so ↑ ↓ PgUp PgDn Home End scroll it.
        with VerticalScroll():
            yield Static(HELP)


class DebuggerApp(App):
    """`DebuggerApp(path)` opens a record file; `DebuggerApp(record=dict)` a record
    already in memory (tests). `view` picks the first view, `theme` "dark"/"light"."""

    TITLE = "tinyflow debug"
    ENABLE_COMMAND_PALETTE = False
    # Every key belongs to the app (the views are drawn, not typed in): a focused
    # widget's own bindings shadow the app's in the footer. Textual focused the
    # compare view's hidden scroll, whose ↑↓ (show=False) hid "↑↓←→ move" until a
    # search gave the focus back.
    AUTO_FOCUS = None
    CSS = """
    Screen { layout: vertical; }
    #status { height: 1; background: $panel; padding: 0 1; text-wrap: nowrap;
              text-overflow: ellipsis; }
    #body { layout: horizontal; height: 1fr; }
    #views { width: 1fr; height: 1fr; }
    #inspector { width: 46; height: 1fr; border-left: vkey $foreground 25%; }
    #body.narrow { layout: vertical; }
    #body.narrow #inspector { width: 1fr; height: 7; border-left: none;
                              border-top: hkey $foreground 25%; text-wrap: nowrap;
                              text-overflow: ellipsis; }
    #loading, #error { padding: 1 2; }
    #search { display: none; height: 1; border: none; padding: 0 1; }
    #search.open { display: block; }
    """
    BINDINGS = [
        # First in the footer, so 80 columns never cut them off.
        Binding("question_mark", "help", "help", key_display="?", priority=True),
        Binding("q", "quit", "quit", priority=True),
        # The views are listed with their numbers in the status line (the current one
        # highlighted, with the graph's mode), so the footer keeps room for the keys
        # of the current view.
        Binding("1", "show('graph')", "graph", show=False),
        Binding("2", "show('timeline')", "timeline", show=False),
        Binding("3", "show('memory')", "memory", show=False),
        Binding("4", "show('curves')", "curves", show=False),
        Binding("5", "show('compare')", "compare", show=False),
        Binding("up", "move('up')", "move", key_display="↑↓←→"),
        Binding("down", "move('down')", "move", show=False),
        Binding("left", "move('left')", "move", show=False),
        Binding("right", "move('right')", "move", show=False),
        Binding("left_square_bracket", "pass_step(-1)", "pass", key_display="[]"),
        Binding("right_square_bracket", "pass_step(1)", "next pass", show=False),
        # + - mean "more / fewer hops" in the graph and "zoom" elsewhere: one binding
        # each, so the footer names what the key does in the current view
        # (check_action enables one of them).
        Binding("plus,equals_sign", "hops(1)", "hops", key_display="+-"),
        Binding("minus", "hops(-1)", "fewer hops", show=False),
        Binding("plus,equals_sign", "zoom(2)", "zoom", key_display="+-"),
        Binding("minus", "zoom(0.5)", "zoom out", show=False),
        Binding("comma", "pan(-0.25)", "pan", key_display=",."),
        Binding("full_stop", "pan(0.25)", "pan right", show=False),
        Binding("0", "fit", "fit", show=False),
        # z names the mode it switches to.
        Binding("z", "graph_mode('neighbourhood')", "neighbourhood"),
        Binding("z", "graph_mode('overview')", "overview"),
        Binding("enter", "expand", "expand", show=False),
        Binding("o", "outline", "outline", show=False),
        Binding("f", "fold", "fold", show=False),
        Binding("a", "op_table_scope", "ops", show=False),
        Binding("space", "toggle_series", "series", show=False),
        Binding("s", "smoothing", "smooth"),
        Binding("slash", "search", "search", key_display="/"),
        Binding("n", "next_match", "next match", show=False),
        Binding("N", "first_nonfinite", "NaN"),
        Binding("r", "run_step(1)", "run"),
        Binding("R", "run_step(-1)", "previous run", show=False),
        Binding("d", "toggle_theme", "theme", show=False),
    ]

    def __init__(self, path: str | None = None, record: dict | None = None,
                 view: str = "graph", theme: str | None = None, follow: bool = False,
                 other: str | dict | None = None, other_record: dict | None = None) -> None:
        super().__init__()
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        self.path = path
        self._record = record
        self._other_source = other
        self._other_record = other_record   # B's contents, when `other` is its path, read
        self.follow = follow
        self.reader: trace.LiveReader | None = None
        self.first_view = "compare" if other is not None and view == "graph" else view
        self.view = self.first_view
        self.model: RecordModel | None = None
        self.other: RecordModel | None = None    # the B record of a comparison
        self.matches: list[str] = []             # the last search's hits
        self.error: str | None = None
        self.selected: str | None = None
        self.pass_index = 0
        self.run_index = 0
        self.load_seconds = 0.0
        self.last_change = time.monotonic()   # --follow: when the record last grew
        self._shown_quiet = ""
        if theme is not None:
            self.theme = "textual-light" if theme == "light" else "textual-dark"

    # -- building the screen ---------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Container(id="body"):
            with ContentSwitcher(initial="loading", id="views"):
                name = os.path.basename(self.path) if self.path else "record"
                yield Static(f"Loading {name} …", id="loading")
                yield Static(id="error")
                yield GraphView(id="graph")
                yield TimelineView(id="timeline")
                yield MemoryView(id="memory")
                yield CurvesView(id="curves")
                yield CompareView(id="compare")
            yield Inspector(id="inspector")
        yield Input(placeholder="search: name, op or file:line (enter; escape cancels)",
                    id="search", disabled=True)   # disabled: never takes the focus closed
        yield Footer()

    def on_mount(self) -> None:
        self._fit_layout(self.size.width)
        self.update_status()
        self.load_record()

    def on_unmount(self) -> None:
        gc.unfreeze()   # the record goes with the app (see long_lived_objects)

    def on_resize(self, event: events.Resize) -> None:
        self._fit_layout(event.size.width)

    def _fit_layout(self, width: int) -> None:
        narrow = width < WIDE
        self.query_one("#body").set_class(narrow, "narrow")
        self.query_one(GraphView).set_class(width < 100, "tiny")
        self.query_one(CurvesView).set_class(width < 100, "tiny")
        # At 80 columns the graph's keys (move, pass, hops, pan, mode, search, NaN,
        # run) fit only without the padding around each key.
        self.query_one(Footer).compact = width < 100
        if self.model is not None:
            self.sync()

    @property
    def dark(self) -> bool:
        return self.current_theme.dark

    # -- loading (in a worker thread) ------------------------------------------------

    @work(thread=True, exclusive=True, group="load")
    def load_record(self) -> None:
        start = time.perf_counter()
        try:
            with long_lived_objects():
                model = self._read_model()
        except trace.RecordError as err:
            self.call_from_thread(self.show_error, str(err))
            return
        except Exception as err:  # never a traceback on the screen
            self.call_from_thread(self.show_error, f"{type(err).__name__}: {err}")
            return
        self.load_seconds = time.perf_counter() - start
        self.call_from_thread(self.show_model, model)

    def _read_model(self) -> RecordModel:
        """The record (and the one to compare with) read and indexed: the worker's job."""
        if self._record is not None:
            record = self._record
            trace.validate(record)
        elif self.follow:
            self.reader = trace.LiveReader(self.path)
            self.reader.poll()
            record = self.reader.record or trace.empty_record(
                os.path.basename(self.path), command="(waiting for the run to start)")
        else:
            record = trace.load(self.path)
        model = RecordModel(record, self.path or "")
        if self._other_source is not None:
            other = self._other_record
            if other is None:
                other = self._other_source if isinstance(self._other_source, dict) \
                    else trace.load(self._other_source)
            trace.validate(other)
            self.other = RecordModel(other, other_name(self._other_source))
        # Warm the indexes the first screen needs, here rather than in the UI.
        model.consumers()
        model.fate(""), model.origin("")   # the inspector's pass indexes
        for run in range(len(model.timelines)):
            model.lanes(run)
        return model

    def show_error(self, message: str) -> None:
        self.error = message
        styles = palette.styles(self.dark)
        text = Text()
        text.append("Cannot open this record\n\n", styles["warn"])
        text.append(message + "\n\n")
        text.append("Press q to quit.", styles["dim"])
        self.query_one("#error", Static).update(text)
        self.query_one("#views", ContentSwitcher).current = "error"
        self.update_status()

    def show_model(self, model: RecordModel) -> None:
        if self.follow and self.reader is not None:
            self.set_interval(FOLLOW_SECONDS, self.poll_live)
            if self.waiting():   # nothing to show yet: say what we wait for
                self.show_waiting()
                return
        self.open_model(model)

    def open_model(self, model: RecordModel) -> None:
        """Show `model` on the first view, the cursor on the node worth seeing first."""
        self.model = model
        self.pass_index = model.last if model.graphs else 0
        self.run_index = self.first_run(model)
        check = model.record.get("check")
        if check:
            self.selected = check["node"]
        elif model.graphs and model.graphs[-1]["outputs"]:
            self.selected = model.graphs[-1]["outputs"][0]   # the loss, the first fetch
        elif model.schedule:
            self.selected = model.schedule[0]["node"]
        if self.view == "compare" and self.other is None:
            self.first_view = "graph"
        self.action_show(self.first_view)

    def waiting(self) -> bool:
        """--follow of a file that is not there yet (nor its live lines): a run that
        has not started, or a mistyped path. Either way the user must see which."""
        return self.follow and self.reader is not None and self.reader.record is None

    def show_waiting(self) -> None:
        """In place of the views, until the file appears: which file, and why the
        screen is empty (an empty record's "holds no graph" hid a typo)."""
        styles = palette.styles(self.dark)
        text = Text()
        text.append(f"Waiting for {self.path} to appear …\n\n", styles["warn"])
        text.append(f"No file {os.path.abspath(self.path)} yet, nor its live lines "
                    f"({os.path.basename(trace.live_path(self.path))}). It opens here "
                    "as soon as a run writes it (tf.debug.record(PATH, live=True)).\n"
                    "If no run is writing it, check the path.\n\n")
        text.append("Press q to quit.", styles["dim"])
        self.query_one("#loading", Static).update(text)
        self.update_status()

    @staticmethod
    def first_run(model: RecordModel) -> int:
        """The run to open on: the first whose values held a NaN or Inf (the run that
        failed), else the last."""
        for k, timeline in enumerate(model.timelines):
            if any(e.get("summary") and (e["summary"]["nan"] or e["summary"]["inf"])
                   for e in timeline["events"]):
                return k
        return max(len(model.timelines) - 1, 0)

    def poll_live(self) -> None:
        """--follow: apply what the run appended; rebuild the model when it grew."""
        try:
            changed = self.reader.poll()
        except trace.RecordError as err:
            self.notify(f"live record: {err}", severity="error", timeout=6)
            return
        if not changed:
            if self._quiet_label() != self._shown_quiet:   # once a second at most
                self.update_status()
            return
        self.last_change = time.monotonic()
        model = RecordModel(self.reader.record, self.path or "")
        if self.model is None:   # the file we were waiting for appeared
            self.open_model(model)
            return
        at_last_run = self.run_index >= len(self.model.timelines) - 1
        if model.graphs and not self.model.graphs:
            self.selected = model.graphs[-1]["outputs"][0] if model.graphs[-1]["outputs"] \
                else self.selected
        self.model = model
        self.query_one(GraphView).forget()
        self.pass_index = model.last if model.graphs else 0
        if at_last_run:   # keep watching the newest run unless the user went back
            self.run_index = max(len(model.timelines) - 1, 0)
        self.run_index = min(self.run_index, max(len(model.timelines) - 1, 0))
        self.sync()

    # -- the shared cursor -----------------------------------------------------------

    def select(self, node_id: str | None) -> None:
        """Move the shared cursor to `node_id` and redraw every view."""
        if node_id is None or self.model is None:
            return
        self.selected = node_id
        self.sync()

    def sync(self) -> None:
        """Redraw the visible view, the inspector and the status line."""
        if self.model is None:
            return
        views = {"graph": GraphView, "timeline": TimelineView, "memory": MemoryView,
                 "curves": CurvesView, "compare": CompareView}
        self.query_one(views[self.view]).sync()
        self.query_one(Inspector).sync()
        self.update_status()

    def update_status(self) -> None:
        styles = palette.styles(self.dark)
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("tinyflow debug ", styles["title"])
        model = self.model
        if model is None:
            if self.waiting():   # first, so that 80 columns show it whole
                text.append(f"· waiting for {self.path} to appear", styles["warn"])
            else:
                text.append("· loading" if self.error is None else "· error", styles["dim"])
            self.query_one("#status", Static).update(text, layout=False)
            return
        for k, name in enumerate(VIEWS, start=1):
            if name == "compare" and self.other is None:
                continue
            label = f" {k} {name} "
            text.append(label, styles["sel"] if name == self.view else styles["dim"])
        if self.view == "graph":
            mode = self.query_one(GraphView).mode_name()
            text.append(f" [{mode}]", styles["key"])
        text.append(f" {model.meta['title']}", styles["near"])
        if self.follow and self.reader is not None and self.reader.finished:
            text.append(" · run finished", styles["dim"])   # its final document came
        elif self.follow:
            # Not finished (or an older record without the mark): say how long nothing
            # arrived (a run that died looked like one still following).
            self._shown_quiet = self._quiet_label()
            if self._shown_quiet:
                text.append(f" · {self._shown_quiet}", styles["warn"])
            else:
                text.append(" · following", styles["ok"])
        if model.graphs:
            p = model.passes[self.pass_index]
            text.append(f" · pass {p.index}/{model.last} {p.name}", styles["dim"])
        if len(model.timelines) > 1:
            text.append(f" · timeline {self.run_index + 1} of {len(model.timelines)}",
                        styles["dim"])
        # One row whatever the text (CSS height 1): a repaint, no layout pass.
        self.query_one("#status", Static).update(text, layout=False)

    def _quiet_label(self) -> str:
        """"" while a followed record grows; else how long nothing arrived."""
        quiet = time.monotonic() - self.last_change
        if quiet < STALE_SECONDS:
            return ""
        return f"no new data for {quiet:.0f}s (run ended?)"

    # -- actions ---------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Show in the footer only the keys that do something in the current view."""
        if self.model is None and action not in ("quit", "help", "toggle_theme"):
            return False
        if self.query_one("#search", Input).has_class("open") and action in (
                "quit", "help", "search", "next_match", "first_nonfinite", "smoothing",
                "graph_mode", "toggle_theme", "run_step", "toggle_series",
                "op_table_scope"):
            return False   # typing in the search box: letters are text, not keys
        only = {"pass_step": ("graph",), "outline": ("graph",), "fold": ("graph",),
                "graph_mode": ("graph",), "expand": ("graph",), "hops": ("graph",),
                "pan": ("graph", "timeline", "memory"),
                "fit": ("graph", "timeline", "memory"),
                "op_table_scope": ("timeline",),
                "zoom": ("timeline", "memory"), "toggle_series": ("curves",),
                "smoothing": ("curves",)}
        if action in only and self.view not in only[action]:
            return False
        if action in ("graph_mode", "hops"):
            return self._graph_key_enabled(action, parameters)
        if action == "run_step" and (self.model is None or len(self.model.timelines) < 2):
            return False
        return True

    def _graph_key_enabled(self, action: str, parameters: tuple) -> bool:
        """z switches to the mode it names (the other one); + - change the hops of
        the neighbourhood and the outline's depth, which the overview has not."""
        graph = self.query_one(GraphView)
        if action == "graph_mode":
            return graph.overview_mode == (parameters[0] == "neighbourhood")
        return graph.outline_mode or not graph.overview_mode

    def action_show(self, view: str) -> None:
        if self.model is None:
            return
        if view == "compare" and self.other is None:
            # 5 is listed in the help with the other views: say why it shows nothing.
            self.notify("The compare view (5) needs two records: tinyflow debug A B "
                        "opens A and B side by side.", timeout=6)
            return
        self.view = view
        self.query_one("#views", ContentSwitcher).current = view
        self.refresh_bindings()
        self.sync()

    def action_move(self, direction: str) -> None:
        if self.model is None:
            return
        if self.view == "graph":
            self.select(self.query_one(GraphView).move(direction))
        elif self.view == "curves":
            self.query_one(CurvesView).move(direction)
            self.update_status()
        elif self.view == "compare":
            self.query_one(CompareView).scroll_by(direction)
        elif self.view == "timeline":
            self.query_one(TimelineView).choose(self.query_one(TimelineView).move(direction))
        else:
            tensor = self.query_one(MemoryView).move(direction)
            self.select(tensor["node"] if tensor else None)

    def action_pass_step(self, delta: int) -> None:
        model = self.model
        if model is None or not model.graphs:
            return
        graph = self.query_one(GraphView)
        stops = [p.index for p in model.passes] if graph.show_all_passes \
            else model.changed_passes()
        if delta > 0:
            later = [i for i in stops if i > self.pass_index]
            target = later[0] if later else self.pass_index
        else:
            earlier = [i for i in stops if i < self.pass_index]
            target = earlier[-1] if earlier else self.pass_index
        self.pass_index = target
        self.sync()

    def action_zoom(self, factor: float) -> None:
        if self.view == "timeline":
            self.query_one(TimelineView).zoom_by(factor)
        elif self.view == "memory":
            self.query_one(MemoryView).zoom_by(factor)

    def action_hops(self, delta: int) -> None:
        """The graph's + -: more / fewer hops around the selected node."""
        graph = self.query_one(GraphView)
        graph.hops = min(max(graph.hops + delta, 1), 6)
        self.sync()

    def action_pan(self, fraction: float) -> None:
        if self.view == "graph":   # sideways: a drawing wider than the view
            self.query_one(GraphView).pan(fraction)
        elif self.view in ("timeline", "memory"):
            self.query_one(TimelineView if self.view == "timeline" else MemoryView
                           ).pan(fraction)

    def action_fit(self) -> None:
        if self.view == "graph":   # back to the selected node
            self.query_one(GraphView).recentre()
        elif self.view in ("timeline", "memory"):
            self.query_one(TimelineView if self.view == "timeline" else MemoryView
                           ).reset()

    def action_graph_mode(self, mode: str) -> None:
        """z: the overview, or the neighbourhood of the selected node."""
        graph = self.query_one(GraphView)
        graph.overview_mode = mode == "overview"
        self.refresh_bindings()   # the footer's z and + - follow the mode
        self.sync()

    def action_expand(self) -> None:
        if self.model is not None and self.view == "graph":
            node = self.query_one(GraphView).expand()
            if node is not None:
                self.select(node)
            else:
                self.sync()

    def action_op_table_scope(self) -> None:
        timeline = self.query_one(TimelineView)
        timeline.all_runs = not timeline.all_runs
        timeline.refresh()

    def action_toggle_series(self) -> None:
        self.query_one(CurvesView).toggle_series()

    def action_smoothing(self) -> None:
        self.query_one(CurvesView).cycle_smoothing()

    def action_search(self) -> None:
        if self.model is None:
            return
        box = self.query_one("#search", Input)
        box.add_class("open")
        box.disabled = False
        box.value = ""
        box.focus()

    def close_search(self) -> None:
        box = self.query_one("#search", Input)
        box.remove_class("open")
        box.disabled = True
        self.set_focus(None)

    def on_key(self, event: events.Key) -> None:
        if event.key == "escape" and self.query_one("#search", Input).has_class("open"):
            self.close_search()
            event.stop()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.close_search()
        self.search(event.value)

    def search(self, query: str) -> list[str]:
        """Select the first node whose id, op or source line contains `query`."""
        self.matches = self.model.search(query, self.pass_index) if self.model else []
        if not self.matches:
            self.notify(f"no node matches {query!r} (ids, ops, file:line and memory labels "
                        "such as scratch are searched)", timeout=4)
        else:
            self.notify(f"{len(self.matches)} match{'es' if len(self.matches) > 1 else ''}"
                        f" for {query!r}; n: next", timeout=3)
            self.query_one(GraphView).show_node(self.matches[0])
            self.select(self.matches[0])
        return self.matches

    def action_next_match(self) -> None:
        if self.matches:
            k = (self.matches.index(self.selected) + 1) % len(self.matches) \
                if self.selected in self.matches else 0
            self.query_one(GraphView).show_node(self.matches[k])
            self.select(self.matches[k])

    def action_outline(self) -> None:
        graph = self.query_one(GraphView)
        graph.outline_mode = not graph.outline_mode
        self.refresh_bindings()   # + - set the outline's depth
        self.sync()

    def action_fold(self) -> None:
        graph = self.query_one(GraphView)
        graph.show_all_passes = not graph.show_all_passes
        self.sync()

    def action_first_nonfinite(self) -> None:
        if self.model is None:
            return
        node = self.model.first_nonfinite(self.run_index)
        if node is None:
            if self._values_traced():
                self.notify("No NaN or Inf in this run (values were traced).", timeout=4)
            else:
                self.notify("No NaN or Inf found, but values were not traced in this run: "
                            "record with tinyflow debug --run --check-numerics SCRIPT "
                            "(or tf.debug.record(PATH, trace_values=True)).", timeout=8)
            return
        self.query_one(GraphView).show_node(node)
        self.select(node)

    def _values_traced(self) -> bool:
        model = self.model
        return bool(model and model.timelines and any(
            e.get("summary") for e in model.timelines[self.run_index]["events"]))

    def action_run_step(self, delta: int) -> None:
        """r / R: the next / previous recorded run (wrapping around)."""
        if self.model and len(self.model.timelines) > 1:
            self.run_index = (self.run_index + delta) % len(self.model.timelines)
            self.query_one(TimelineView).reset()
            self.sync()

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.dark else "textual-dark"
        self.sync()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


@contextmanager
def long_lived_objects() -> Iterator[None]:
    """Build objects that live as long as the app without the cyclic collector
    walking them, while they are built and after.

    A 10,000-node record is millions of dicts and lists. While json and the indexes
    build them, every collection of the oldest generation walks all of those built so
    far again, and after, every one the app's drawing triggers walks them all: the
    benchmark's 18.6 MiB record opened in 2.4 s with the collector on, 1.2 s with it
    off. So the collector is paused while they are built, and then they are frozen
    (gc.freeze: kept where collections do not look; reference counting still frees
    them) until the app unmounts and puts them back (gc.unfreeze), so an app opened
    in a longer-lived process (a test, a notebook) leaks nothing.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def other_name(source: str | dict) -> str:
    return source if isinstance(source, str) else "record B"
