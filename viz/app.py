"""The debugger app: three views of one record, one shared cursor.

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
"""

from __future__ import annotations

import os
import time

from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.screen import ModalScreen
from textual.widgets import ContentSwitcher, Footer, Static

from tinyflow import trace
from viz import palette
from viz.graph_view import GraphView
from viz.inspector import Inspector
from viz.memory_view import MemoryView
from viz.model import RecordModel
from viz.timeline_view import TimelineView

VIEWS = ("graph", "timeline", "memory")
WIDE = 140   # from this many columns on, the inspector goes beside the views

HELP = """\
[b]tinyflow debug[/b]: three views of one DebugRecord, one shared cursor.
A node selected in one view is selected in the others.

[b]Views[/b]
  1  graph     the graph after each pass; added nodes green, removed red
  2  timeline  one lane per stream, bars to scale, ━ marks the critical path
  3  memory    the arena, offset by step; ▓ = shared the selected bytes

[b]Everywhere[/b]
  ↑ ↓ ← →   move the cursor (graph: ↑ input, ↓ consumer, ← → same row)
  [ ]       previous / next pass (no-op passes are skipped; f shows them)
  N         jump to the first node whose value held a NaN or Inf
  r         next run (when the record holds several)
  d         dark / light theme
  ?         this help          q  quit

[b]Graph[/b]   + -  more / fewer hops around the node   o  outline
[b]Timeline[/b]  + -  zoom   , .  pan   0  fit the whole run
Mouse: click a box, a bar or a block to select it.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 80; max-width: 100%; height: auto; max-height: 100%;
                            border: round $accent; padding: 0 1; background: $surface; }
    HelpScreen Static { width: 100%; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)


class DebuggerApp(App):
    """`DebuggerApp(path)` opens a record file; `DebuggerApp(record=dict)` a record
    already in memory (tests). `view` picks the first view, `theme` "dark"/"light"."""

    TITLE = "tinyflow debug"
    ENABLE_COMMAND_PALETTE = False
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
    """
    BINDINGS = [
        Binding("1", "show('graph')", "graph"),
        Binding("2", "show('timeline')", "timeline"),
        Binding("3", "show('memory')", "memory"),
        Binding("up", "move('up')", "move", key_display="↑↓←→"),
        Binding("down", "move('down')", "move", show=False),
        Binding("left", "move('left')", "move", show=False),
        Binding("right", "move('right')", "move", show=False),
        Binding("left_square_bracket", "pass_step(-1)", "pass", key_display="[]"),
        Binding("right_square_bracket", "pass_step(1)", "next pass", show=False),
        Binding("plus,equals_sign", "zoom(2)", "zoom", key_display="+-"),
        Binding("minus", "zoom(0.5)", "zoom out", show=False),
        Binding("comma", "pan(-0.25)", "pan", key_display=",."),
        Binding("full_stop", "pan(0.25)", "pan right", show=False),
        Binding("0", "fit", "fit", show=False),
        Binding("o", "outline", "outline"),
        Binding("f", "fold", "fold", show=False),
        Binding("N", "first_nonfinite", "NaN"),
        Binding("r", "next_run", "run"),
        Binding("d", "toggle_theme", "theme"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, path: str | None = None, record: dict | None = None,
                 view: str = "graph", theme: str | None = None) -> None:
        super().__init__()
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        self.path = path
        self._record = record
        self.first_view = view
        self.view = view
        self.model: RecordModel | None = None
        self.error: str | None = None
        self.selected: str | None = None
        self.pass_index = 0
        self.run_index = 0
        self.load_seconds = 0.0
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
            yield Inspector(id="inspector")
        yield Footer()

    def on_mount(self) -> None:
        self._fit_layout(self.size.width)
        self.update_status()
        self.load_record()

    def on_resize(self, event: events.Resize) -> None:
        self._fit_layout(event.size.width)

    def _fit_layout(self, width: int) -> None:
        narrow = width < WIDE
        self.query_one("#body").set_class(narrow, "narrow")
        self.query_one(GraphView).set_class(width < 100, "tiny")
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
            record = self._record if self._record is not None else trace.load(self.path)
            if self._record is not None:
                trace.validate(record)
            model = RecordModel(record, self.path or "")
            # Warm the indexes the first screen needs, here rather than in the UI.
            model.consumers()
            for run in range(len(model.timelines)):
                model.lanes(run)
        except trace.RecordError as err:
            self.call_from_thread(self.show_error, str(err))
            return
        except Exception as err:  # never a traceback on the screen
            self.call_from_thread(self.show_error, f"{type(err).__name__}: {err}")
            return
        self.load_seconds = time.perf_counter() - start
        self.call_from_thread(self.show_model, model)

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
        self.model = model
        self.pass_index = model.last if model.graphs else 0
        self.run_index = max(len(model.timelines) - 1, 0)
        check = model.record.get("check")
        if check:
            self.selected = check["node"]
        elif model.schedule:
            self.selected = model.schedule[0]["node"]
        elif model.graphs and model.graphs[-1]["outputs"]:
            self.selected = model.graphs[-1]["outputs"][0]
        self.action_show(self.first_view)

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
        views = {"graph": GraphView, "timeline": TimelineView, "memory": MemoryView}
        self.query_one(views[self.view]).sync()
        self.query_one(Inspector).sync()
        self.update_status()

    def update_status(self) -> None:
        styles = palette.styles(self.dark)
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("tinyflow debug ", styles["title"])
        model = self.model
        if model is None:
            text.append("· loading" if self.error is None else "· error", styles["dim"])
            self.query_one("#status", Static).update(text)
            return
        for k, name in enumerate(VIEWS, start=1):
            label = f" {k} {name} "
            text.append(label, styles["sel"] if name == self.view else styles["dim"])
        text.append(f" {model.meta['title']}", styles["near"])
        if model.graphs:
            p = model.passes[self.pass_index]
            text.append(f" · pass {p.index}/{model.last} {p.name}", styles["dim"])
        if len(model.timelines) > 1:
            text.append(f" · run {self.run_index + 1}/{len(model.timelines)}", styles["dim"])
        self.query_one("#status", Static).update(text)

    # -- actions ---------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Show in the footer only the keys that do something in the current view."""
        if self.model is None and action not in ("quit", "help", "toggle_theme"):
            return False
        only = {"pass_step": ("graph",), "outline": ("graph",), "fold": ("graph",),
                "pan": ("timeline",), "fit": ("timeline",),
                "zoom": ("graph", "timeline")}
        if action in only and self.view not in only[action]:
            return False
        if action == "next_run" and (self.model is None or len(self.model.timelines) < 2):
            return False
        return True

    def action_show(self, view: str) -> None:
        if self.model is None:
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
        elif self.view == "graph":
            graph = self.query_one(GraphView)
            graph.hops = min(max(graph.hops + (1 if factor > 1 else -1), 1), 6)
            self.sync()

    def action_pan(self, fraction: float) -> None:
        if self.view == "timeline":
            self.query_one(TimelineView).pan(fraction)

    def action_fit(self) -> None:
        if self.view == "timeline":
            self.query_one(TimelineView).reset()

    def action_outline(self) -> None:
        graph = self.query_one(GraphView)
        graph.outline_mode = not graph.outline_mode
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
            self.notify("No NaN or Inf in this run (values traced: "
                        f"{'yes' if self._values_traced() else 'no'})", timeout=4)
            return
        self.select(node)

    def _values_traced(self) -> bool:
        model = self.model
        return bool(model and model.timelines and any(
            e.get("summary") for e in model.timelines[self.run_index]["events"]))

    def action_next_run(self) -> None:
        if self.model and len(self.model.timelines) > 1:
            self.run_index = (self.run_index + 1) % len(self.model.timelines)
            self.query_one(TimelineView).reset()
            self.sync()

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.dark else "textual-dark"
        self.sync()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
