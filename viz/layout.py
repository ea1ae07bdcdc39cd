"""Drawing a graph in the terminal: a layered layout on a grid of characters.

The layout is Sugiyama's layered drawing (Sugiyama, Tagawa & Toda 1981), the method
Graphviz's `dot` uses, computed by the pure-Python `grandalf` package: every node
gets a layer (inputs above their consumers) and an order inside its layer that keeps
edge crossings few, and each edge that skips layers gets a dummy point per layer it
crosses. This module turns that into characters:

* a node is a 3-row box: op and shape on the top border, its id inside;
* an edge leaves the bottom of its source box, runs along the one-row channel under
  that layer, and comes down into the next layer with an arrow; lines are kept as
  bit masks (up/down/left/right) per cell, so crossings and junctions join into the
  right box-drawing character (``┼ ┬ ┴ ├ ┤``);
* big graphs are not drawn whole: `neighbourhood` picks the nodes within k hops of
  the selected one, and `collapse` folds name scopes (``layer1/...``) other than the
  selected node's into one box each. `outline` is the plain indented fallback.

The result is a `Canvas`: rows of (character, style-name) cells; the view maps the
style names to colors of the current theme.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

BOX_H = 3          # rows of a box
GAP = 2            # rows between layers: the channel row and the arrow row
MAX_LABEL = 30     # widest box interior (op and shape must fit: "fused_dense 64x128")
MAX_LAYOUT = 150   # more nodes than this: draw the outline instead

UP, DOWN, LEFT, RIGHT = 1, 2, 4, 8
LINES = {UP: "│", DOWN: "│", UP | DOWN: "│", LEFT: "─", RIGHT: "─", LEFT | RIGHT: "─",
         DOWN | RIGHT: "┌", DOWN | LEFT: "┐", UP | RIGHT: "└", UP | LEFT: "┘",
         UP | DOWN | RIGHT: "├", UP | DOWN | LEFT: "┤", DOWN | LEFT | RIGHT: "┬",
         UP | LEFT | RIGHT: "┴", UP | DOWN | LEFT | RIGHT: "┼"}


@dataclass
class Box:
    """One drawn node (or one collapsed scope)."""

    key: str
    title: str        # on the top border: op and shape
    label: str        # inside: the node id
    kind: str         # style name of the box: "node", "added", "removed", ...
    x: int = 0
    y: int = 0
    w: int = 0

    @property
    def center(self) -> int:
        return self.x + self.w // 2


@dataclass
class Canvas:
    """A character grid; each cell holds a character and a style name."""

    width: int
    height: int
    chars: list[list[str]] = field(default_factory=list)
    styles: list[list[str]] = field(default_factory=list)
    boxes: dict[str, Box] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.chars = [[" "] * self.width for _ in range(self.height)]
        self.styles = [[""] * self.width for _ in range(self.height)]

    def put(self, x: int, y: int, text: str, style: str) -> None:
        for k, ch in enumerate(text):
            if 0 <= x + k < self.width and 0 <= y < self.height:
                self.chars[y][x + k] = ch
                self.styles[y][x + k] = style

    def runs(self, y: int) -> list[tuple[str, str]]:
        """Row `y` as (text, style) runs, for building a styled line."""
        out: list[tuple[str, str]] = []
        row, styles = self.chars[y], self.styles[y]
        start = 0
        for x in range(1, self.width + 1):
            if x == self.width or styles[x] != styles[start]:
                out.append(("".join(row[start:x]), styles[start]))
                start = x
        return out


# -- choosing what to draw -------------------------------------------------------------

def neighbourhood(center: str, inputs: Callable[[str], list[str]],
                  consumers: Callable[[str], list[str]], hops: int,
                  limit: int = 60) -> list[str]:
    """Ids within `hops` edges of `center` (up through inputs, down through
    consumers), breadth first, at most `limit` of them (the nearest win)."""
    seen = {center: 0}
    order = [center]
    queue = deque([center])
    while queue and len(order) < limit:
        node = queue.popleft()
        if seen[node] >= hops:
            continue
        for other in list(inputs(node)) + list(consumers(node)):
            if other not in seen and len(order) < limit:
                seen[other] = seen[node] + 1
                order.append(other)
                queue.append(other)
    return order


def scope_of(node_id: str) -> str:
    """The name scope of an id: 'layer1/dense/matmul' -> 'layer1/dense'; '' if none."""
    return node_id.rsplit("/", 1)[0] if "/" in node_id else ""


def collapse(ids: list[str], keep_scope: str) -> dict[str, str]:
    """Map each id to the key it is drawn as: itself, or ``scope/`` for ids in a
    name scope other than `keep_scope` that holds two or more of `ids`."""
    count: dict[str, int] = {}
    for i in ids:
        count[scope_of(i)] = count.get(scope_of(i), 0) + 1
    key = {}
    for i in ids:
        scope = scope_of(i)
        folded = scope and scope != keep_scope and not keep_scope.startswith(scope + "/") \
            and count[scope] > 1
        key[i] = scope + "/" if folded else i
    return key


# -- layout ----------------------------------------------------------------------------

class _VertexView:
    def __init__(self, w: float, h: float) -> None:
        self.w, self.h = w, h
        self.xy = (0.0, 0.0)


class _EdgeView:
    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []

    def setpath(self, points: list) -> None:
        self.points = points


def _layered(boxes: dict[str, Box], edges: list[tuple[str, str]],
             beside: tuple[str, str] | None = None
             ) -> tuple[dict[str, tuple[int, float]], dict[tuple[str, str], list[float]]]:
    """Run grandalf: {key: (layer, x center)} and {edge: x of each dummy point}.
    `beside` = (anchor, mover): see `_move_beside`."""
    from grandalf.graphs import Edge, Vertex

    vertices = {k: Vertex(k) for k in boxes}
    for k, v in vertices.items():
        v.view = _VertexView(boxes[k].w, BOX_H)
    place: dict[str, tuple[int, float]] = {}
    dummies: dict[tuple[str, str], list[float]] = {}
    offset = 0.0
    for keys in _components(boxes, edges):
        inside = set(keys)
        gedges = []
        for a, b in edges:
            if a in inside:
                e = Edge(vertices[a], vertices[b])
                e.view = _EdgeView()
                gedges.append(e)
        pair = beside if beside and beside[0] in inside and beside[1] in inside else None
        sug = _sugiyama([vertices[k] for k in keys], gedges,
                        pair and (vertices[pair[0]], vertices[pair[1]]))
        offset += _collect(sug, offset, place, dummies) + 4
    return place, dummies


def _collect(sug, offset: float, place: dict, dummies: dict) -> float:
    """Add the places of one laid out component to `place` and `dummies`, shifted
    right by `offset`; returns its width."""
    component = sug.g
    xs = [v.view.xy[0] - v.view.w / 2 for v in component.sV]
    xs += [d.view.xy[0] for e in sug.ctrls for d in sug.ctrls[e].values()]
    left = min(xs)
    right = max([v.view.xy[0] + v.view.w / 2 for v in component.sV] + xs)
    for v in component.sV:
        place[v.data] = (sug.grx[v].rank, v.view.xy[0] - left + offset)
    for e in component.sE:
        if e in sug.ctrls:  # {rank: point}, the end points included
            ctrl = sug.ctrls[e]
            r0, r1 = sug.grx[e.v[0]].rank, sug.grx[e.v[1]].rank
            dummies[(e.v[0].data, e.v[1].data)] = [
                ctrl[r].view.xy[0] - left + offset for r in sorted(ctrl) if r0 < r < r1]
    return right - left


def _components(boxes: dict[str, Box], edges: list[tuple[str, str]]) -> list[list[str]]:
    """The keys of each connected component, found here in a fixed order: grandalf's
    own Graph collects edges in a set, and a set of objects iterates in a different
    order in every process, which would make the drawing change from run to run."""
    parent = {k: k for k in boxes}

    def find(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k
    for a, b in edges:
        parent[find(a)] = find(b)
    groups: dict[str, list[str]] = {}
    for k in boxes:
        groups.setdefault(find(k), []).append(k)
    return list(groups.values())


def _sugiyama(vertices: list, edges: list, beside: tuple | None):
    """grandalf's layered layout of one connected component, its vertices' views
    placed; with `beside` = (anchor, mover) vertices, `mover` next to `anchor`."""
    from grandalf.graphs import graph_core
    from grandalf.layouts import SugiyamaLayout

    sug = SugiyamaLayout(graph_core(vertices, edges))
    sug.xspace, sug.yspace = 2, BOX_H + GAP
    sug.dw, sug.dh = 1, BOX_H
    sug.init_all()
    # sug.draw(2), in its steps: two rounds of ordering the layers (fewer crossings),
    # the coordinates, the edge routes; `mover` is moved between them.
    for _ in range(2):
        for _ in sug.ordering_step():
            pass
    adjacent = beside is not None and abs(sug.grx[beside[0]].rank
                                          - sug.grx[beside[1]].rank) == 1
    if adjacent:
        _order_beside(sug, *beside)
    sug.setxy()
    if adjacent:
        _move_beside(sug, *beside)
    sug.draw_edges()
    return sug


def _order_beside(sug, anchor, mover) -> None:
    """Move vertex `mover` in its layer to the median slot among `anchor`'s
    neighbours there (about where the coordinates will put `anchor`), so that
    `_move_beside` has little to move and its edges cross few others."""
    grx = sug.grx
    near = getattr(grx[anchor], "nvs", {}).get(grx[mover].rank - grx[anchor].rank, [])
    layer = sug.layers[grx[mover].rank]
    slots = sorted(grx[v].pos for v in near if v is not mover and v in layer)
    if not slots:
        return
    target = layer[slots[(len(slots) - 1) // 2]]
    layer.remove(mover)
    layer.insert(layer.index(target), mover)
    step = 1.0 / (len(layer) - 1) if len(layer) > 1 else 1.0
    for i, v in enumerate(layer):   # what grandalf's Layer.setup sets
        grx[v].pos, grx[v].bar = i, i * step


def _move_beside(sug, anchor, mover) -> None:
    """Put vertex `mover` right above or below vertex `anchor` (adjacent layers),
    pushing the other vertices of its layer, dummy points of long edges included,
    aside to make room (edges are routed through the dummy points after this).

    The neighbourhood of a node read by eight others is eight boxes wide, and the
    layout centred the node over the middle of its readers: the reader the cursor
    came from was drawn 150 columns away, off the view, though it is the box the
    user just looked at. Brandes & Köpf's coordinates cannot be asked to align two
    given vertices, so they are moved after.
    """
    layer = sug.layers[sug.grx[mover].rank]
    x = lambda v: v.view.xy[0]
    target = x(anchor)
    mover.view.xy = (target, mover.view.xy[1])
    for side in (1, -1):   # the vertices to the right, then to the left
        edge = target + side * mover.view.w / 2
        others = sorted((v for v in layer if v is not mover and (x(v) >= target) == (side > 0)),
                        key=lambda v: side * x(v))
        for v in others:
            least = edge + side * (sug.xspace + v.view.w / 2)
            if side * x(v) < side * least:
                v.view.xy = (least, v.view.xy[1])
            edge = x(v) + side * v.view.w / 2


def _place_boxes(boxes: dict[str, Box], place: dict[str, tuple[int, float]],
                 beside: tuple[str, str] | None) -> None:
    """Fill in each box's x and y from its (layer, x center) in `place`."""
    layer_top = lambda r: r * (BOX_H + GAP)
    for key, box in boxes.items():
        rank, cx = place[key]
        box.x, box.y = max(0, round(cx - box.w / 2)), layer_top(rank)
    if beside is not None and abs(place[beside[0]][0] - place[beside[1]][0]) == 1:
        # Rounded apart, boxes of odd and even widths put their edges' arrows in
        # two neighbouring columns (▼▼): one column for both.
        anchor, mover = boxes[beside[0]], boxes[beside[1]]
        mover.x = max(0, anchor.center - mover.w // 2)
    # Boxes in one layer must not overlap after rounding: push right when they do.
    by_layer: dict[int, list[Box]] = {}
    for box in boxes.values():
        by_layer.setdefault(box.y, []).append(box)
    for row in by_layer.values():
        row.sort(key=lambda b: b.x)
        for left, right in zip(row, row[1:]):
            right.x = max(right.x, left.x + left.w + 1)


def draw(boxes: dict[str, Box], edges: list[tuple[str, str]],
         edge_style: Callable[[str, str], str] = lambda a, b: "edge",
         beside: tuple[str, str] | None = None) -> Canvas:
    """Lay out `boxes` joined by `edges` (source above target) and draw them.

    `edge_style(a, b)` names the style of an edge (to highlight the selected node's).
    `beside` = (anchor, mover): box `mover` is placed next to box `anchor` when
    they are in adjacent layers (the box the cursor came from, next to it).
    The boxes get their x/y filled in; the canvas keeps them by key so a view can
    scroll to the selected one.
    """
    place, dummies = _layered(boxes, edges, beside)
    _place_boxes(boxes, place, beside)
    width = max([b.x + b.w for b in boxes.values()] + [1]) + 2
    height = max([b.y + BOX_H for b in boxes.values()] + [1])
    masks = [[0] * width for _ in range(height)]
    mask_style: list[list[str]] = [[""] * width for _ in range(height)]
    arrows: list[tuple[int, int, str]] = []

    def line(x: int, y: int, bits: int, style: str) -> None:
        if 0 <= x < width and 0 <= y < height:
            masks[y][x] |= bits
            if style != "edge" or not mask_style[y][x]:
                mask_style[y][x] = style

    def vertical(x: int, y0: int, y1: int, style: str) -> None:
        for y in range(y0, y1 + 1):
            line(x, y, (UP if y > y0 else 0) | (DOWN if y < y1 else 0), style)

    def horizontal(y: int, x0: int, x1: int, style: str) -> None:
        lo, hi = min(x0, x1), max(x0, x1)
        for x in range(lo, hi + 1):
            line(x, y, (LEFT if x > lo else 0) | (RIGHT if x < hi else 0), style)

    # Edges first, highlighted ones last so their style wins at shared cells.
    ordered = sorted(edges, key=lambda e: edge_style(*e) != "edge")
    for a, b in ordered:
        style = edge_style(a, b)
        src, dst = boxes[a], boxes[b]
        xs = [src.center] + [round(x) for x in dummies.get((a, b), [])] + [dst.center]
        y = src.y + BOX_H - 1               # the source's bottom border
        for k in range(1, len(xs)):
            if abs(xs[k] - xs[k - 1]) == 1:
                xs[k] = xs[k - 1]  # a one-column jog reads worse than an off-centre line
        for k in range(len(xs) - 1):
            x0, x1 = xs[k], xs[k + 1]
            channel = y + 1
            line(x0, y, DOWN, style)
            line(x0, channel, UP, style)
            horizontal(channel, x0, x1, style)
            line(x1, channel, DOWN, style)
            if k + 1 < len(xs) - 1:         # through a dummy: straight down its layer
                vertical(x1, channel, channel + GAP + BOX_H - 1, style)
                y = channel + GAP + BOX_H - 1
            else:
                arrows.append((x1, channel + 1, style))

    canvas = Canvas(width, height)
    for y in range(height):
        for x in range(width):
            if masks[y][x]:
                canvas.put(x, y, LINES[masks[y][x]], mask_style[y][x])
    for x, y, style in arrows:
        canvas.put(x, y, "▼", style)
    for box in boxes.values():
        _box(canvas, box)
    canvas.boxes = boxes
    return canvas


def _box(canvas: Canvas, box: Box) -> None:
    inner = box.w - 2
    title = box.title[:inner]
    label = box.label if len(box.label) <= inner else box.label[:inner - 1] + "…"
    canvas.put(box.x, box.y, "┌" + title + "─" * (inner - len(title)) + "┐", box.kind)
    canvas.put(box.x, box.y + 1, "│" + label.ljust(inner) + "│", box.kind)
    bottom = list("└" + "─" * inner + "┘")
    for x in range(box.x + 1, box.x + box.w - 1):   # keep edges leaving the box joined
        if canvas.chars[box.y + 2][x] in ("┬", "│", "┼"):
            bottom[x - box.x] = "┬"
    canvas.put(box.x, box.y + 2, "".join(bottom), box.kind)


def with_box_kind(canvas: Canvas, key: str, kind: str) -> Canvas:
    """A copy of `canvas` whose box `key` is drawn in style `kind` (the selection);
    only that box's rows are copied, the rest is shared with `canvas`."""
    box = canvas.boxes[key]
    copy = Canvas.__new__(Canvas)
    copy.width, copy.height = canvas.width, canvas.height
    copy.chars = list(canvas.chars)
    copy.styles = list(canvas.styles)
    for y in range(box.y, min(box.y + BOX_H, canvas.height)):
        copy.styles[y] = canvas.styles[y][:]
        for x in range(box.x, min(box.x + box.w, canvas.width)):
            copy.styles[y][x] = kind
    copy.boxes = dict(canvas.boxes)
    copy.boxes[key] = Box(box.key, box.title, box.label, kind, box.x, box.y, box.w)
    return copy


def box_width(title: str, label: str) -> int:
    return min(max(len(title), len(label), 6), MAX_LABEL) + 2


# -- the outline fallback ----------------------------------------------------------------

def outline(center: str, inputs: Callable[[str], list[str]], describe: Callable[[str], str],
            depth: int, limit: int = 400) -> list[tuple[str, str]]:
    """The inputs of `center` as an indented tree, `depth` levels deep.

    Returns (prefix + id, description) rows. A node reached a second time is shown
    once more with "(above)" and not expanded again; an explicit stack, not
    recursion, so a deep chain cannot overflow.
    """
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()
    stack: list[tuple[str, str, bool, int]] = [(center, "", True, 0)]
    while stack and len(rows) < limit:
        node, prefix, last, level = stack.pop()
        branch = "" if level == 0 else ("└─ " if last else "├─ ")
        again = node in seen
        rows.append((prefix + branch + node, "(above)" if again else describe(node)))
        if again:
            continue
        seen.add(node)
        if level >= depth:
            continue
        kids = list(inputs(node))
        child_prefix = prefix + ("" if level == 0 else ("   " if last else "│  "))
        for k in reversed(range(len(kids))):
            stack.append((kids[k], child_prefix, k == len(kids) - 1, level + 1))
    return rows
