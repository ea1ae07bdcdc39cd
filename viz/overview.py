"""The folded overview of a graph: layers and phases as boxes, not thousands of nodes.

A 10,000-node transformer drawn node by node is a tangle; its author thinks in
layers (``block3``), and in forward, backward and optimizer. The overview groups
every node of a graph by (phase, layer) and draws one box per group, the way
TensorBoard's graph dashboard folds name scopes (Wongsuphasawat et al., "Visualizing
Dataflow Graphs of Deep Learning Models in TensorFlow", 2017), and then folds
*repeated* layers (``block0`` .. ``block5`` with the same ops) into one box with a
count ``×6``. Expanding a box (Enter) lays out its nodes inside the picture.

* **phase**: ``backward`` for nodes `gradients` built (``Node.phase``); of the rest,
  the ancestors of the first output (the loss) are ``forward`` and everything else
  (the updates the optimizer added) is ``optimizer``: found from the graph's
  structure, never from op names; a graph without gradients (inference, an imported
  model) is all ``forward``. An eager record (pass ``eager``) is the tape of
  many steps whose parameters are updated in place, so there the ``optimizer`` ops
  are those an optimizer's ``step`` ran (attribute ``optimizer_step``) or that read
  a gradient (a hand-written update), the rest ``forward``.
* **layer**: the name scope (``mlp1/dense/matmul`` -> ``mlp1``), or for an id
  without one a layer-like name prefix (``mlp1_w`` -> ``mlp1``, ``block3_ln`` ->
  ``block3``); an optimizer slot (``mlp1_w/m``) is its variable's, and a variable
  whose name names no layer (``unembedding``) is in none. A node with neither takes
  the layer of its inputs, preferring one that names its layer (so
  ``relu(matmul(h0, mlp1_w))`` belongs to ``mlp1``), and a source with neither (a
  constant, the labels) joins the box of its first reader. A *gradient* node takes
  the layer of the forward op it differentiates, found from the forward values it
  reads (`_backward_layer`): the record does not name that op. Layers are judged on
  the input graph and carried to later passes by provenance, since fusion mixes a
  node's inputs across layers.

Nothing here imports Textual: `Overview` computes the groups, `draw` the canvas.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from viz import layout
from viz.model import fmt_shape

LAYER_PREFIX = re.compile(r"^([A-Za-z]+\d+)(?:[_/.]|$)")
DIGITS = re.compile(r"\d+")
MAX_EXPANDED = 80     # an expanded box with more nodes shows its first ones and a stub


@dataclass
class Group:
    """One box of the overview: the nodes of one (phase, layer), or of several
    repeated layers folded together."""

    key: str                      # "forward:mlp1" or "forward:block#" (folded)
    phase: str
    layer: str                    # "mlp1", "block{0..5}", or "(other)"
    members: list[str] = field(default_factory=list)
    repeats: int = 1              # how many repeated layers were folded into it

    def ops(self, nodes: dict[str, dict]) -> Counter:
        return Counter(nodes[i]["op"] for i in self.members)


def layer_of_id(node_id: str) -> str | None:
    """The layer an id names: its first scope component, or a prefix such as
    ``mlp1`` in ``mlp1_w``; None when it names none."""
    head = node_id.split("/", 1)[0]
    found = LAYER_PREFIX.match(head)
    if found:
        return found.group(1)
    return head if "/" in node_id else None


def phases(graph: dict) -> dict[str, str]:
    """{id: "forward" | "backward" | "optimizer"} (see the module docstring)."""
    if graph.get("pass") == "eager":
        return _eager_phases(graph)
    if not any(node["phase"] == "backward" for node in graph["nodes"]):
        return {node["id"]: "forward" for node in graph["nodes"]}  # no gradients: inference
    nodes = {n["id"]: n for n in graph["nodes"]}
    ancestors: set[str] = set()
    stack = list(graph["outputs"][:1])
    while stack:
        node_id = stack.pop()
        if node_id in ancestors or node_id not in nodes:
            continue
        ancestors.add(node_id)
        stack.extend(nodes[node_id]["inputs"])
    out = {}
    for node in graph["nodes"]:
        if node["phase"] == "backward":
            out[node["id"]] = "backward"
        else:
            out[node["id"]] = "forward" if node["id"] in ancestors else "optimizer"
    return out


def _eager_phases(graph: dict) -> dict[str, str]:
    """Phases of an eager tape: a non-backward op an optimizer step ran, or one
    downstream of a gradient, is the optimizer's (nodes are in the order they ran,
    so inputs come first)."""
    out: dict[str, str] = {}
    reads_gradient: set[str] = set()
    for node in graph["nodes"]:
        if node["phase"] == "backward":
            out[node["id"]] = "backward"
            continue
        if node["attrs"].get("optimizer_step") or any(
                i in reads_gradient or out.get(i) == "backward" for i in node["inputs"]):
            reads_gradient.add(node["id"])
        out[node["id"]] = "optimizer" if node["id"] in reads_gradient else "forward"
    return out


def layers(graph: dict, origin: dict[str, str] | None = None) -> dict[str, str]:
    """{id: layer} (see the module docstring); nodes are in topological order, so
    inputs are decided before their consumers.

    `origin` is the layers of the input graph (pass 0). A later pass's graph is
    fused and rewritten: a fused node's inputs come from several layers, and
    judged on its own it took the wrong one (mlp1_w's gradient landed in "mlp2 ·
    backward"). So a node that stands for nodes of the input graph (its provenance)
    takes their layer, and only the others are judged here.
    """
    nodes = {n["id"]: n for n in graph["nodes"]}
    rank = _layer_order(graph)
    users = _forward_users(graph)
    out: dict[str, str] = {}
    named: set[str] = set()   # ids whose layer their own name (or variable) gives
    for node in graph["nodes"]:
        node_id = node["id"]
        layer = _from_origin(node, origin)
        if layer is None:
            layer = _own_layer(node, nodes, out)
            if layer is not None:
                named.add(node_id)
        if layer is None and node["phase"] == "backward":
            layer = _backward_layer(node, nodes, users, out, rank)
        if layer is None:
            layer = _inherited(node, named, out)
        out[node_id] = layer
    return out


def _inherited(node: dict, named: set[str], decided: dict[str, str]) -> str:
    """The layer of a node its id does not name: its inputs', preferring an input
    whose own name gives its layer (relu(matmul(h0, mlp1_w)) is mlp1's), the last
    such input (a residual add of block0's output and block1's branch is
    block1's). A node joining three or more layers (a training op's group of every
    update) is none of them: "(other)"."""
    from_named = [decided[i] for i in node["inputs"] if i in named]
    from_any = [decided[i] for i in node["inputs"] if decided.get(i, "(other)") != "(other)"]
    if len(set(from_any)) >= 3:
        return "(other)"
    return (from_named or from_any or ["(other)"])[-1]


def _from_origin(node: dict, origin: dict[str, str] | None) -> str | None:
    """The input-graph layer of the nodes `node` stands for: the layer most of them
    are in; "(other)" for one that CSE merged from copies in three or more layers
    (one zeros constant for every block's mask); else its first one's."""
    if not origin:
        return None
    found = [origin[p] for p in node["provenance"] if p in origin]
    if not found:
        return None
    layer, count = Counter(found).most_common(1)[0]
    if count * 2 > len(found):
        return layer
    return "(other)" if len(set(found)) >= 3 else found[0]


def _own_layer(node: dict, nodes: dict[str, dict], decided: dict[str, str]) -> str | None:
    """The layer a node's own id gives: its scope or layer-like prefix
    (`layer_of_id`); an optimizer slot ``mlp0_w/m`` or ``final_ln_gamma/m`` the
    layer of its variable; and a variable whose name names no layer (``unembedding``,
    ``final_ln_gamma``) none, "(other)": it is no part of the block next to it, so
    the ops reading it (the model's head) are not either."""
    head = node["id"].split("/", 1)[0]
    if "/" in node["id"] and head in nodes and head in decided:
        return decided[head]
    layer = layer_of_id(node["id"])
    if layer is None and node["op"] == "variable":
        return "(other)"
    return layer


def _backward_layer(node: dict, nodes: dict[str, dict], users: dict[str, list[str]],
                    decided: dict[str, str], rank: dict[str, int]) -> str | None:
    """The layer of a gradient node: the layer of the forward op it differentiates.

    A record from tinyflow names that op (the node's "grad_of"), and it is
    followed exactly. Without it (an older record, or a pass's graph where the op
    was fused away), the forward values a gradient reads say: a gradient rule reads
    its op's inputs and output.
    An input of the op belongs to the layer before (the weight gradient of mlp1
    reads relu(mlp0's output)), so each forward value read votes for the layer of
    the forward ops that *use* it (relu_23 is used by mlp1's matmul), when they
    all lie in one layer. Without a vote, the gradient flowing in decides: where
    gradients of two layers meet, the earlier layer's (the gradient flows from the
    loss back towards the input, so it is entering that layer).

    """
    op = node.get("grad_of")
    if op in decided:
        return decided[op]
    votes: Counter = Counter()
    for inp in node["inputs"]:
        if inp not in nodes or nodes[inp]["phase"] == "backward":
            continue
        layers_of_users = {decided[u] for u in users.get(inp, ()) if u in decided}
        layers_of_users = layers_of_users or {decided.get(inp, "(other)")}
        if len(layers_of_users) == 1:
            votes[layers_of_users.pop()] += 1
    if votes:
        return votes.most_common(1)[0][0]
    flowing = {decided[i] for i in node["inputs"]
               if i in nodes and nodes[i]["phase"] == "backward" and i in decided}
    known = [layer for layer in flowing if layer in rank]
    if known:
        return min(known, key=lambda layer: rank[layer])
    return "(other)" if flowing else None


def _forward_users(graph: dict) -> dict[str, list[str]]:
    """{id: the non-gradient nodes that read it}."""
    users: dict[str, list[str]] = {}
    for node in graph["nodes"]:
        if node["phase"] != "backward":
            for inp in node["inputs"]:
                users.setdefault(inp, []).append(node["id"])
    return users


def _layer_order(graph: dict) -> dict[str, int]:
    """{layer: position} of the layers named by ids, in the order they first
    appear in the graph (mlp0 before mlp1): "earlier" for `_backward_layer`."""
    order: dict[str, int] = {}
    for node in graph["nodes"]:
        layer = layer_of_id(node["id"])
        if layer is not None and node["phase"] != "backward":
            order.setdefault(layer, len(order))
    return order


def overview_of(graphs: list[dict], index: int) -> Overview:
    """The overview of pass `index` of a record's `graphs`, its layers judged on
    the input graph (pass 0) and carried to the later pass by provenance."""
    origin = layers(graphs[0]) if index > 0 else None
    return Overview(graphs[index], origin)


class Overview:
    """The groups of one graph, with repeated layers folded, and the edges between
    groups. `expanded` holds the keys of boxes drawn with their nodes inside.
    `origin`: the layers of the record's input graph (see `layers`)."""

    def __init__(self, graph: dict, origin: dict[str, str] | None = None) -> None:
        self.graph = graph
        self.nodes = {n["id"]: n for n in graph["nodes"]}
        phase, layer = phases(graph), layers(graph, origin)
        # A source without a layer of its own (a constant, a placeholder such as the
        # labels) joins the box of its first reader, rather than one "(other)" box
        # whose edges would cross the whole picture; but not one that readers in
        # several layers share (a constant CSE merged across the blocks): in one
        # block's box it would make that block differ from its repeats.
        readers: dict[str, list[str]] = {}
        for node in graph["nodes"]:
            for inp in node["inputs"]:
                readers.setdefault(inp, []).append(node["id"])
        for node in graph["nodes"]:
            mine = readers.get(node["id"])
            if not node["inputs"] and layer_of_id(node["id"]) is None and mine and \
                    len({layer[r] for r in mine}) == 1:
                layer[node["id"]], phase[node["id"]] = layer[mine[0]], phase[mine[0]]
        groups: dict[str, Group] = {}
        for node in graph["nodes"]:
            p, lay = phase[node["id"]], layer[node["id"]]
            key = f"{p}:{lay}"
            groups.setdefault(key, Group(key, p, lay)).members.append(node["id"])
        self.groups = self._fold_repeats(groups)
        self.group_of = {m: g.key for g in self.groups.values() for m in g.members}
        self.expanded: set[str] = set()
        self.last_edges: list[tuple[str, str]] = []   # edges of the last drawing

    def _fold_repeats(self, groups: dict[str, Group]) -> dict[str, Group]:
        """Fold groups of one phase whose layers differ only in numbers
        (``block0``, ``block1``) and hold the same ops into one ``block{0..N}``."""
        families: dict[tuple, list[Group]] = {}
        for group in groups.values():
            shape = tuple(sorted(group.ops(self.nodes).items()))
            pattern = DIGITS.sub("#", group.layer)
            families.setdefault((group.phase, pattern, shape), []).append(group)
        out: dict[str, Group] = {}
        for (phase, pattern, _), family in families.items():
            if len(family) < 2 or "#" not in pattern:
                out.update((g.key, g) for g in family)
                continue
            numbers = [DIGITS.findall(g.layer)[-1] for g in family]
            name = pattern.replace("#", f"{{{min(numbers, key=int)}..{max(numbers, key=int)}}}")
            merged = Group(f"{phase}:{pattern}", phase, name, repeats=len(family))
            for g in family:
                merged.members.extend(g.members)
            out[merged.key] = merged
        return out

    def title(self, group: Group) -> str:
        count = f" ×{group.repeats}" if group.repeats > 1 else ""
        return f"{group.layer}{count} · {group.phase}"

    def label(self, group: Group) -> str:
        ops = group.ops(self.nodes).most_common(2)
        return f"{len(group.members)} nodes: " + ", ".join(op for op, _ in ops)

    def toggle(self, key: str) -> None:
        if key in self.groups:
            self.expanded ^= {key}

    def box_of(self, node_id: str) -> str | None:
        """The key of the box that shows `node_id`: itself when its group is expanded."""
        group = self.group_of.get(node_id)
        if group is None:
            return None
        return node_id if group in self.expanded else group

    def shown_members(self, group: Group, keep: str | None = None) -> list[str]:
        """The members an expanded box draws: its first MAX_EXPANDED, and `keep`
        (the selected node) in place of the last of them when it comes later, so
        the view can always scroll to the selection."""
        shown = group.members[:MAX_EXPANDED]
        if keep is not None and keep in group.members and keep not in shown:
            shown = shown[:-1] + [keep]
        return shown

    def draw(self, kind_of_node, selected: str | None, keep: str | None = None
             ) -> layout.Canvas:
        """The overview canvas: a box per group (or per node of an expanded group,
        see `shown_members`), an edge wherever a member reads a member of another
        box."""
        boxes: dict[str, layout.Box] = {}
        for group in self.groups.values():
            if group.key in self.expanded:
                for node_id in self.shown_members(group, keep):
                    node = self.nodes[node_id]
                    title = f"{node['op']} {fmt_shape(node['shape'])}"
                    boxes[node_id] = layout.Box(node_id, title, node_id, kind_of_node(node_id),
                                                w=layout.box_width(title, node_id))
                continue
            title, label = self.title(group), self.label(group)
            kind = "sel" if group.key == selected else "scope"
            boxes[group.key] = layout.Box(group.key, title, label, kind,
                                          w=layout.box_width(title, label))
        key_of = {}
        for node_id in self.nodes:
            key = self.box_of(node_id)
            if key in boxes:
                key_of[node_id] = key
        edges: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for node_id, node in self.nodes.items():
            for inp in node["inputs"]:
                a, b = key_of.get(inp), key_of.get(node_id)
                if a and b and a != b and (a, b) not in seen:
                    seen.add((a, b))
                    edges.append((a, b))
        style = lambda a, b: "edge_sel" if selected in (a, b) else "edge"
        self.last_edges = edges
        return layout.draw(boxes, edges, style)
