"""The curves view (``4``): every scalar series of the record, plotted.

Is it learning? Loss, accuracy, learning rate and whatever a script logs with
`tf.debug.scalar(name, step, value)` are drawn with axes by textual-plot's
`PlotWidget` (measured against textual-plotext on a 1M-point series: 83 ms vs
122 ms per redraw once thinned, 17 s vs 26 s without thinning; see viz/series.py).
Series of one scale share a plot; series of different scales get plots of their
own, stacked on one step axis (`series.scale_groups`: loss 0.6–2.2 and accuracy
0.90–0.99 on one y axis made accuracy a flat line; textual-plot has no second y
axis). Space toggles a series; each is drawn as a faint raw line under its
smoothed line (``s`` cycles the EMA weight, computed on the full data).
NaN/Inf points are marked by red vertical lines and spikes by ``▲``; ``← →`` move a
step cursor along the selected series, and when the record ties a timeline to that
training step, the cursor selects it (``2`` then shows it). tinyflow numbers
timelines by the runs of one compiled program, which is not the training step (see
`RecordModel.timeline_at_step`), so without that tie nothing is selected and the
series list says so. In a compare session the
second record's series are overlaid, dashed in the legend as ``B:``.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import numpy as np
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static
from textual_plot import HiResMode, PlotWidget

from viz import palette
from viz.series import Series, ema, scale_groups, spikes, thin

if TYPE_CHECKING:
    from viz.app import DebuggerApp

HIRES = HiResMode.BRAILLE   # the smoothed line: braille, 2x4 dots per cell
# The raw series under it is drawn in whole cells: its min/max envelope covers many
# dots per column, and textual-plot sets dots one by one (braille made a redraw of
# a noisy 1M-point series 5x slower, 115 ms against 24 ms).
RAW_HIRES = None
SMOOTHING = (0.0, 0.6, 0.9, 0.99)   # the EMA weights ``s`` cycles through
COLORS = ("#7aa2f7", "#9ece6a", "#e0af68", "#bb9af7", "#7dcfff", "#f7768e")
B_COLOR = "#ff9e64"   # the second record's series, when comparing
MAX_PLOTS = 4         # plots stacked at most (more scales: the selected one's shown)
PLOT_ROWS = 7         # the fewest rows of one: title, frame, 3 rows of curve, ticks


class SeriesCache:
    """Series built from record scalars, their smoothing and spikes, rebuilt only when
    a series grew (live) or the weight changed: a redraw then only thins."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str], tuple[int, Series]] = {}
        self._smooth: dict[tuple[str, str, float], tuple[int, np.ndarray]] = {}
        self._spikes: dict[tuple[str, str], tuple[int, np.ndarray]] = {}

    def series(self, source: str, name: str, points: list) -> Series:
        key = (source, name)
        cached = self._series.get(key)
        if cached is None or cached[0] != len(points):
            cached = self._series[key] = (len(points), Series.from_points(name, points))
        return cached[1]

    def smoothed(self, source: str, series: Series, weight: float) -> np.ndarray:
        key = (source, series.name, weight)
        cached = self._smooth.get(key)
        if cached is None or cached[0] != len(series.values):
            cached = self._smooth[key] = (len(series.values), ema(series.values, weight))
        return cached[1]

    def envelope(self, source: str, series: Series, weight: float, columns: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """The thinned points of the series (weight 0) or of its smoothing, kept
        until the series grows or the plot changes width: a redraw only plots."""
        key = ("envelope", source, series.name, weight, columns)
        cached = self._smooth.get(key)
        if cached is None or cached[0] != len(series.values):
            values = self.smoothed(source, series, weight) if weight else series.values
            cached = self._smooth[key] = (len(series.values),
                                          thin(series.steps, values, columns))
        return cached[1]

    def spikes(self, source: str, series: Series) -> np.ndarray:
        key = (source, series.name)
        cached = self._spikes.get(key)
        if cached is None or cached[0] != len(series.values):
            cached = self._spikes[key] = (len(series.values), spikes(series.values))
        return cached[1]


class CurvesView(Widget):
    """Series list on the left, the plot on the right."""

    DEFAULT_CSS = """
    CurvesView { layout: horizontal; }
    CurvesView #series-list { width: 34; height: 1fr; border-right: vkey $foreground 20%;
                              text-wrap: nowrap; text-overflow: ellipsis; padding: 0 1; }
    CurvesView.tiny #series-list { width: 26; }
    CurvesView #plots { width: 1fr; height: 1fr; }
    CurvesView .plot-title { height: 1; padding: 0 1; text-wrap: nowrap;
                             text-overflow: ellipsis; }
    CurvesView PlotWidget { width: 1fr; height: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cache = SeriesCache()
        self.smoothing = 1          # index into SMOOTHING
        self.current = 0            # the selected series (index into names())
        self.hidden: set[str] = set()
        self.cursor_step: float | None = None
        self.drawn: list[str] = []  # labels of the datasets last drawn (tests read it)
        self.plotted: list[list[str]] = []   # the series names of each plot shown
        self.hidden_plots = 0       # plots that did not fit the height

    def compose(self) -> ComposeResult:
        yield Static(id="series-list")
        # A plot per scale (see the module docstring), made once: shown or hidden
        # as the series change, never mounted while drawing.
        with Vertical(id="plots"):
            for k in range(MAX_PLOTS):
                yield Static(id=f"plot-title-{k}", classes="plot-title")
                plot = PlotWidget(id=f"plot-{k}", allow_pan_and_zoom=False)
                plot.can_focus = False   # keys belong to the app (← → step cursor)
                # The title row above names the series: no y label row, and one
                # row of step ticks under each plot (the axis "step" is said once,
                # in the series list). Set without the watchers, which need the
                # plot composed: its on_mount applies them.
                plot.set_reactive(PlotWidget.margin_top, 0)
                plot.set_reactive(PlotWidget.margin_bottom, 1)
                yield plot

    def on_resize(self, event: events.Resize) -> None:
        # How many plots fit depends on the height (the list says how many did
        # not), and the thinning on the width.
        if self.tapp.model is not None:
            self.sync()

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    # -- what to draw ------------------------------------------------------------------

    def sources(self) -> list[tuple[str, dict]]:
        """(label, scalars) of each record shown: one, or A and B when comparing."""
        app = self.tapp
        out = [("A" if app.other is not None else "", app.model.record["scalars"])]
        if app.other is not None:
            out.append(("B", app.other.record["scalars"]))
        return out

    def names(self) -> list[str]:
        seen: dict[str, None] = {}
        for _, scalars in self.sources():
            for name in scalars:
                seen.setdefault(name, None)
        return list(seen)

    def selected_name(self) -> str | None:
        names = self.names()
        return names[min(self.current, len(names) - 1)] if names else None

    # -- keys ----------------------------------------------------------------------------

    def move(self, direction: str) -> None:
        """up/down pick a series, left/right move the step cursor by ~1/60 of it."""
        names = self.names()
        if not names:
            return
        if direction in ("up", "down"):
            self.current = (self.current + (1 if direction == "down" else -1)) % len(names)
            self.cursor_step = None
        else:
            series = self._series_of(self.selected_name())
            if series is None or not len(series.steps):
                return
            steps = series.steps
            k = len(steps) - 1 if self.cursor_step is None else \
                int(np.searchsorted(steps, self.cursor_step))
            jump = max(len(steps) // 60, 1)
            k = min(max(k + (jump if direction == "right" else -jump), 0), len(steps) - 1)
            self.cursor_step = float(steps[k])
            self._select_run_at(int(steps[k]))
        self.sync()

    def toggle_series(self) -> None:
        name = self.selected_name()
        if name is not None:
            self.hidden ^= {name}
            self.sync()

    def cycle_smoothing(self) -> None:
        self.smoothing = (self.smoothing + 1) % len(SMOOTHING)
        self.sync()

    def _series_of(self, name: str | None) -> Series | None:
        if name is None:
            return None
        for label, scalars in self.sources():
            if name in scalars:
                return self.cache.series(label, name, scalars[name])
        return None

    def _select_run_at(self, step: int) -> None:
        """Selecting a point selects the timeline the record ties to that training
        step, if it ties one (never a timeline whose program run merely has the
        same number)."""
        app = self.tapp
        found = app.model.timeline_at_step(step)
        if found is not None:
            app.run_index = found

    # -- drawing -------------------------------------------------------------------------

    def sync(self) -> None:
        app = self.tapp
        if app.model is None:
            return
        styles = palette.styles(app.dark)
        self.draw()   # first: the list says which plots did not fit
        # Its size is fixed in CSS (34 x 1fr), so new text needs no layout of the
        # screen: a repaint of it alone (a layout pass costs more than the plot).
        self.query_one("#series-list", Static).update(self.series_list(styles),
                                                      layout=False)

    def series_list(self, styles: dict) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        names = self.names()
        weight = SMOOTHING[self.smoothing]
        text.append(f"series · smoothing {weight:g}\n", styles["title"])
        if not names:
            text.append("\nNo scalars in this record.\nLog one in the training loop:\n"
                        "  tf.debug.scalar('loss',\n      step, value)\n", styles["dim"])
            return text
        for k, name in enumerate(names):
            mark = "▶" if k == self.current else " "
            shown = "·" if name in self.hidden else "●"
            color = COLORS[k % len(COLORS)]
            text.append(f"{mark}{shown} ", styles["sel"] if k == self.current else None)
            text.append(f"{name}\n", f"bold {color}")
            for label, scalars in self.sources():
                if name not in scalars:
                    continue
                series = self.cache.series(label, name, scalars[name])
                text.append(self._summary(label, series), styles["dim"])
        if self.hidden_plots:
            more = f"{self.hidden_plots} more plot{'s' if self.hidden_plots > 1 else ''}"
            text.append(f"\n{more} below: ↑↓ to a series shows its plot\n", styles["dim"])
        text.append_text(self._timelines_note(styles))
        if self.cursor_step is not None:
            text.append(f"\ncursor: step {self.cursor_step:g}\n", styles["edge_sel"])
            found = self.tapp.model.timeline_at_step(int(self.cursor_step))
            if found is not None:
                text.append(f"  timeline {found + 1} (2 shows it)\n", styles["ok"])
            for label, scalars in self.sources():
                series = self._series_of_source(label, scalars)
                if series is not None and len(series.steps):
                    k = min(int(np.searchsorted(series.steps, self.cursor_step)),
                            len(series.steps) - 1)
                    text.append(f"  {label or series.name} = {series.values[k]:.5g}\n")
        return text

    def _timelines_note(self, styles: dict) -> Text:
        """Which timelines the record holds and whether the step cursor can pick
        them: only those tied to a training step (`RecordModel.timeline_at_step`)."""
        timelines = self.tapp.model.timelines
        text = Text(end="")
        if not timelines:
            return text
        tied = [t["step"] for t in timelines if isinstance(t.get("step"), int)]
        runs = [t["run"] for t in timelines]
        span = f"{min(runs)}–{max(runs)}" if len(runs) > 1 else f"{runs[0]}"
        note = (f"timelines: program run {span}, not linked to steps (the record does "
                "not say which training step each run was)")
        if tied:
            note = f"timelines at steps {min(tied)}–{max(tied)}: the cursor selects them"
        # Wrapped to the list (34 columns, 26 at 80), so no word is cut.
        width = 22 if self.has_class("tiny") else 30
        text.append("\n" + "\n".join(textwrap.wrap(note, width, subsequent_indent="  "))
                    + "\n", styles["dim"])
        return text

    def _series_of_source(self, label: str, scalars: dict) -> Series | None:
        name = self.selected_name()
        return self.cache.series(label, name, scalars[name]) if name in scalars else None

    def _summary(self, label: str, series: Series) -> str:
        prefix = f"   {label}: " if label else "   "
        if not len(series.values):
            return prefix + "empty\n"
        line = f"{prefix}{len(series.values)} pts"
        if series.finite_min is not None:   # two lines: 26 columns cut "min 0.4…"
            line += f" last {series.values[-1]:.4g}\n   min {series.finite_min:.4g}"
        bad = len(series.bad_steps)
        if bad:
            line += f"\n   ⚠ {bad} NaN/Inf from step {series.bad_steps[0]:g}"
        spiked = len(self.cache.spikes(label, series))
        if spiked:
            line += f"\n   ▲ {spiked} spike{'s' if spiked > 1 else ''}"
        return line + "\n"

    def plot_groups(self) -> list[list[str]]:
        """The names of the visible series, grouped by scale (one plot each): as
        many plots as fit the height, those around the selected series."""
        shown = [name for name in self.names() if name not in self.hidden]
        groups = scale_groups([(name, *self._range(name)) for name in shown])
        fit = max(1, min(MAX_PLOTS, self.query_one("#plots").size.height // PLOT_ROWS))
        selected = self.selected_name()
        at = next((k for k, g in enumerate(groups) if selected in g), 0)
        start = 0 if at < fit else at - fit + 1
        self.hidden_plots = max(len(groups) - fit, 0)
        return groups[start:start + fit]

    def _range(self, name: str) -> tuple[float | None, float | None]:
        """The finite min and max of series `name` over the records shown."""
        lows, highs = [], []
        for label, scalars in self.sources():
            if name in scalars:
                series = self.cache.series(label, name, scalars[name])
                if series.finite_min is not None:
                    lows.append(series.finite_min)
                    highs.append(series.finite_max)
        return (min(lows), max(highs)) if lows else (None, None)

    def draw(self) -> None:
        """Redraw the plots: per plot, per series and source, the raw envelope
        (faint), the smoothed envelope, NaN lines and spike markers; every plot on
        the same steps, so one step is one column in all of them."""
        groups = self.plot_groups()
        self.plotted, self.drawn = groups, []
        columns = max(self.query_one("#plots").size.width - 12, 20)
        weight = SMOOTHING[self.smoothing]
        colors = {name: COLORS[k % len(COLORS)] for k, name in enumerate(self.names())}
        steps = self._step_limits([name for group in groups for name in group])
        for k, plot in enumerate(self.query(PlotWidget)):
            title = self.query_one(f"#plot-title-{k}", Static)
            shown = k < max(len(groups), 1)   # an empty plot when nothing is shown
            plot.display = title.display = shown
            if not shown:
                continue
            plot.clear()
            keys = Text(no_wrap=True, overflow="ellipsis", end="")
            for name in groups[k] if k < len(groups) else []:
                for label, scalars in self.sources():
                    if name in scalars:
                        drawn = self._draw_series(plot, label, self.cache.series(
                            label, name, scalars[name]), colors[name], weight, columns)
                        if drawn:
                            keys.append(f"━ {drawn[0]}  ", drawn[1])
            if self.cursor_step is not None:
                plot.add_v_line(self.cursor_step, "bold #e0af68")
            if steps is not None:
                plot.set_xlimits(*steps)
            plot.set_ylimits(*self._flat_limits(groups[k] if k < len(groups) else []))
            plot.show_legend(is_visible=False)   # the title row names the series
            if k == max(len(groups), 1) - 1:
                keys.append("(x: step)", "dim")   # once, over the lowest plot
            title.update(keys, layout=False)

    def _flat_limits(self, names: list[str]) -> tuple[float | None, float | None]:
        """y limits for a plot of series `names`: automatic, except for a flat line
        (a constant learning rate, alone on its plot now): textual-plot widens it
        by ±1e-6 only, and then fails to label ticks closer than float precision."""
        ranges = [self._range(name) for name in names]
        lows = [low for low, _ in ranges if low is not None]
        highs = [high for _, high in ranges if high is not None]
        if not lows or max(highs) - min(lows) > 1e-9 * max(abs(max(highs)), 1.0):
            return None, None
        pad = abs(max(highs)) * 0.1 or 1.0
        return min(lows) - pad, max(highs) + pad

    def _step_limits(self, names: list[str]) -> tuple[float, float] | None:
        """The first and last step of the series `names` over the records shown."""
        ends = []
        for label, scalars in self.sources():
            for name in names:
                if name in scalars and scalars[name]:
                    series = self.cache.series(label, name, scalars[name])
                    ends += [float(series.steps[0]), float(series.steps[-1])]
        if not ends or min(ends) == max(ends):
            return None   # one step: let the plot pick its limits
        return min(ends), max(ends)

    def _draw_series(self, plot: PlotWidget, label: str, series: Series, color: str,
                     weight: float, columns: int) -> tuple[str, str] | None:
        """Draw `series` on `plot`; returns its (name, style) for the title row
        (None: nothing to draw)."""
        if not len(series.steps):
            return None
        name = f"{label}:{series.name}" if label else series.name
        faint = f"{color} dim" if label != "B" else f"{color} dim italic"
        if weight > 0:   # the raw envelope faint under the smoothed line
            xs, ys = self.cache.envelope(label, series, 0.0, columns)
            plot.plot(xs, ys, line_style=faint, hires_mode=RAW_HIRES)
        xs, ys = self.cache.envelope(label, series, weight, columns)
        style = color if label != "B" else B_COLOR
        plot.plot(xs, ys, line_style=style, hires_mode=HIRES, label=name)
        self.drawn.append(name)
        for step in series.bad_steps[:3].tolist():   # a few lines: more only clutter
            plot.add_v_line(step, "bold #ff5f5f")
        marks = self.cache.spikes(label, series)
        if len(marks):
            plot.scatter(series.steps[marks], series.values[marks], marker="▲",
                         marker_style="bold #ff9e64")
        return name, f"bold {style}"
