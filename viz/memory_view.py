"""The memory view: the arena as a map, offset down the side and step along the top.

Every tensor the planner placed in the arena is a block: its columns are the steps
it is alive, its rows the bytes it occupies. Reuse is visible at a glance, as in
XLA's memory viewer: blocks stacked in the same rows at different times share those
bytes. Beside the map: arena, naive (every tensor its own memory) and lower-bound
(the most bytes ever alive at once) sizes, the reuse ratio, the other strategies'
arena sizes, and the live-bytes curve over the steps. A parallel run's record
(tinyflow/rank_trace.py) holds no plan of one program but the arrays each rank
holds, end to end: its header shows the bytes per rank instead.

Selecting a block (arrows, or a click) says why it sits there: the planner's reason,
the freed tensor whose space it took, the input it overwrote in place, and every
tensor that shared its bytes over the run (drawn ``▓``).
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from rich.text import Text
from textual.events import Click
from textual.widget import Widget

from viz import palette
from viz.model import fmt_bytes, held_per_rank

if TYPE_CHECKING:
    from viz.app import DebuggerApp

LABEL = 9    # columns for the offset labels
SPARK = "▁▂▃▄▅▆▇█"
UNLISTED = "░"   # bytes no block of the record used: what held them is not known
NO_LIVE = "not recorded: the record has no step schedule"


class MemoryView(palette.TextLines, Widget):
    DEFAULT_CSS = """
    MemoryView { height: 1fr; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._grid: list[list[dict | None]] = []
        self._map_top = 0
        self.zoom = 1.0                 # steps shown: all of them / zoom
        self.view_start: int | None = None   # the first step shown (None: from 0)

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    def sync(self) -> None:
        self.refresh()

    # -- the cursor ------------------------------------------------------------------

    def selected_tensor(self) -> dict | None:
        app = self.tapp
        if app.model is None or app.selected is None:
            return None
        final = app.model.final_id(app.selected)
        return app.model.tensor_of.get(final) if final else None

    def move(self, direction: str) -> dict | None:
        """left/right: the previous/next block in time (first step, then offset);
        up/down: the block above/below among those alive at the same step."""
        model = self.tapp.model
        if model is None:
            return None
        blocks = sorted(model.arena_tensors(), key=lambda t: (t["first_step"], t["offset"]))
        if not blocks:
            return None
        current = self.selected_tensor()
        if current is None or not any(t is current for t in blocks):
            return blocks[0]
        if direction in ("up", "down"):
            step = current["first_step"]
            alive = sorted((t for t in blocks if t["first_step"] <= step <= t["last_step"]),
                           key=lambda t: (t["offset"], t["first_step"]))
            k = next(i for i, t in enumerate(alive) if t is current)
            k += -1 if direction == "up" else 1
            return alive[k] if 0 <= k < len(alive) else None
        k = next(i for i, t in enumerate(blocks) if t is current)
        k += -1 if direction == "left" else 1
        return blocks[k] if 0 <= k < len(blocks) else None

    # -- zoom and pan over the steps (an eager run has thousands) --------------------

    def window(self) -> tuple[int, int]:
        """(first step, number of steps) of the visible part of the plan."""
        model = self.tapp.model
        steps = max(model.steps, 1) if model else 1
        span = max(1, -(-steps // max(int(self.zoom), 1)))
        start = 0 if self.view_start is None else self.view_start
        return min(max(start, 0), steps - span), span

    def zoom_by(self, factor: float) -> None:
        """Zoom in (factor > 1) or out around the selected block (else the middle)."""
        start, span = self.window()
        tensor = self.selected_tensor()
        middle = tensor["first_step"] if tensor else start + span // 2
        self.zoom = min(max(self.zoom * factor, 1.0), 4096.0)
        self.view_start = middle - self.window()[1] // 2
        self.refresh()

    def pan(self, fraction: float) -> None:
        start, span = self.window()
        self.view_start = start + int(fraction * span) or start + (1 if fraction > 0 else -1)
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
        stats = model.stats()
        if not stats:
            text.append("This record holds no memory plan (compiled with memory=None).",
                        styles["dim"])
            return text
        per_rank = held_per_rank(stats)
        width = self.size.width
        if per_rank is None:
            self._plan_header(text, model, stats, styles, width)
        else:
            self._ranks_header(text, model, per_rank, styles, width)
        first, span = self.window()
        if span < max(model.steps, 1):   # zoomed: say which steps are shown
            text.append(f"steps {first}–{first + span - 1} of {model.steps} · zoom "
                        f"{self.zoom:g}x (+ - zoom, , . pan, 0 fit)\n", styles["dim"])
        header_rows = text.plain.count("\n")

        tensor = self.selected_tensor()
        blame = model.blame(tensor["node"]) if tensor else None
        sharers = {id(t) for t in blame.sharers} if blame else set()
        info = self._info(model, tensor, blame, styles)

        width = max(self.size.width - LABEL, 8)
        cols = width   # steps are spread over the whole width (to scale)
        # The header and the axis above the map, the curve and the info below.
        rows = max(self.size.height - header_rows - 1 - 1 - (info.plain.count("\n") + 1), 3)
        per_row = max(stats["arena"], 1) / rows
        grid = self._fill_grid(model, tensor, rows, cols, per_row)
        self._grid = grid
        unused = self._never_used_rows(model, rows, per_row, cols)

        text.append("step →".rjust(LABEL - 1) + " ", styles["dim"])
        text.append(step_axis(first, span, cols) + "\n", styles["axis"])
        self._map_top = header_rows + 1
        for r, line in enumerate(grid):
            label = fmt_bytes(r * per_row).replace(" ", "") if r % 2 == 0 else ""
            text.append(f"{label:>{LABEL - 1}} ", styles["axis"])
            if r in unused:   # bytes no block of the record ever used: not "free"
                text.append(unused[r][:cols].ljust(cols, UNLISTED), styles["dim"])
            else:
                self._map_row(text, line, tensor, sharers, styles)
            text.append("\n")
        self._live_curve(text, model, first, span, cols, styles)
        text.append_text(info)
        return text

    def _fill_grid(self, model, tensor: dict | None, rows: int, cols: int,
                   per_row: float) -> list[list[dict | None]]:
        """The map as a grid of rows (bytes) and columns (steps of the window): the
        block that holds each cell, None where none does."""
        first, span = self.window()
        grid: list[list[dict | None]] = [[None] * cols for _ in range(rows)]

        def place(t: dict) -> None:
            """Draw block t over the columns of its steps that are in the window."""
            if t["last_step"] < first or t["first_step"] >= first + span:
                return
            c0 = step_column(t["first_step"], first, span, cols)
            end = t["last_step"] + 1
            c1 = cols - 1 if end >= first + span else \
                max(c0, step_column(end, first, span, cols) - 1)
            r0 = min(int(t["offset"] / per_row), rows - 1)
            r1 = max(r0, min(int((t["offset"] + t["nbytes"] - 1) / per_row), rows - 1))
            for r in range(r0, r1 + 1):
                for c in range(c0, c1 + 1):
                    grid[r][c] = t

        # Big blocks first, so small ones drawn later stay visible on top.
        for t in sorted(model.arena_tensors(), key=lambda t: -t["nbytes"]):
            place(t)
        if tensor is not None and tensor["offset"] is not None:  # the selection on top
            place(tensor)
        return grid

    def _map_row(self, text: Text, line: list, tensor: dict | None, sharers: set,
                 styles: dict) -> None:
        """One row of the map: runs of cells of one block each."""
        cols = len(line)
        c = 0
        while c < cols:
            owner = line[c]
            end = c
            while end + 1 < cols and line[end + 1] is owner:
                end += 1
            n = end - c + 1
            if owner is None:
                text.append("·" * n, styles["axis"])
            elif owner is tensor:
                text.append("█" * n, styles["sel"].replace("reverse ", ""))
            elif id(owner) in sharers:
                text.append("▓" * n, styles["edge_sel"])
            else:
                body = "█" * n
                if n > 1:
                    body = body[:-1] + "▌"
                text.append(body, palette.bar_color(owner["node"], self.tapp.dark))
            c = end + 1

    @staticmethod
    def _live_curve(text: Text, model, first: int, span: int, cols: int,
                    styles: dict) -> None:
        """The live-bytes curve: the most bytes alive in each column's steps."""
        text.append(f"{'live':<{LABEL}}", styles["dim"])
        if not model.live:   # a flat line would read as "nothing alive"
            text.append(f"{NO_LIVE}\n", styles["dim"])
            return
        peak = max(model.live.values(), default=0) or 1
        for c in range(cols):
            lo = first + c * span // cols
            hi = max(first + (c + 1) * span // cols, lo + 1)
            value = max((model.live.get(s, 0) for s in range(lo, hi)), default=0)
            text.append(SPARK[min(int(value / peak * (len(SPARK) - 1) + 0.5),
                                  len(SPARK) - 1)], styles["ok"])
        text.append("\n")

    @staticmethod
    def _plan_header(text: Text, model, stats: dict, styles: dict, width: int) -> None:
        """The plan's sizes, then the arena sizes the other strategies would have
        needed, each wrapped between figures (never cut inside a number)."""
        title, dim = styles["title"], styles["dim"]
        figure = lambda name, size: [(f"{name} ", dim), (fmt_bytes(size), title)]
        if stats["unlisted"]:
            groups = MemoryView._allocator_figures(stats, styles)
        else:
            # Peak live is counted with the plan's aligned sizes, as its lower bound.
            # An eager run's bound is its own ops': a traced program of the same step
            # (fused, fewer tensors) may need less, as "strategies" shows.
            bound = "this run's lower bound" if "caching" in stats["strategy"] \
                else "lower bound"
            groups = [figure("arena", stats["arena"]),
                      figure("naive", stats["naive"]),
                      figure(bound, stats["lower_bound"]),
                      [("reuse ", dim), (f"{stats['reuse']:.2f}x", styles["ok"])],
                      [(f"peak live {peak_live(model)}", dim)]]
        groups.append([(stats["strategy"], dim)])
        palette.wrap_parts(text, groups, width, sep_style=dim)
        shown = {stats["bound_name"], "caching allocator (reserved)"} if stats["unlisted"] \
            else set()
        others = [figure(name, size) for name, size in
                  sorted(stats["strategies"].items(), key=lambda kv: kv[1])
                  if name not in shown]
        if others:
            others[0].insert(0, ("strategies: ", dim))
            palette.wrap_parts(text, others, width, sep_style=dim)

    @staticmethod
    def _allocator_figures(stats: dict, styles: dict) -> list[list[tuple]]:
        """The figures of a record whose bound counts blocks it does not list (a
        caching allocator's): what it reserved, its allocated peak and how much of
        that the listed blocks do not explain, and the listed blocks' own peak and
        naive sum. No reuse ratio: naive over a reserved segment (2 MiB for 305 KiB
        of tensors: "0.15x") says nothing about reuse."""
        title, dim = styles["title"], styles["dim"]
        used = stats["lower_bound"] / stats["arena"] if stats["arena"] else 0.0
        return [[("reserved ", dim), (fmt_bytes(stats["arena"]), title)],
                [(f"{stats['bound_name']} ", dim), (fmt_bytes(stats["lower_bound"]), title),
                 (f" ({used:.0%} of reserved)", dim)],
                [("of it ≥ ", dim), (fmt_bytes(stats["unlisted"]), styles["warn"]),
                 (f" in blocks the record does not list {UNLISTED}", dim)],
                [("listed blocks: peak ", dim), (fmt_bytes(stats["listed_peak"]), title)],
                [("naive ", dim), (fmt_bytes(stats["naive"]), title),
                 (" (each its own bytes)", dim)]]

    @staticmethod
    def _ranks_header(text: Text, model, per_rank: dict[str, int], styles: dict,
                      width: int) -> None:
        """Two lines over a parallel run's record: the bytes the ranks hold, in all
        and per rank. Its map is each rank's arrays end to end, not one arena, so
        naive, lower bound and reuse would mean nothing here."""
        title, dim = styles["title"], styles["dim"]
        palette.wrap_parts(text, [
            [(f"held by {len(per_rank)} ranks ", dim), (fmt_bytes(sum(per_rank.values())), title)],
            [("most on one rank ", dim), (fmt_bytes(max(per_rank.values())), title)],
            [(f"peak live {peak_live(model)}", dim)]], width, sep_style=dim)
        ranks = [[(f"{name} {fmt_bytes(size)}", dim)] for name, size in per_rank.items()]
        ranks[0].insert(0, ("per rank: ", dim))
        palette.wrap_parts(text, ranks, width, sep_style=dim)

    @staticmethod
    def _never_used_rows(model, rows: int, per_row: float, cols: int) -> dict[int, str]:
        """{row: its text} for the rows of the map whose bytes no block of the record
        ever used, over the whole run. They are not free memory: the record does not
        say what held them (a caching allocator's record lists only the blocks its
        recorded ops allocated; parameters and optimizer state were allocated
        before). The first row of each such stretch names its exact bytes."""
        gaps = unused_bytes(model.arena_tensors(), model.stats()["arena"])
        if not gaps or len(gaps) == 1 and gaps[0] == (0, model.stats()["arena"]):
            return {}   # no block at all: nothing to tell apart
        out: dict[int, str] = {}
        for lo, hi in gaps:
            first = -int(-lo // per_row)            # rows wholly inside the gap
            last = min(int(hi // per_row), rows) - 1
            for r in range(first, last + 1):
                out[r] = ""
            if first <= last:
                label = (f"{UNLISTED * 2} {fmt_bytes(lo)}–{fmt_bytes(hi)}: no block of the "
                         "record used these bytes; what held them is not recorded ")
                out[first] = label if len(label) <= cols else label[:cols - 1] + "…"
        return out

    def _info(self, model, tensor: dict | None, blame, styles: dict) -> Text:
        text = Text(end="")
        app = self.tapp
        if tensor is None:
            what = model.final_id(app.selected) if app.selected else None
            text.append(f"{what or app.selected or 'nothing'}: ", styles["edge_sel"])
            text.append("holds no memory of its own (no tensor in the plan)", styles["dim"])
            return text
        text.append(tensor["node"], styles["edge_sel"])
        text.append(f"  {where_text(tensor)}, {fmt_bytes(tensor['nbytes'])}, steps "
                    f"{tensor['first_step']}–{tensor['last_step']}, {tensor['kind']}\n",
                    styles["near"])
        scratch = model.scratch_of.get(tensor["node"])
        if scratch is not None:   # what a search for "scratch" found this node by
            text.append(f"  {label(scratch)}: {where_text(scratch)}, "
                        f"{fmt_bytes(scratch['nbytes'])}, steps {scratch['first_step']}–"
                        f"{scratch['last_step']}\n", styles["near"])
        why = textwrap.wrap(f"why: {story(tensor, blame, model.plan)}",
                            max(self.size.width - 4, 20), subsequent_indent="  ")
        text.append("  " + "\n  ".join(why) + "\n", styles["wait"])
        if blame is not None:
            if blame.inplace_of is not None:
                text.append(f"  in place of {blame.inplace_of['node']}\n", styles["near"])
            if blame.took_from is not None and blame.took_from["node"] not in tensor["reason"]:
                text.append(f"  took the space of {label(blame.took_from)} (freed after "
                            f"step {blame.took_from['last_step']})\n", styles["near"])
            if blame.sharers:
                names = ", ".join(label(t) for t in blame.sharers[:40])
                more = f" +{len(blame.sharers) - 40}" if len(blame.sharers) > 40 else ""
                lines = textwrap.wrap(f"▓ over the whole run {len(blame.sharers)} tensors "
                                      "alive at other steps reused these bytes: "
                                      f"{names}{more}", max(self.size.width - 4, 20),
                                      subsequent_indent="  ", max_lines=3)
                text.append("  " + "\n  ".join(lines), styles["edge_sel"])
            elif tensor["offset"] is not None:
                text.append("  no other tensor used these bytes", styles["dim"])
        return text

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        r, c = offset.y - self._map_top, offset.x - LABEL
        if 0 <= r < len(self._grid) and 0 <= c < len(self._grid[r]) and self._grid[r][c]:
            self.tapp.select(self._grid[r][c]["node"])


def unused_bytes(tensors: list[dict], arena: int) -> list[tuple[int, int]]:
    """The [lo, hi) byte ranges of [0, arena) that none of `tensors` ever covers."""
    gaps, reach = [], 0
    for t in sorted(tensors, key=lambda t: t["offset"]):
        if t["offset"] > reach:
            gaps.append((reach, t["offset"]))
        reach = max(reach, t["offset"] + t["nbytes"])
    if reach < arena:
        gaps.append((reach, arena))
    return gaps


def peak_live(model) -> str:
    """The most arena bytes alive at once, counted over the step schedule; a record
    without one (a parallel run's) does not say, and 0 B would be wrong."""
    return fmt_bytes(max(model.live.values())) if model.live else "not recorded"


def label(tensor: dict) -> str:
    """A tensor as the info panel names it: its node, and "(scratch)" for the
    working memory of the node's kernel (which is named by its node too)."""
    return tensor["node"] + (" (scratch)" if tensor["kind"] == "scratch" else "")


def where_text(tensor: dict) -> str:
    """'at 1.5 MiB (byte 1572864)': the unit of the header first, the raw offset
    after it for whoever checks against the plan."""
    if tensor["offset"] is None:
        return "outside the arena"
    return f"at {fmt_bytes(tensor['offset'])} (byte {tensor['offset']})"


def story(tensor: dict, blame, plan: dict | None) -> str:
    """The planner's reason told whole: a "fresh" tensor got new bytes *when it was
    placed* (no gap was free then), and later tensors may still reuse them; every
    size is rounded up to the plan's alignment."""
    reason = tensor["reason"]
    if reason.startswith("fresh") and blame is not None and blame.sharers:
        later = sum(1 for t in blame.sharers if t["first_step"] > tensor["last_step"])
        if later:
            reason += (f"; so it got new bytes, which {later} later tensor"
                       f"{'s' if later > 1 else ''} reused after it died")
    alignment = (plan or {}).get("alignment")
    if alignment and alignment > 1 and tensor["offset"] is not None:
        reason += f" (sizes rounded up to {alignment}-byte alignment)"
    return reason


def step_column(step: int, first: int, span: int, cols: int) -> int:
    """The map's column of `step`, in a window of `span` steps from `first`."""
    return min(max(int((step - first) * cols / span), 0), cols - 1)


def step_axis(first: int, span: int, cols: int) -> str:
    """The step numbers above the map, ┊ at their columns, none overlapping."""
    axis = [" "] * cols
    for step in range(first, first + span, max(1, span // max(cols // 8, 1))):
        label = f"┊{step}"
        c = step_column(step, first, span, cols)
        if all(axis[c + k] == " " for k in range(min(len(label) + 1, cols - c))):
            for k, ch in enumerate(label[: cols - c]):
                axis[c + k] = ch
    return "".join(axis)
