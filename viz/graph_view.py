"""The graph view: the graph after each pass, drawn as boxes and edges, with the pass
list and the rewrite records beside it.

Stepping through the passes (``[`` and ``]``) shows what each one did: the nodes it
added are green, the nodes it removed are drawn struck through in red where they
were (the drawing is the union of the graph before and after the pass), and the
pass's rewrite records give the reasons. Passes that changed nothing are folded
into one dim line (``f`` unfolds them).

A real graph has thousands of nodes, so the view draws the neighbourhood of the
selected node: everything within k hops (``+``/``-``), with name scopes other than
the selected node's folded into one box each. ``o`` switches to an indented outline
of the selected node's inputs, the fallback when a drawing would not help.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import ScrollableContainer, Vertical, VerticalScroll
from textual.events import Click
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import Static

from viz import layout, palette
from viz.model import RecordModel, fmt_shape, fmt_time

if TYPE_CHECKING:
    from viz.app import DebuggerApp


def canvas_text(canvas: layout.Canvas, styles: dict[str, str]) -> Text:
    """A Canvas as one Rich Text, style names mapped through `styles`."""
    text = Text(no_wrap=True, overflow="ignore", end="")
    for y in range(canvas.height):
        for chunk, style in canvas.runs(y):
            text.append(chunk, styles.get(style, "") if style else None)
        if y + 1 < canvas.height:
            text.append("\n")
    return text


class GraphScene:
    """What one drawing shows: the nodes of graph `index` (plus the nodes its pass
    removed) around one center node, and how to draw them."""

    def __init__(self, model: RecordModel, index: int, center: str, hops: int,
                 run: int) -> None:
        self.model, self.index, self.center, self.hops = model, index, center, hops
        now = model.nodes(index)
        info = model.passes[index]
        self.removed = set(info.removed)
        self.added = set(info.added)
        before = model.nodes(index - 1) if index > 0 else {}
        self.node = lambda i: now.get(i) or before[i]
        users_now = model.consumers(index)
        users_before = model.consumers(index - 1) if index > 0 else {}
        self.inputs = lambda i: self.node(i)["inputs"]
        self.users = lambda i: users_now.get(i, []) + [
            u for u in users_before.get(i, []) if u in self.removed]
        events = model.events_of(run)
        self.bad = {i for i, e in events.items()
                    if e.get("summary") and (e["summary"]["nan"] or e["summary"]["inf"])}

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
        return layout.draw(boxes, edges, style)

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
    GraphView #pass-list { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
    GraphView #rewrites { height: auto; margin-top: 1; }
    GraphView #graph-side { width: 1fr; height: 1fr; }
    GraphView #graph-caption { height: 1; padding: 0 1; text-wrap: nowrap;
                               text-overflow: ellipsis; }
    GraphView #graph-scroll { height: 1fr; scrollbar-size: 1 1; }
    GraphView #graph-canvas { width: auto; height: auto; padding: 0 1; text-wrap: nowrap; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hops = 2
        self.outline_mode = False
        self.show_all_passes = False
        self._cache: OrderedDict[tuple, layout.Canvas] = OrderedDict()
        self.canvas: layout.Canvas | None = None
        self.last_error = ""

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="passes-panel"):
            yield Static(id="pass-list")
            yield Static(id="rewrites")
        with Vertical(id="graph-side"):
            yield Static(id="graph-caption")
            with ScrollableContainer(id="graph-scroll"):
                yield Static(id="graph-canvas")

    @property
    def tapp(self) -> DebuggerApp:
        return self.app  # type: ignore[return-value]

    # -- drawing ---------------------------------------------------------------------

    def sync(self) -> None:
        app = self.tapp
        model = app.model
        if model is None or not model.graphs:
            return
        styles = palette.styles(app.dark)
        index = app.pass_index
        center = self.center(model, index, app.selected)
        self.query_one("#pass-list", Static).update(self.pass_list(model, index, styles))
        self.query_one("#rewrites", Static).update(self.rewrites(model, index, center, styles))
        canvas_widget = self.query_one("#graph-canvas", Static)
        caption = self.query_one("#graph-caption", Static)
        if center is None:
            caption.update("")
            canvas_widget.update(Text("(empty graph)", style=styles["dim"]))
            return
        scene = GraphScene(model, index, center, self.hops, app.run_index)
        info = model.passes[index]
        cap = Text(no_wrap=True, overflow="ellipsis")
        cap.append(f"after {info.name}", styles["title"])
        cap.append(f" · {info.nodes_after} nodes · {self.hops} hops around ", styles["dim"])
        cap.append(center, styles["edge_sel"])
        if info.added or info.removed:
            cap.append(f"  +{len(info.added)}", styles["added"])
            cap.append(f" −{len(info.removed)}", styles["removed"].replace("strike ", ""))
        caption.update(cap)
        if self.outline_mode:
            self.canvas = None
            text = Text(no_wrap=True, overflow="ignore", end="")
            for k, (tree, desc, style) in enumerate(scene.outline()):
                if k:
                    text.append("\n")
                text.append(tree, styles.get(style, "") if style else None)
                if desc:
                    text.append("  " + desc, styles["dim"])
            canvas_widget.update(text)
            return
        key = (id(model), index, center, self.hops, app.run_index)
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
        canvas_widget.update(canvas_text(canvas, styles))
        box = canvas.boxes.get(center)
        if box is not None:
            region = Region(box.x, box.y, box.w + 2, layout.BOX_H)
            scroll = self.query_one("#graph-scroll", ScrollableContainer)
            self.call_after_refresh(scroll.scroll_to_region, region, animate=False,
                                    force=True)

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
        text.append("   pass        nodes   Δ    time\n", styles["title"])
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
            line = f"{mark}{p.index:>2} {p.name[:11]:<11} {p.nodes_after:>4} {delta_text:>4}" \
                   f" {fmt_time(p.seconds):>7}"
            style = styles["sel"] if p.index == index else (
                styles["dim"] if p.index and not p.changed else None)
            text.append(line + "\n", style)
        flush()
        return text

    def rewrites(self, model: RecordModel, index: int, center: str | None,
                 styles: dict) -> Text:
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
        for rw in info.rewrites[:200]:
            mine = center in rw["removed"] or center in rw["added"]
            removed = ", ".join(rw["removed"]) or "·"
            added = ", ".join(rw["added"]) or "·"
            text.append("● " if mine else "- ", styles["edge_sel"] if mine else styles["dim"])
            text.append(removed, styles["removed"])
            text.append(" → ")
            text.append(added, styles["added"])
            text.append(f"\n  {rw['reason']}\n", styles["near"] if mine else styles["dim"])
        if len(info.rewrites) > 200:
            text.append(f"... {len(info.rewrites) - 200} more\n", styles["dim"])
        return text

    # -- the cursor ------------------------------------------------------------------

    def move(self, direction: str) -> str | None:
        """The node the cursor goes to: up = first input, down = first consumer,
        left/right = the neighbouring box on the same row of the drawing (or the
        previous/next node in topological order)."""
        app = self.tapp
        model = app.model
        if model is None:
            return None
        index = app.pass_index
        center = self.center(model, index, app.selected)
        if center is None:
            return None
        scene = GraphScene(model, index, center, self.hops, app.run_index)
        if direction == "up":
            inputs = scene.inputs(center)
            return inputs[0] if inputs else None
        if direction == "down":
            users = scene.users(center)
            return users[0] if users else None
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
        canvas = self.canvas
        widget = self.query_one("#graph-canvas", Static)
        offset = event.get_content_offset(widget)
        if canvas is None or offset is None:
            return
        for box in canvas.boxes.values():
            if box.x <= offset.x < box.x + box.w and box.y <= offset.y < box.y + layout.BOX_H:
                if not box.key.endswith("/"):
                    self.tapp.select(box.key)
                return
