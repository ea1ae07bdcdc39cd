"""The timeline view: what ran where and when, one lane per stream.

Each step of a run is a bar on its stream's lane, to scale (zoom ``+``/``-``, pan
``,``/``.``, ``0`` to fit). Under each lane a ``━`` marks the critical path, the
chain of steps that decided how long the run took (see `RecordModel.critical_path`).
The gap before a step that waited on another stream is drawn ``┄`` and listed
below with the event it waited on. Communication (ring allreduce chunks) has its own
"comm" lane. ``r``/``R`` switch between the runs the record holds.

Under the lanes, a profiler's summary: the per-op table PyTorch's profiler prints
(total time, count, mean, share, bytes, sorted by total), over the selected run or
all recorded runs (``a``), with each op's slowest step and how many times its mean
that was, so an outlier (one 8 ms matmul among 0.09 ms siblings) stands out.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from rich.text import Text
from textual.events import Click
from textual.widget import Widget

from viz import palette
from viz.model import fmt_bytes, fmt_shape, fmt_time

if TYPE_CHECKING:
    from viz.app import DebuggerApp

LABEL = 10   # the fewest columns for the lane names (wider when a name needs it)
OUTLIER = 5.0   # an op's slowest step this many times its mean or more is flagged ⚠
# The per-op table (see `op_columns`): the op column is OP_COLUMNS wide at most;
# FIXED_COLUMNS are total, count, mean, share, slowest, ×mean and a space.
OP_COLUMNS, MIN_OP_COLUMNS, STEP_COLUMNS = 22, 10, 16
FIXED_COLUMNS = 8 + 6 + 8 + 7 + 8 + 6 + 1
BYTES_COLUMNS = 10


class TimelineView(palette.TextLines, Widget):
    """Lanes of bars; the bar under the shared cursor is highlighted."""

    DEFAULT_CSS = """
    TimelineView { height: 1fr; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.zoom = 1.0
        self.view_start: float | None = None
        self.cursor: dict | None = None   # the event under the cursor
        self._lane_rows: dict[int, int] = {}  # row on screen -> stream
        self._cells: dict[int, list] = {}      # stream -> owner event per column
        self.all_runs = False                  # op table over every recorded run
        self.label_width = LABEL               # columns of the lane names, as drawn

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    def sync(self) -> None:
        self.refresh()

    # -- the cursor ------------------------------------------------------------------

    def current_event(self) -> dict | None:
        """The event to highlight: the one moved to here if it still belongs to the
        selection, else the step event of the selected node.

        The event itself is kept, not its name: a parallel run's events are no
        nodes of the graph (final_id is None) and every rank has its own "F0", so
        only the event picked tells which one is meant."""
        app = self.tapp
        model = app.model
        if model is None or not model.timelines or app.selected is None:
            return None
        final = model.final_id(app.selected)
        if self.cursor is not None and self.cursor["node"] in (app.selected, final) and \
                any(e is self.cursor for e in model.timelines[app.run_index]["events"]):
            return self.cursor
        return model.events_of(app.run_index).get(final) if final else None

    def move(self, direction: str) -> dict | None:
        """The event the cursor goes to: left/right along the lane, up/down to the
        nearest event in time on the lane above/below."""
        model = self.tapp.model
        if model is None or not model.timelines:
            return None
        run = self.tapp.run_index
        lanes = model.lanes(run)
        current = self.current_event()
        streams = [s for s in lanes if lanes[s]]
        if not streams:
            return None
        if current is None:
            return lanes[streams[0]][0]
        lane = lanes[current["stream"]]
        k = next(i for i, e in enumerate(lane) if e is current)
        if direction in ("left", "right"):
            k += -1 if direction == "left" else 1
            return lane[k] if 0 <= k < len(lane) else None
        s = streams.index(current["stream"]) + (-1 if direction == "up" else 1)
        if not 0 <= s < len(streams):
            return None
        middle = (current["start"] + current["end"]) / 2
        return min(lanes[streams[s]], key=lambda e: abs((e["start"] + e["end"]) / 2 - middle))

    def choose(self, event: dict | None) -> None:
        if event is not None:
            self.cursor = event
            self.tapp.select(event["node"])
            self.keep_visible(event)

    def keep_visible(self, event: dict) -> None:
        start, width = self.window()
        if event["start"] < start or event["end"] > start + width:
            self.view_start = max(0.0, (event["start"] + event["end"]) / 2 - width / 2)
        self.refresh()

    # -- zoom and pan --------------------------------------------------------------------

    def window(self) -> tuple[float, float]:
        """(start, width) in seconds of the visible part of the run."""
        model = self.tapp.model
        t0, t1 = model.span(self.tapp.run_index) if model else (0.0, 1e-6)
        width = (t1 - t0) / self.zoom or 1e-9
        start = t0 if self.view_start is None else self.view_start
        start = min(max(start, t0), max(t0, t1 - width))
        return start, width

    def zoom_by(self, factor: float) -> None:
        start, width = self.window()
        event = self.current_event()
        middle = (event["start"] + event["end"]) / 2 if event else start + width / 2
        self.zoom = min(max(self.zoom * factor, 1.0), 4096.0)
        t0, t1 = self.tapp.model.span(self.tapp.run_index) if self.tapp.model else (0, 1e-6)
        self.view_start = middle - (t1 - t0) / self.zoom / 2
        self.refresh()

    def pan(self, fraction: float) -> None:
        start, width = self.window()
        self.view_start = start + fraction * width
        self.refresh()

    def reset(self) -> None:
        self.zoom, self.view_start = 1.0, None
        self.refresh()

    # -- drawing ---------------------------------------------------------------------

    def render(self) -> Text:
        app = self.tapp
        model = app.model
        styles = palette.styles(app.dark)
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        if model is None:
            return text
        if not model.timelines:
            text.append("This record holds no timeline: run the program with tracing on\n"
                        "(tf.debug.record(...) around Session.run, or tinyflow train "
                        "--trace).", styles["dim"])
            return text
        run = app.run_index
        lanes = model.lanes(run)
        self.label_width = self._label_columns([model.streams.get(s, str(s)) for s in lanes])
        critical = model.critical_path(run)
        selected = self.current_event()
        self._header(text, model, run, styles)
        self._lanes(text, model, run, selected, styles)
        text.append("\n")
        if selected is None:
            self._nothing_selected(text, model, run, styles)
        else:
            self._event_lines(text, model, run, selected, critical, styles)
        room = self.size.height - text.plain.count("\n") - 1
        if room >= 4:
            self._op_table(text, model, run, styles, room - 1)
        # With room to spare (a tall terminal), the critical path and every wait.
        room = self.size.height - text.plain.count("\n") - 1
        if room >= 3:
            room -= self._critical_chain(text, model, run, critical, styles, room - 1)
        if room >= 3:
            self._waits(text, model, run, selected, styles, room)
        return text

    def _lanes(self, text: Text, model, run: int, selected: dict | None,
               styles: dict) -> None:
        """The time axis, then per lane its bars and, under them, how busy it was
        and ━ where the critical path runs."""
        label_cols = self.label_width
        width = max(self.size.width - label_cols, 10)
        start, span = self.window()
        per_col = span / width
        critical = model.critical_path(run)
        t0, t1 = model.span(run)
        text.append(" " * label_cols + time_axis(start, t0, per_col, width) + "\n",
                    styles["axis"])
        self._lane_rows.clear()
        self._cells.clear()
        row = text.plain.count("\n")
        busy = model.lane_busy(run)
        for stream, events in model.lanes(run).items():
            owners, fill = self._owners(events, start, per_col, width)
            mine = selected if selected is not None and selected["stream"] == stream \
                else None
            if mine is not None:
                c0 = int((mine["start"] - start) / per_col)
                c1 = max(c0, int((mine["end"] - start) / per_col - 1e-9))
                for c in range(max(c0, 0), min(c1, width - 1) + 1):
                    owners[c] = mine
                    fill[c] = max(fill[c], 1e-9)
            self._cells[stream] = owners
            self._lane_rows[row] = stream
            name = model.streams.get(stream, str(stream))
            text.append(lane_label(name, label_cols), styles["title"])
            self._bars(text, owners, fill, mine, styles, self.tapp.dark, start, per_col,
                       model, run)
            text.append("\n")
            share = busy.get(stream, 0.0) / max(t1 - t0, 1e-12)
            text.append(f"{f'busy {share:.0%}':<{label_cols}}", styles["dim"])
            for owner in owners:
                on_path = owner is not None and id(owner) in critical
                text.append("━" if on_path else " ", styles["crit"] if on_path else None)
            text.append("\n")
            row += 2

    def _waits(self, text: Text, model, run: int, selected: dict | None, styles: dict,
               room: int) -> None:
        """Every cross-stream wait of the schedule, as many as fit in `room`."""
        waits = [(e, w) for e in model.schedule for w in e["waits"]]
        if not waits:
            return
        text.append(f"\ncross-stream waits ({len(waits)}):\n", styles["title"])
        events = model.events_of(run)
        chosen = selected["node"] if selected else None
        for entry, wait in waits[:room - 2]:
            producer = model.entry_of_step[wait["step"]]["node"]
            mine, done = events.get(entry["node"]), events.get(producer)
            slack = f", ready {fmt_time(max(0.0, mine['start'] - done['end']))} before" \
                if mine and done else ""
            text.append(f"  {entry['node']} ({model.streams.get(entry['stream'])}) "
                        f"waits on event {wait['event']} ← {producer} "
                        f"({model.streams.get(wait['stream'])}){slack}\n",
                        styles["edge_sel"] if chosen == entry["node"] else styles["dim"])

    def _header(self, text: Text, model, run: int, styles: dict) -> None:
        """Which run, its length and zoom, and the critical path's figures: its
        steps (on how many lanes) and the time they worked, out of the run's length
        (the rest the path spent waiting: transfers, idle ranks). Wrapped between
        figures when the view is narrow."""
        timeline = model.timelines[run]
        t0, t1 = model.span(run)
        critical = model.critical_path(run)
        lanes = {e["stream"] for e in timeline["events"] if id(e) in critical}
        steps = f"{len(critical)} step{'s' if len(critical) != 1 else ''}"
        if len(lanes) > 1:
            steps += f" on {len(lanes)} lanes"
        # One run number only: the program's own count ("program run 1319"), with the
        # position among the recorded timelines in words.
        palette.wrap_parts(text, [
            [(run_label(timeline), styles["title"]),
             (f" (timeline {run + 1} of {len(model.timelines)})", styles["dim"])],
            [(fmt_time(t1 - t0), styles["dim"])],
            [(f"zoom {self.zoom:g}x", styles["dim"])],
            [("━ critical path", styles["crit"]), (f" {steps}", styles["dim"])],
            [(f"busy {fmt_time(model.critical_busy(run))} of {fmt_time(t1 - t0)}",
              styles["dim"])],
        ], self.size.width, sep_style=styles["dim"])

    def _nothing_selected(self, text: Text, model, run: int, styles: dict) -> None:
        what = self.tapp.selected or "nothing"
        if any(e["step"] is not None for e in model.timelines[run]["events"]):
            text.append(f"{what}: no step in this run ", styles["dim"])
            text.append("(sources and constants folded away do not run)\n", styles["dim"])
        else:   # a parallel run's events are not nodes of the graph
            text.append(f"{what}: not an event of this run; ←→↑↓ or a click select a bar\n",
                        styles["dim"])

    def _event_lines(self, text: Text, model, run: int, event: dict, critical: set,
                     styles: dict) -> None:
        """The selected bar: its node (or event), lane, times and bytes; then what
        the record says about it (rank, microbatch, args) and what it waited on."""
        t0 = model.span(run)[0]
        node = model.nodes().get(event["node"]) if event["step"] is not None else None
        shape = f" {fmt_shape(node.get('shape'))}" if node else ""
        near = styles["near"]
        groups = [[(model.event_name(event, run), styles["edge_sel"])],
                  [(f"{event['op']}{shape} on {model.streams.get(event['stream'])}", near)],
                  [(f"{fmt_time(event['start'] - t0)} → {fmt_time(event['end'] - t0)}"
                    f" ({fmt_time(event['end'] - event['start'])})", near)],
                  [(fmt_bytes(event["bytes"]), near)]]
        if id(event) in critical:
            groups.append([("on the critical path", styles["crit"])])
        palette.wrap_parts(text, groups, self.size.width, sep="  ")
        facts = model.event_facts(event)
        if facts:
            for line in textwrap.wrap(" · ".join(facts), max(self.size.width - 2, 20)):
                text.append(f"  {line}\n", styles["dim"])
        if event["step"] is not None:
            for line in model.waits_of(event["node"], run) or ["no cross-stream waits"]:
                text.append(f"  {line}\n", styles["wait"])
        for source in model.received(run).get(id(event), []):
            gap = event["start"] - source["end"]
            when = f"it ended {fmt_time(gap)} before this started" if gap >= 0 else \
                f"it ended {fmt_time(-gap)} after this started: this waited inside"
            text.append(f"  received from {model.event_name(source, run)} ({when})\n",
                        styles["wait"])

    def _critical_chain(self, text: Text, model, run: int, critical: set, styles: dict,
                        room: int) -> int:
        """The critical path's events in order, wrapped between names over at most
        `room` lines, the last ending "… +N more" when not all fit. Returns the
        lines written."""
        chain = sorted((e for e in model.timelines[run]["events"] if id(e) in critical),
                       key=lambda e: e["start"])
        names = [model.event_name(e, run) for e in chain]
        lines = wrap_names(names, max(self.size.width, 20), "critical path: ", room)
        text.append("\n")
        for k, line in enumerate(lines):
            if k == 0:
                text.append("critical path:", styles["crit"])
                line = line[len("critical path:"):]
            text.append(line + "\n", styles["dim"])
        return len(lines) + 1

    def _op_table(self, text: Text, model, run: int, styles: dict, room: int) -> None:
        """The per-op summary, as many rows as fit in `room`.

        The slowest step's time and how many times its op's mean it took come
        before the step's name, in columns of their own, and a step of
        OUTLIER times its mean or more is flagged ⚠ there: at the end of the row,
        after a long name, the flag was cut off. The op column narrows (its names
        end in "…") and then the bytes column goes, so the name of the slowest
        step keeps at least STEP_COLUMNS."""
        runs = list(range(len(model.timelines))) if self.all_runs else [run]
        rows = model.op_table(runs)
        scope = f"all {len(runs)} recorded runs" if self.all_runs else "this run"
        text.append(f"\nops over {scope} (a: {'this run' if self.all_runs else 'all runs'})\n",
                    styles["title"])
        name_w, with_bytes = op_columns([row["op"] for row in rows], self.size.width)
        bytes_head = f"{'bytes':>10}" if with_bytes else ""
        step_w = self.size.width - name_w - FIXED_COLUMNS - len(bytes_head)
        text.append(f"{'op':<{name_w}}{'total':>8}{'count':>6}{'mean':>8}{'share':>7}"
                    f"{bytes_head}{'slowest':>8}{'×mean':>6} step\n", styles["dim"])
        for row in rows[:max(room - 2, 1)]:
            worst, node, worst_run = row["worst"]
            flag = row["outlier"] >= OUTLIER and row["count"] > 1
            cells = f"{fmt_bytes(row['bytes']):>10}" if with_bytes else ""
            text.append(f"{elide_name(row['op'], name_w - 1):<{name_w}}"
                        f"{fmt_time(row['total']):>8}{row['count']:>6}"
                        f"{fmt_time(row['mean']):>8}{row['share'] * 100:>6.1f}%{cells}"
                        f"{fmt_time(worst):>8}", styles["warn"] if flag else None)
            ratio = f"{'⚠' if flag else ''}{fmt_ratio(row['outlier'])}"
            text.append(f"{ratio:>6}", styles["warn"] if flag else styles["dim"])
            # Which run, when it fits whole: cut, it cut the step's name instead.
            where = f" ({run_label(model.timelines[worst_run])})" if self.all_runs else ""
            if len(node) + len(where) > step_w:
                where = ""
            text.append(f" {node}{where}\n", styles["warn"] if flag else styles["dim"])

    def _label_columns(self, names: list[str]) -> int:
        """Columns for the lane names: the longest name and a space, so lanes such
        as rank0/compute and rank0/comm are told apart; at least LABEL, and at most a
        third of the view, so the bars keep most of the width."""
        longest = max((len(name) for name in names), default=0) + 1
        return max(LABEL, min(longest, self.size.width // 3))

    @staticmethod
    def _owners(events: list[dict], start: float, per_col: float, width: int
                ) -> tuple[list, list[float]]:
        """For each column, the event that covers most of it (None: idle), and the
        share of the column's time some event covered (0 to 1): a column where an
        eager run spent 23% of its time in ops and the rest in Python is 0.23."""
        owners: list = [None] * width
        cover = [0.0] * width
        fill = [0.0] * width
        for event in events:
            if event["end"] < start or event["start"] > start + per_col * width:
                continue
            c0 = max(int((event["start"] - start) / per_col), 0)
            c1 = min(int((event["end"] - start) / per_col), width - 1)
            for c in range(c0, c1 + 1):
                lo = max(event["start"], start + c * per_col)
                hi = min(event["end"], start + (c + 1) * per_col)
                fill[c] += max(hi - lo, 0.0) / per_col
                # A step shorter than a column still shows: its share is at least tiny.
                share = max(hi - lo, 1e-15)
                if share > cover[c]:
                    cover[c], owners[c] = share, event
        return owners, [min(f, 1.0) for f in fill]

    def _bars(self, text: Text, owners: list, fill: list[float], selected: dict | None,
              styles: dict, dark: bool, start: float, per_col: float, model, run: int
              ) -> None:
        """One lane's bars; `selected` is the cursor's event if it is on this lane.
        A cell is shaded by how busy its column was (`shade`): a lane of many short
        ops with gaps between them is not drawn as one solid bar."""
        gap = self._wait_gap(owners, selected, start, per_col, model, run)
        c = 0
        width = len(owners)
        while c < width:
            owner = owners[c]
            if owner is None:
                text.append("┄" if c in gap else " ", styles["wait"] if c in gap else None)
                c += 1
                continue
            end = c
            while end + 1 < width and owners[end + 1] is owner:
                end += 1
            text.append(*bar_cells(owners, fill, c, end, owner is selected, styles, dark))
            c = end + 1

    @staticmethod
    def _wait_gap(owners: list, selected: dict | None, start: float, per_col: float,
                  model, run: int) -> set[int]:
        """The idle columns before the selected step, when it waited on another
        stream (drawn ┄)."""
        gap: set[int] = set()
        if selected is None or selected["step"] is None or \
                not model.entry_of_step[selected["step"]]["waits"]:
            return gap
        lane = model.lanes(run)[selected["stream"]]
        k = next(i for i, e in enumerate(lane) if e is selected)
        idle_from = lane[k - 1]["end"] if k else model.span(run)[0]
        for c in range(len(owners)):
            t = start + (c + 0.5) * per_col
            if idle_from <= t < selected["start"] and owners[c] is None:
                gap.add(c)
        return gap

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        stream = self._lane_rows.get(offset.y)
        if stream is None or offset.x < self.label_width:
            return
        owners = self._cells.get(stream, [])
        col = offset.x - self.label_width
        if 0 <= col < len(owners) and owners[col] is not None:
            self.choose(owners[col])


def wrap_names(names: list[str], width: int, head: str, room: int) -> list[str]:
    """`head` and `names` joined by " → " in lines of at most `width` cells, broken
    between names (never inside one); at most `room` lines, the last one ending
    "… +N more" when not all names fit."""
    rows: list[list[str]] = [[]]
    column = len(head)
    for name in names:
        if rows[-1] and column + len(name) + 2 > width:   # 2: room for a " →"
            rows.append([])
            column = 2
        rows[-1].append(name)
        column += len(name) + 3
    left = 0
    if len(rows) > room:
        rows = rows[:max(room, 1)]
        left = len(names) - sum(len(row) for row in rows)
    lines = []
    for k, row in enumerate(rows):   # a line that the next continues ends in "→"
        arrow = " →" if k + 1 < len(rows) else ""
        lines.append((head if k == 0 else "  ") + " → ".join(row) + arrow)
    while left:   # drop names from the last line until "… +N more" fits after it
        more = f" → … +{left} more"
        if len(lines[-1]) + len(more) <= width or len(rows[-1]) <= 1:
            lines[-1] += more
            break
        rows[-1].pop()
        left += 1
        lines[-1] = ("  " if len(rows) > 1 else head) + " → ".join(rows[-1])
    return lines


def op_columns(ops: list[str], width: int) -> tuple[int, bool]:
    """(the op column's width, whether the bytes column fits) for a per-op table
    `width` cells wide, so that the slowest step's name keeps STEP_COLUMNS: the
    longest op name and a space, at most OP_COLUMNS; narrowed to STEP_COLUMNS to
    keep the bytes column; else without bytes, narrowed to MIN_OP_COLUMNS at most."""
    name = min(max([len(op) for op in ops] + [2]) + 1, OP_COLUMNS)
    room = width - FIXED_COLUMNS - STEP_COLUMNS   # for the op and bytes columns
    if min(name, STEP_COLUMNS) + BYTES_COLUMNS <= room:
        return min(name, room - BYTES_COLUMNS), True
    return max(min(name, room), MIN_OP_COLUMNS), False


def elide_name(name: str, width: int) -> str:
    """`name` in at most `width` cells, its end replaced by "…" when cut."""
    return name if len(name) <= width else name[:max(width - 1, 0)] + "…"


def fmt_ratio(ratio: float) -> str:
    """How many times its mean the slowest step took: "7.8x", "12x"."""
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def bar_cells(owners: list, fill: list[float], c: int, end: int, selected: bool,
              styles: dict, dark: bool) -> tuple[str, str]:
    """(text, style) of the bar of event owners[c] over columns c..end: its op's
    name when it fits, else cells shaded by how busy each column was."""
    owner, width, n = owners[c], len(owners), end - c + 1
    color = bar_style = palette.bar_color(owner["op"], dark)
    if selected:
        bar_style = styles["sel"]
    if n >= len(owner["op"]) + 2:
        ink = "black" if dark else "white"
        return (" " + owner["op"]).ljust(n), \
            styles["sel"] if selected else f"bold {ink} on {color}"
    body = "".join(shade(fill[k]) for k in range(c, end + 1))
    # The last cell of a full bar followed by another bar: a half block, so
    # neighbours of the same color stay two bars.
    if n > 1 and end + 1 < width and owners[end + 1] is not None and body[-1] == "█":
        body = body[:-1] + "▌"
    return body, bar_style


def time_axis(start: float, t0: float, per_col: float, width: int) -> str:
    """The time axis of `width` columns from time `start` of a run begun at `t0`:
    a tick label every ~12 columns."""
    axis = [" "] * width
    col = 0
    while col < width - 6:
        label = "┊" + fmt_time(max(0.0, start + col * per_col - t0))
        for k, ch in enumerate(label):
            if col + k < width:
                axis[col + k] = ch
        col += max(len(label) + 2, 12)
    return "".join(axis)


def shade(fill: float) -> str:
    """The cell for a column busy `fill` of its time: █ (7/8 or more), ▓, ▒, ░."""
    for level, char in ((0.875, "█"), (0.625, "▓"), (0.375, "▒")):
        if fill >= level:
            return char
    return "░"


def run_label(timeline: dict) -> str:
    """The run's name as the record gives it, said plainly: tinyflow numbers the
    timelines of a compiled program by that program's own runs ("run 1319"), which
    is not the training step (another program, such as an epoch's short last batch,
    runs in between), so "program run 1319"."""
    label = timeline["label"]
    label = f"program {label}" if label == f"run {timeline['run']}" else label
    step = timeline.get("step")   # the training step, when the record ties one
    return label if step is None else f"step {step}, {label}"


def lane_label(name: str, columns: int) -> str:
    """`name` padded to `columns` with at least one space after it. A name too long
    for them keeps its start and its end around "…" (rank12…pute0 in 13), the parts
    that tell one lane from another, rather than losing its end."""
    room = columns - 1
    if len(name) > room:
        head = room // 2
        name = name[:head] + "…" + name[len(name) - (room - head - 1):]
    return name.ljust(columns)
