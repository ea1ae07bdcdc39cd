"""The graph view: the graph after each pass, drawn as boxes and edges, with the pass
list and the rewrite records beside it.

Stepping through the passes (``[`` and ``]``) shows what each one did: the nodes it
added are green, the nodes it removed are drawn struck through in red where they
were (the drawing is the union of the graph before and after the pass), and the
pass's rewrite records give the reasons. Passes that changed nothing are folded
into one dim line (``f`` unfolds them).

A real graph has thousands of nodes, so the view opens on the folded overview
(viz/overview.py): layers and the forward / backward / optimizer phases as boxes,
repeated layers folded into one box ``×N``; Enter expands a box into its nodes (and
collapses it again). ``z`` switches to the neighbourhood of the selected node:
everything within k hops (``+``/``-``), with name scopes other than the selected
node's folded into one box each. ``o`` switches to an indented outline of the
selected node's inputs, the fallback when a drawing would not help.

A drawing is often wider than its panel (the neighbourhood of a constant read by
eight updates is eight boxes wide): ``,`` ``.`` pan sideways, ``0`` goes back to the
cursor, and ◀ ▶ in the edge columns mark the rows whose boxes go on beyond. After
a move by key the box the cursor came from is laid out next to the cursor's
(`layout.draw`'s `beside`) and framed with it, and ↓ after ↑ goes back to it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.events import Click, MouseScrollDown, MouseScrollUp
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from viz import layout, palette
from viz.model import RecordModel, fmt_shape, fmt_time
from viz.overview import Overview, layers

if TYPE_CHECKING:
    from viz.app import DebuggerApp

SHOWN_REWRITES = 40   # rewrite records listed per pass (a big graph has thousands)


class CanvasView(Widget):
    """A character canvas drawn line by line (Textual's line API), so only the rows
    on screen become strips. The view follows the cursor: the focus region (the
    selected box) is centred whatever the widget's size, together with the box the
    cursor came from when both fit (`also`); , . (and shift+wheel) pan sideways, the
    wheel up and down, until the focus moves again. A drawing wider than the view
    is cut at its edges: ◀ ▶ in the edge column say that a row goes on there."""

    MARKS = ("◀", "▶")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.canvas = layout.Canvas(1, 1)
        self.styles_map: dict[str, str] = {}
        self._rows: dict[int, Strip] = {}
        self._parsed: dict[str, Style] = {}
        self._focus: Region | None = None
        self._also: Region | None = None
        self._base = Style()   # the widget's own style, looked up once per repaint
        self.pan = [0, 0]

    def show(self, canvas: layout.Canvas, styles: dict[str, str],
             focus: Region | None = None, also: Region | None = None) -> None:
        """Draw `canvas` with `focus` (canvas cells) in the middle of the view, and
        `also` (the box the cursor came from) beside it when both fit."""
        old = self.canvas
        if styles != self.styles_map:   # another theme: every strip is stale
            self._rows.clear()
            self._parsed.clear()
        else:   # a cursor move: keep the strips of the rows the new canvas shares
            self._rows = {y: strip for y, strip in self._rows.items()
                          if y < canvas.height and y < old.height
                          and canvas.chars[y] is old.chars[y]
                          and canvas.styles[y] is old.styles[y]}
        self.canvas, self.styles_map = canvas, styles
        self._focus, self._also = focus, also
        self.pan = [0, 0]
        self.refresh()

    def framed(self) -> tuple[int, int]:
        """The canvas cell at the top-left corner before any panning: the focus in
        the middle; with `also`, both in the middle when they fit, else the focus
        at the side facing `also` (the edge towards it shows as far as it can)."""
        width, height = self.size
        focus, also = self._focus, self._also
        if focus is None:
            return 0, 0
        # Screen column c shows canvas column ox + c - 1 (column 0 is a margin).
        fx = focus.x + focus.width // 2 + 1 - width // 2
        fy = focus.y + focus.height // 2 - height // 2
        if also is None:
            return fx, fy
        both = focus.union(also)
        if both.width + 2 <= width:
            fx = both.x + both.width // 2 + 1 - width // 2
        elif also.x < focus.x:   # to the left: the focus at the right edge
            fx = focus.right + 2 - width
        else:
            fx = focus.x
        if both.height <= height:
            fy = both.y + both.height // 2 - height // 2
        return fx, fy

    def origin(self) -> tuple[int, int]:
        """The canvas cell shown at the widget's top-left corner."""
        width, height = self.size
        fx, fy = self.framed()
        ox = min(max(fx + self.pan[0], 0), max(self.canvas.width + 2 - width, 0))
        oy = min(max(fy + self.pan[1], 0), max(self.canvas.height - height, 0))
        return ox, oy

    def _style(self, name: str) -> Style:
        if name not in self._parsed:
            self._parsed[name] = Style.parse(self.styles_map.get(name, "")) if name \
                else Style()
        return self._parsed[name]

    def render_lines(self, crop: Region) -> list[Strip]:
        # rich_style walks every ancestor's styles: once per repaint, not per line.
        base = self.rich_style
        if base != self._base:
            self._base = base
            self._rows.clear()
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        ox, oy = self.origin()
        row = y + oy
        width = self.size.width
        base = self._base
        if row >= self.canvas.height:
            return Strip.blank(width, base)
        strip = self._rows.get(row)
        if strip is None:
            segments = [Segment(" ", base)] + [
                Segment(chunk, base + self._style(style))
                for chunk, style in self.canvas.runs(row)]
            strip = self._rows[row] = Strip(segments, self.canvas.width + 1)
        return self._marked(strip.crop_extend(ox, ox + width, base), row, ox, width)

    def _marked(self, strip: Strip, row: int, ox: int, width: int) -> Strip:
        """`strip` with ◀ / ▶ in its first / last column where a box on canvas row
        `row` is cut off by that edge of the view, or lies beyond it."""
        left, right = self._extents().get(row, (ox, ox))
        left = left < ox                    # column 0 shows canvas column ox - 1
        right = right > ox + width - 2      # the last column shows ox + width - 2
        if not left and not right:
            return strip
        mark = self._base + self._style("key")
        parts = [Strip([Segment(self.MARKS[0], mark)], 1)] if left else []
        parts.append(strip.crop(1 if left else 0, width - 1 if right else width))
        if right:
            parts.append(Strip([Segment(self.MARKS[1], mark)], 1))
        return Strip.join(parts)

    def _extents(self) -> dict[int, tuple[int, int]]:
        """{canvas row: (first column, one past the last) of the boxes on it}, once
        per canvas. Only boxes count: an edge running off the view needs no mark."""
        if getattr(self, "_extents_of", None) is not self.canvas:
            extents: dict[int, tuple[int, int]] = {}
            for box in self.canvas.boxes.values():
                for y in range(box.y, box.y + layout.BOX_H):
                    lo, hi = extents.get(y, (box.x, box.x + box.w))
                    extents[y] = (min(lo, box.x), max(hi, box.x + box.w))
            self._extents_of, self._extent_rows = self.canvas, extents
        return self._extent_rows

    def box_at(self, x: int, y: int) -> layout.Box | None:
        """The box under cell (x, y) of this widget, if any."""
        ox, oy = self.origin()
        cx, cy = x + ox - 1, y + oy
        for box in self.canvas.boxes.values():
            if box.x <= cx < box.x + box.w and box.y <= cy < box.y + layout.BOX_H:
                return box
        return None

    def scroll_by_cells(self, dx: int, dy: int) -> None:
        """Pan by (dx, dy) cells, no further than the drawing's edges (so the way
        back takes as many presses as the way there)."""
        fx, fy = self.framed()
        self.pan[0] += dx
        self.pan[1] += dy
        ox, oy = self.origin()
        self.pan = [ox - fx, oy - fy]
        self.refresh()

    def pan_by(self, fraction: float) -> None:
        """Sideways by `fraction` of the view's width (the , . keys)."""
        self.scroll_by_cells(round(fraction * self.size.width), 0)

    def recentre(self) -> None:
        self.pan = [0, 0]
        self.refresh()

    def on_mouse_scroll_down(self, event: MouseScrollDown) -> None:
        self.scroll_by_cells(*((4, 0) if event.shift else (0, 3)))

    def on_mouse_scroll_up(self, event: MouseScrollUp) -> None:
        self.scroll_by_cells(*((-4, 0) if event.shift else (0, -3)))


def box_region(canvas: layout.Canvas, key: str | None) -> Region | None:
    """The cells of box `key` of `canvas` (None: not drawn there)."""
    box = canvas.boxes.get(key) if key else None
    return Region(box.x, box.y, box.w, layout.BOX_H) if box is not None else None


class GraphScene:
    """What one drawing shows: the nodes of graph `index` (plus the nodes its pass
    removed) around one center node, and how to draw them."""

    def __init__(self, model: RecordModel, index: int, center: str, hops: int,
                 run: int, came_from: str | None = None) -> None:
        self.model, self.index, self.center, self.hops = model, index, center, hops
        self.came_from = came_from   # drawn next to the center (layout.draw's beside)
        now = model.nodes(index)
        info = model.passes[index]
        self.removed = set(info.removed)
        self.added = set(info.added)
        before = model.nodes(index - 1) if index > 0 else {}
        self.node = lambda i: now.get(i) or before[i]
        users_now = model.consumers(index)
        users_before = model.consumers(index - 1) if index > 0 else {}
        # Edges of the union: a surviving node also keeps its edges from the nodes
        # this pass removed, so the drawing shows where they were.
        def inputs(i: str) -> list[str]:
            own = self.node(i)["inputs"]
            if i in now and i in before and self.removed:
                return own + [x for x in before[i]["inputs"]
                              if x in self.removed and x not in own]
            return own
        self.inputs = inputs
        self.users = lambda i: users_now.get(i, []) + [
            u for u in users_before.get(i, []) if u in self.removed]
        self.bad = model.nonfinite(run)

    def kind(self, node_id: str) -> str:
        node = self.node(node_id)
        if node_id == self.center:
            return "sel"
        if node_id in self.bad:
            return "nan"
        if node_id in self.removed:
            return "removed"
        if node_id in self.added:
            return "added"
        return "back" if node["phase"] == "backward" else "node"

    def canvas(self) -> layout.Canvas:
        limit = min(40 + 20 * self.hops, layout.MAX_LAYOUT)
        ids = layout.neighbourhood(self.center, self.inputs, self.users, self.hops, limit)
        key_of = layout.collapse(ids, layout.scope_of(self.center))
        members: dict[str, int] = {}
        for i in ids:
            members[key_of[i]] = members.get(key_of[i], 0) + 1
        boxes: dict[str, layout.Box] = {}
        for i in ids:
            key = key_of[i]
            if key in boxes:
                continue
            if key != i:   # a folded name scope
                title, label, kind = key, f"{members[key]} nodes", "scope"
            else:
                node = self.node(i)
                op = node["op"]
                if op == "fused" or len(node["provenance"]) > 1:
                    op = f"{op}×{len(node['provenance'])}"
                title, label, kind = f"{op} {fmt_shape(node['shape'])}", i, self.kind(i)
            boxes[key] = layout.Box(key, title, label, kind, w=layout.box_width(title, label))
        edges = []
        seen = set()
        for i in ids:
            for inp in self.inputs(i):
                if inp in key_of:
                    edge = (key_of[inp], key_of[i])
                    if edge[0] != edge[1] and edge not in seen:
                        seen.add(edge)
                        edges.append(edge)
        center = key_of.get(self.center, self.center)
        style = lambda a, b: "edge_sel" if center in (a, b) else "edge"
        came = key_of.get(self.came_from) if self.came_from else None
        return layout.draw(boxes, edges, style, (center, came) if came else None)

    def outline(self) -> list[tuple[str, str, str]]:
        """(tree text, description, style name) rows of the outline fallback."""
        def describe(i: str) -> str:
            node = self.node(i)
            return f"{node['op']} {fmt_shape(node['shape'])}  {node['where']}"
        rows = layout.outline(self.center, self.inputs, describe, max(self.hops, 1) + 1)
        users = self.users(self.center)
        out = [(tree, desc, self.kind(tree.split(" ")[-1])) for tree, desc in rows]
        if users:
            out.append(("", "", ""))
            out.append((f"read by {len(users)}:", "", "dim"))
            out += [(f"  → {u}", describe(u), self.kind(u)) for u in users[:20]]
        return out


class GraphView(Widget):
    """Pass list and rewrites on the left, the drawing on the right."""

    DEFAULT_CSS = """
    GraphView { layout: horizontal; }
    GraphView #passes-panel { width: 36; height: 1fr; border-right: vkey $foreground 20%;
                              scrollbar-size-vertical: 1; }
    GraphView.tiny #passes-panel { width: 28; }
    GraphView #pass-list { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
    GraphView #rewrites { height: auto; margin-top: 1; }
    GraphView #graph-side { width: 1fr; height: 1fr; }
    GraphView #graph-caption { height: 1; padding: 0 1; text-wrap: nowrap;
                               text-overflow: ellipsis; }
    GraphView #graph-canvas { height: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hops = 2
        self.overview_mode = True
        self.outline_mode = False
        self._overviews: dict[tuple, Overview] = {}
        self._origins: dict[tuple, dict[str, str]] = {}
        self.show_all_passes = False
        self._cache: OrderedDict[tuple, layout.Canvas] = OrderedDict()
        self.canvas: layout.Canvas | None = None
        self.last_error = ""
        self._panel_key: tuple | None = None
        # (from, to) of the last cursor move by key: the drawing around `to` keeps
        # `from` in view when both fit, and ↓ after ↑ (↑ after ↓) goes back to it.
        self.last_move: tuple[str, str] | None = None

    def compose(self) -> ComposeResult:
        # Not focusable: focused (Textual focuses the first focusable widget), it took
        # the arrow keys from the app whenever its list overflowed (80x24), so ↓
        # scrolled the pass list instead of moving the cursor in the drawing. The
        # mouse wheel still scrolls it.
        with VerticalScroll(id="passes-panel", can_focus=False):
            yield Static(id="pass-list")
            yield Static(id="rewrites")
        with Vertical(id="graph-side"):
            yield Static(id="graph-caption")
            yield CanvasView(id="graph-canvas")

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    # -- the overview ------------------------------------------------------------------

    def mode_name(self) -> str:
        if self.outline_mode:
            return "outline"
        return "overview" if self.overview_mode else f"{self.hops}-hop neighbourhood"

    def forget(self) -> None:
        """Drop drawings of a model that was replaced (live records grow)."""
        self._cache.clear()
        self._panel_key = None
        expanded = set().union(*(o.expanded for o in self._overviews.values())) \
            if self._overviews else set()
        self._overviews.clear()
        self._keep_expanded = expanded

    def overview(self) -> Overview | None:
        app = self.tapp
        model = app.model
        if model is None or not model.graphs:
            return None
        key = (id(model), app.pass_index)
        if key not in self._overviews:
            overview = self._new_overview(model, app.pass_index)
            overview.expanded = {k for k in getattr(self, "_keep_expanded", set())
                                 if k in overview.groups}
            self._overviews[key] = overview
        return self._overviews[key]

    def _new_overview(self, model: RecordModel, index: int) -> Overview:
        """The overview of pass `index`, its layers judged on the input graph (see
        overview.layers), which is judged once per record."""
        key = (id(model), "origin")
        if key not in self._origins:
            self._origins = {key: layers(model.graphs[0])}   # one record at a time
        origin = self._origins[key] if index > 0 else None
        return Overview(model.graphs[index], origin)

    def show_node(self, node_id: str) -> None:
        """Make `node_id` visible in the overview: expand the box that holds it."""
        overview = self.overview()
        if overview is not None and self.overview_mode:
            group = overview.group_of.get(node_id)
            if group is not None:
                overview.expanded.add(group)

    def expand(self) -> str | None:
        """Enter: expand the selected box into its nodes, or collapse the box the
        selected node belongs to. Returns the node to select."""
        overview = self.overview()
        app = self.tapp
        if overview is None or not self.overview_mode or app.selected is None:
            return None
        group = overview.group_of.get(app.selected)
        if group is None:
            return None
        overview.toggle(group)
        return overview.groups[group].members[0] if group in overview.expanded else None

    def _representative(self, overview: Overview, key: str) -> str:
        return overview.groups[key].members[0] if key in overview.groups else key

    def _draw_overview(self, styles: dict) -> None:
        app = self.tapp
        model = app.model
        overview = self.overview()
        selected = overview.box_of(app.selected) if app.selected else None
        if selected is None:
            selected = overview.box_of(model.graphs[app.pass_index]["outputs"][0]) \
                if model.graphs[app.pass_index]["outputs"] else None
        # The layout does not depend on the selection: draw it once per set of
        # expanded boxes, then restyle only the selected box (a cursor move costs a
        # copy of three rows, not a layout).
        # A selected node past the first nodes an expanded box draws is drawn too
        # (the view scrolls to it); only then does the selection change the layout.
        group = overview.group_of.get(app.selected) if app.selected else None
        keep = app.selected if group in overview.expanded and app.selected not in \
            overview.shown_members(overview.groups[group]) else None
        key = ("overview", id(model), app.pass_index, frozenset(overview.expanded),
               app.run_index, keep)
        base = self._cache.get(key)
        if base is None:
            scene = GraphScene(model, app.pass_index, "", 1, app.run_index)
            base = self._cache[key] = overview.draw(scene.kind, None, keep)
            if len(self._cache) > 32:
                self._cache.popitem(last=False)
        canvas = layout.with_box_kind(base, selected, "sel") if selected in base.boxes \
            else base
        self.canvas = canvas
        info = model.passes[app.pass_index]
        cap = Text(no_wrap=True, overflow="ellipsis")
        cap.append(f"after {info.name}", styles["title"])
        cap.append(f" · {info.nodes_after} nodes in {len(overview.groups)} boxes (layer · "
                   "phase; ×N = N repeated layers) · enter expands · z: neighbourhood",
                   styles["dim"])
        self._caption(cap)
        came = overview.box_of(self.came_from() or "")
        self.query_one("#graph-canvas", CanvasView).show(
            canvas, styles, box_region(canvas, selected),
            box_region(canvas, came) if came != selected else None)

    def _move_overview(self, direction: str) -> str | None:
        overview, canvas = self.overview(), self.canvas
        app = self.tapp
        current = overview.box_of(app.selected) if app.selected else None
        if overview is None or canvas is None or current not in canvas.boxes:
            return None
        if direction in ("up", "down"):
            return self._overview_up_down(overview, canvas, current, direction)
        me = canvas.boxes[current]
        row = sorted((b for b in canvas.boxes.values() if b.y == me.y), key=lambda b: b.x)
        k = next(i for i, b in enumerate(row) if b.key == current)
        k += -1 if direction == "left" else 1
        return self._representative(overview, row[k].key) if 0 <= k < len(row) else None

    def _overview_up_down(self, overview: Overview, canvas: layout.Canvas, current: str,
                          direction: str) -> str | None:
        """↑ / ↓ in the overview: the box an edge joins to `current` from above /
        below, the one nearest in x; the node the cursor came from when it is one."""
        edges = overview.last_edges
        near = [a for a, b in edges if b == current] if direction == "up" \
            else [b for a, b in edges if a == current]
        if not near:
            return None
        back = self.came_from()   # ↑ then ↓ returns where ↑ started
        if back is not None and overview.box_of(back) in near:
            return back
        me = canvas.boxes[current]
        target = min(near, key=lambda k: abs(canvas.boxes[k].center - me.center))
        return self._representative(overview, target)

    # -- drawing ---------------------------------------------------------------------

    def _caption(self, text: Text) -> None:
        # One row whatever the text (CSS height 1): no layout pass, only a repaint.
        self.query_one("#graph-caption", Static).update(text, layout=False)

    def sync(self) -> None:
        app = self.tapp
        model = app.model
        styles = palette.styles(app.dark)
        if model is None or not model.graphs:
            if model is not None:
                self._caption(Text("This record holds no graph.", style=styles["dim"]))
            return
        index = app.pass_index
        center = self.center(model, index, app.selected)
        panel_key = (id(model), index, self.show_all_passes, app.dark, self.has_class("tiny"))
        if panel_key != self._panel_key:  # the pass panel changes with the pass only
            self._panel_key = panel_key
            self.query_one("#pass-list", Static).update(self.pass_list(model, index, styles))
            self.query_one("#rewrites", Static).update(self.rewrites(model, index, styles))
        if center is None:
            self._caption(Text("(empty graph)", style=styles["dim"]))
            self.query_one("#graph-canvas", CanvasView).show(layout.Canvas(1, 1), styles)
        elif self.overview_mode and not self.outline_mode:
            self._draw_overview(styles)
        else:
            self._draw_neighbourhood(model, index, center, styles)

    def _draw_neighbourhood(self, model: RecordModel, index: int, center: str,
                            styles: dict) -> None:
        """The k-hop drawing around `center` (or the outline), with its caption."""
        app = self.tapp
        view = self.query_one("#graph-canvas", CanvasView)
        came = self.came_from()
        scene = GraphScene(model, index, center, self.hops, app.run_index, came)
        info = model.passes[index]
        cap = Text(no_wrap=True, overflow="ellipsis")
        cap.append(f"after {info.name}", styles["title"])
        hops = f"{self.hops} hop{'' if self.hops == 1 else 's'}"
        cap.append(f" · {info.nodes_after} nodes · {hops} around ", styles["dim"])
        cap.append(center, styles["edge_sel"])
        if info.added or info.removed:
            cap.append(f"  +{len(info.added)}", styles["added"])
            cap.append(f" −{len(info.removed)}", styles["removed"].replace("strike ", ""))
        if self.last_error:
            cap.append(f"  {self.last_error}", styles["warn"])
        self._caption(cap)
        if self.outline_mode:
            rows = scene.outline()
            canvas = layout.Canvas(max([len(t) + len(d) + 2 for t, d, _ in rows] + [1]),
                                   max(len(rows), 1))
            for y, (tree, desc, style) in enumerate(rows):
                canvas.put(0, y, tree, style)
                canvas.put(len(tree) + 2, y, desc, "dim")
            self.canvas = canvas
            y = next((k for k, (t, _, _) in enumerate(rows) if t == center), 0)
            view.show(canvas, styles, Region(0, y, 1, 1))
            return
        key = (id(model), index, center, self.hops, app.run_index, came)
        canvas = self._cache.get(key)
        if canvas is None:
            try:
                canvas = scene.canvas()
            except Exception as err:  # a layout failure must never take the app down
                self.last_error = f"layout failed ({type(err).__name__}: {err}); outline shown"
                self.outline_mode = True
                self.sync()
                return
            self._cache[key] = canvas
            if len(self._cache) > 32:
                self._cache.popitem(last=False)
        self.canvas = canvas
        view.show(canvas, styles, box_region(canvas, center), box_region(canvas, came))

    @staticmethod
    def center(model: RecordModel, index: int, selected: str | None) -> str | None:
        """The node to center graph `index` on for the shared cursor `selected`."""
        if selected:
            found = model.locate(selected, index)
            if found:
                return found
        outputs = model.graphs[index]["outputs"]
        if outputs:
            return outputs[0]
        nodes = model.nodes(index)
        return next(iter(nodes), None)

    def pass_list(self, model: RecordModel, index: int, styles: dict) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        tiny = self.has_class("tiny")   # at 80 columns: no time column
        text.append("   pass        nodes   Δ" + ("" if tiny else "    time") + "\n",
                    styles["title"])
        folded: list[str] = []

        def flush() -> None:
            if folded:
                names = ", ".join(folded)
                text.append(f"  ·{len(folded)} unchanged: {names}\n", styles["dim"])
                folded.clear()
        for p in model.passes:
            if p.index and not p.changed and not self.show_all_passes and p.index != index:
                folded.append(p.name)
                continue
            flush()
            mark = "▶" if p.index == index else " "
            delta = p.nodes_after - p.nodes_before
            delta_text = f"{delta:+d}" if delta else ("~" if p.changed and p.index else "")
            line = f"{mark}{p.index:>2} {p.name[:11]:<11} {p.nodes_after:>4} {delta_text:>4}"
            if not tiny:
                line += f" {fmt_time(p.seconds):>7}"
            style = styles["sel"] if p.index == index else (
                styles["dim"] if p.index and not p.changed else None)
            text.append(line + "\n", style)
        flush()
        return text

    def rewrites(self, model: RecordModel, index: int, styles: dict) -> Text:
        info = model.passes[index]
        text = Text(end="")
        if index == 0:
            text.append(f"{info.name}: the input graph,\nshapes inferred", styles["dim"])
            return text
        text.append(f"{info.name}: {len(info.rewrites)} rewrites", styles["title"])
        text.append(f"  −{len(info.removed)} +{len(info.added)}\n", styles["dim"])
        if not info.rewrites:
            text.append("nothing changed" if not info.changed else "(no records)",
                        styles["dim"])
        for rw in info.rewrites[:SHOWN_REWRITES]:
            text.append("- ", styles["dim"])
            text.append(", ".join(rw["removed"]) or "·", styles["removed"])
            text.append(" → ")
            text.append(", ".join(rw["added"]) or "·", styles["added"])
            text.append(f"\n  {rw['reason']}\n", styles["dim"])
        if len(info.rewrites) > SHOWN_REWRITES:
            text.append(f"... {len(info.rewrites) - SHOWN_REWRITES} more (all of them: "
                        "python -m viz export FILE --dot OUT.svg --after PASS)\n", styles["dim"])
        return text

    # -- the cursor ------------------------------------------------------------------

    def move(self, direction: str) -> str | None:
        """The node the cursor goes to: up = first input, down = first consumer,
        left/right = the neighbouring box on the same row of the drawing (or the
        previous/next node in topological order)."""
        app = self.tapp
        model = app.model
        if model is None or not model.graphs:
            return None
        index = app.pass_index
        center = self.center(model, index, app.selected)
        if center is None:
            return None
        if self.overview_mode and not self.outline_mode:
            target = self._move_overview(direction)
        else:
            target = self._move_neighbourhood(model, index, center, direction)
        if target is not None:
            self.last_move = (app.selected or center, target)
        return target

    def came_from(self) -> str | None:
        """The node the cursor was on before its last move by key, while it is
        still where that move took it (a click or a search starts afresh)."""
        if self.last_move is not None and self.last_move[1] == self.tapp.selected:
            return self.last_move[0]
        return None

    def pan(self, fraction: float) -> None:
        self.query_one("#graph-canvas", CanvasView).pan_by(fraction)

    def recentre(self) -> None:
        self.query_one("#graph-canvas", CanvasView).recentre()

    def _move_neighbourhood(self, model: RecordModel, index: int, center: str,
                            direction: str) -> str | None:
        scene = GraphScene(model, index, center, self.hops, self.tapp.run_index)
        if direction in ("up", "down"):
            near = scene.inputs(center) if direction == "up" else scene.users(center)
            back = self.came_from()   # ↑ then ↓ returns where ↑ started
            return back if back in near else (near[0] if near else None)
        step = -1 if direction == "left" else 1
        canvas = self.canvas
        if canvas is not None and center in canvas.boxes and not self.outline_mode:
            me = canvas.boxes[center]
            row = sorted((b for b in canvas.boxes.values() if b.y == me.y and
                          not b.key.endswith("/")), key=lambda b: b.x)
            k = next(i for i, b in enumerate(row) if b.key == center)
            if 0 <= k + step < len(row):
                return row[k + step].key
        order = list(model.nodes(index))
        if center in order:
            k = order.index(center) + step
            if 0 <= k < len(order):
                return order[k]
        return None

    def on_click(self, event: Click) -> None:
        view = self.query_one("#graph-canvas", CanvasView)
        offset = event.get_content_offset(view)
        if offset is None or self.outline_mode:
            return
        box = view.box_at(offset.x, offset.y)
        if box is not None and self.overview_mode:
            self.tapp.select(self._representative(self.overview(), box.key))
        elif box is not None and not box.key.endswith("/"):
            self.tapp.select(box.key)
