"""Sublinear memory: lowering the peak by changing what runs when, not where it lives.

`memory.py` packs the lifetimes a schedule gives it into one arena; it cannot go
below the most bytes alive at once. Two graph-level tools lower that peak itself:

1. **a memory-aware order** (`memory_order`): for a training step, the graph's
   depth-first order runs the whole chain of activation gradients before any weight
   gradient, so every activation stays alive to the very end. Like XLA's memory
   scheduler, we try a few topological orders and keep the one with the lowest peak.
2. **gradient checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear
   Memory Cost"): a graph pass that keeps only some forward values (segment
   boundaries) for the backward pass and recomputes the others there, trading about
   one extra forward pass for O(sqrt(N)) activation memory. `tf.checkpoint(x)` marks
   a boundary by hand.

The executor uses both: it schedules with `memory_order` whenever it plans memory,
and runs `checkpoint_pass` last in its pipeline.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from tinyflow.graph import Graph, Node, ordering_dependencies
from tinyflow.memory import (PlanStep, format_bytes, in_arena, node_nbytes, peak_alive,
                             steps_from_graph, steps_in_order)
from tinyflow.ops import REGISTRY, OpDef, infer_same, make, register
from tinyflow.registry import source_kind

# ----------------------------------------------------------------------------------
# A memory-aware schedule. The planner packs whatever lifetimes the schedule gives
# it; the schedule decides those lifetimes. The graph's depth-first order, for a
# training step, runs the whole chain of activation gradients before any weight
# gradient, so every activation stays alive to the end and checkpointing cannot
# help. XLA's answer (its DefaultMemoryScheduler) is to try a few orders and keep
# the one with the smallest peak; we do the same with three.
# ----------------------------------------------------------------------------------

# Nodes hash by identity, so they key these dicts and sets directly (no id() calls).
Dependencies = dict[Node, list[Node]]


def _dependencies(graph: Graph) -> Dependencies:
    """Each node's inputs plus the variable reader-before-writer edges."""
    nodes = graph.nodes
    extra = ordering_dependencies(nodes)
    return {n: list(dict.fromkeys(list(n.inputs) + extra.get(n, []))) for n in nodes}


def reversed_dfs_order(graph: Graph, deps: Dependencies | None = None) -> list[Node]:
    """Depth-first post-order that visits outputs and inputs right to left. For a
    training step the optimizer's updates then run from the last layer down, each
    as soon as its gradient exists, which is when the activations it read can go.
    (`deps`: `_dependencies(graph)`, if the caller has them.)"""
    deps = _dependencies(graph) if deps is None else deps
    order: list[Node] = []
    seen: set[Node] = set()
    for root in reversed(graph.outputs):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, deps[root][::-1], 0)]
        while stack:       # an explicit stack: a 10,000-deep chain must not recurse
            node, inputs, i = stack[-1]
            if i < len(inputs):
                stack[-1] = (node, inputs, i + 1)
                if inputs[i] not in seen:
                    seen.add(inputs[i])
                    stack.append((inputs[i], deps[inputs[i]][::-1], 0))
            else:
                stack.pop()
                order.append(node)
    return order


def list_order(graph: Graph, deps: Dependencies | None = None) -> list[Node]:
    """Greedy list scheduling: of the nodes whose inputs are ready, run the one that
    frees the most bytes net of what it allocates (earliest in depth-first order
    among equals). Sources (no inputs: feeds, variables, constants) run just before
    their first reader, as they would in any sensible order.

    A heap keeps the choice O(log n): a node's gain only rises, when it becomes the
    last reader of an input, and it is pushed again then (stale entries are skipped).
    (`deps`: `_dependencies(graph)`, if the caller has them.)
    """
    return _ListScheduler(graph, _dependencies(graph) if deps is None else deps).run()


class _ListScheduler:
    """The state of `list_order`: what each node waits for, who reads what, and a
    heap of ready nodes keyed by (net bytes allocated, depth-first position); the
    position names the node too (nodes[position])."""

    def __init__(self, graph: Graph, deps: Dependencies) -> None:
        self.nodes = nodes = graph.nodes
        self.deps = deps
        self.position = {n: k for k, n in enumerate(nodes)}
        self.size = {n: node_nbytes(n) if in_arena(n) else 0 for n in nodes}
        self.fetched = set(graph.outputs)
        self.source = {n for n in nodes if not deps[n]}
        self.readers: dict[Node, list[Node]] = {n: [] for n in nodes}
        self.successors: dict[Node, list[Node]] = {n: [] for n in nodes}
        self.waiting: dict[Node, int] = {}
        for node in nodes:
            for i in set(node.inputs):
                self.readers[i].append(node)
            for d in deps[node]:
                self.successors[d].append(node)
            self.waiting[node] = sum(d not in self.source for d in deps[node])
        self.readers_left = {node: len(r) for node, r in self.readers.items()}
        self.done: set[Node] = set()
        self.order: list[Node] = []
        self.heap: list[tuple[int, int]] = []

    def run(self) -> list[Node]:
        for node in self.nodes:
            if node not in self.source and self.waiting[node] == 0:
                self.push(node)
        while self.heap:
            node = self.nodes[heapq.heappop(self.heap)[1]]
            if node in self.done:
                continue
            for d in self.deps[node]:
                if d in self.source and d not in self.done:
                    self.emit(d)
            self.emit(node)
        for node in self.nodes:       # sources nobody reads (a fetched constant)
            if node not in self.done:
                self.emit(node)
        return self.order

    def push(self, node: Node) -> None:
        """Offer `node` (its inputs are ready), keyed by the bytes it would add."""
        freed = sum(self.size[i] for i in set(node.inputs)
                    if self.readers_left[i] == 1 and i not in self.fetched)
        heapq.heappush(self.heap, (self.size[node] - freed, self.position[node]))

    def emit(self, node: Node) -> None:
        """Run `node`: its inputs lose a reader (a last reader gains), its
        successors wait for one fewer."""
        self.done.add(node)
        self.order.append(node)
        for i in set(node.inputs):
            self.readers_left[i] -= 1
            if self.readers_left[i] == 1:     # its last reader would now free it
                last = next(r for r in self.readers[i] if r not in self.done)
                if self.waiting[last] == 0:
                    self.push(last)
        if node not in self.source:
            for s in self.successors[node]:
                self.waiting[s] -= 1
                if self.waiting[s] == 0:
                    self.push(s)


def peak_bytes(graph: Graph, order: Sequence[Node],
               planned: tuple[list[PlanStep], dict[str, str], set[str]] | None = None
               ) -> int:
    """The most arena bytes alive at one step if `graph` runs in `order`.

    `planned`: `steps_from_graph(graph)`, if the caller has it: a node's step does
    not depend on the order, so several orders can share it (reordered here)."""
    return peak_alive(*steps_in_order(planned or steps_from_graph(graph), order))


# Each takes the graph and, optionally, its `_dependencies` (found once for all).
ORDERS: dict[str, Callable[..., list[Node]]] = {
    "dfs": lambda graph, deps=None: graph.nodes,
    "dfs_reversed": reversed_dfs_order,
    "list": list_order,
}


def memory_order(graph: Graph,
                 planned: tuple[list[PlanStep], dict[str, str], set[str]] | None = None
                 ) -> list[Node]:
    """A topological order of `graph` (variable readers still before writers) with
    a small peak: each order in ORDERS is tried and the lowest peak kept (the
    graph's own depth-first order on a tie). `planned`: as in `peak_bytes`."""
    best, best_peak = graph.nodes, None
    planned, deps = planned or steps_from_graph(graph), _dependencies(graph)
    measured: list[list[Node]] = []
    for make_order in ORDERS.values():
        order = make_order(graph, deps)
        # Orders often coincide (a chain has only one): the same order has the same
        # peak, and the earlier one wins a tie anyway. (Lists of nodes compare
        # by identity, element by element.)
        if any(order == seen for seen in measured):
            continue
        measured.append(order)
        peak = peak_bytes(graph, order, planned)
        if best_peak is None or peak < best_peak:
            best, best_peak = order, peak
    return list(best)


# ----------------------------------------------------------------------------------
# Gradient checkpointing (Chen et al. 2016)
#
# Training keeps every forward value the backward pass reads ("activations") from
# the moment it is computed until its gradient is done: memory grows with depth.
# Chen et al. keep only the values at some segment boundaries; in the backward
# pass, each segment's forward is recomputed from its boundary just before its
# gradient needs it. With N equal layers in sqrt(N) segments, memory is O(sqrt(N))
# for one extra forward pass. As a graph pass this is a rewrite: for every forward
# value a backward node reads, and that is not a kept boundary, the backward node
# reads a clone instead, computed from the kept values.
# ----------------------------------------------------------------------------------

def _identity_compute(xp: Any, x: Any, out: Any = None) -> Any:
    # Planned and in place, this copies nothing; unplanned, it returns a copy, never
    # an alias of x (x may be a variable that a later assign overwrites).
    if out is None:
        return xp.array(x, copy=True)
    out[...] = x
    return out


# Not flagged elementwise, although it is: elementwise fusion would swallow the
# marker, and with it the user's choice of boundary.
register(OpDef("checkpoint", _identity_compute, infer_same, lambda node, g: [g],
               inplace=0, checkpoint_marker=True,
               doc="identity; marks its value as a kept boundary for gradient checkpointing"))


def checkpoint(x: Node, name: str | None = None) -> Node:
    """Mark `x` as a checkpoint (tf.checkpoint): the backward pass keeps this value
    and recomputes the forward values after it, up to the next checkpoint, instead
    of storing them. The value is `x` itself (an identity, free when run in place)."""
    return make("checkpoint", x, name=name)


def _forward_region(nodes: Sequence[Node]) -> set[int]:
    """ids of forward nodes that depend on no backward node (not the updates that
    optimizers build after the gradients, although those are "forward" too)."""
    region: set[int] = set()
    for node in nodes:
        if node.phase == "forward" and all(id(i) in region for i in node.inputs):
            region.add(id(node))
    return region


def _recomputable(nodes: Sequence[Node]) -> list[Node]:
    """Forward nodes the backward pass may recompute, in topological order: computed
    (not a source) and pure (recomputing a random mask would change the gradient)."""
    region = _forward_region(nodes)
    return [n for n in nodes if id(n) in region and source_kind(n) is None
            and REGISTRY[n.op].pure]


def _cut_points(forward: Sequence[Node]) -> set[int]:
    """ids of the nodes in `forward` (topological order) that no edge jumps over:
    every path from before such a node to after it goes through it, so keeping it
    is enough to recompute everything after it (Chen et al.'s articulation points)."""
    position = {id(n): k for k, n in enumerate(forward)}
    reach = [-1] * len(forward)        # furthest consumer of node k
    for k, node in enumerate(forward):
        for i in node.inputs:
            if id(i) in position:
                reach[position[id(i)]] = max(reach[position[id(i)]], k)
    cuts, furthest = set(), -1
    for k, node in enumerate(forward):
        if furthest <= k:
            cuts.add(id(node))
        furthest = max(furthest, reach[k])
    return cuts


def _backward_reads(nodes: Sequence[Node]) -> set[int]:
    """ids of the nodes that some backward node reads."""
    return {id(i) for n in nodes if n.phase == "backward" for i in n.inputs}


def activation_bytes(graph: Graph) -> int:
    """Bytes of forward values that the backward pass reads: what training keeps
    alive between the forward and the backward (sources, fed or stored across runs,
    are not counted)."""
    read = _backward_reads(graph.nodes)
    region = _forward_region(graph.nodes)
    return sum(node_nbytes(n) for n in graph.nodes
               if id(n) in read and id(n) in region and source_kind(n) is None)


def _segments(forward: Sequence[Node], boundaries: set[int], stored: set[int],
              sizes: dict[int, int]) -> tuple[int, int]:
    """(stored bytes, largest segment's recomputed bytes) for a choice of boundaries:
    Chen et al.'s memory estimate is their sum. `sizes` holds what the backward
    pass reads; a boundary is stored even where the backward does not read it, as
    its recomputed segment starts from it (relu's gradient reads relu's output, so
    a boundary moved back onto the sum under a relu is read by the recomputed relu
    alone)."""
    kept = sum(sizes[id(n)] if id(n) in sizes else node_nbytes(n) if id(n) in boundaries
               else 0 for n in forward if id(n) in stored)
    segment = worst = 0
    for node in forward:
        if id(node) in boundaries:
            worst, segment = max(worst, segment), 0
        elif id(node) not in stored:
            segment += sizes.get(id(node), 0)
    return kept, max(worst, segment)


def _boundaries_for(forward: Sequence[Node], cuts: set[int], sizes: dict[int, int],
                    budget: float) -> set[int]:
    """Chen et al.'s greedy: walk forward, summing activation bytes; at the first cut
    point past `budget` bytes, keep it as a boundary and start a new segment.

    A boundary that lands after a run of cheap elementwise ops moves back onto the
    output of the expensive op before them (relu(z + b) -> z): recomputing the cheap
    ops is nearly free, while keeping relu(...) means recomputing the matmul too.
    """
    position = {id(n): k for k, n in enumerate(forward)}
    chosen, running, previous = set(), 0, -1
    for node in forward:
        running += sizes.get(id(node), 0)
        if id(node) not in cuts or running <= budget:
            continue
        back = node
        while REGISTRY[back.op].elementwise:
            inner = [i for i in back.inputs if id(i) in position]
            if len(inner) != 1 or id(inner[0]) not in cuts or position[id(inner[0])] <= previous:
                break
            back = inner[0]
        if not REGISTRY[back.op].elementwise:
            node = back
        chosen.add(id(node))
        running, previous = 0, position[id(node)]
    return chosen


def _keep_for(forward: Sequence[Node], boundaries: set[int], always: set[int]) -> set[int]:
    """What the backward pass reads without recomputing: the boundaries, the nodes
    that must be kept anyway, and everything after the last boundary (the last
    segment is still alive when the backward pass starts: recomputing it would cost
    time and save nothing)."""
    last = max((k for k, n in enumerate(forward) if id(n) in boundaries), default=-1)
    return boundaries | always | {id(n) for n in forward[last + 1:]}


def choose_checkpoints(graph: Graph, mode: str | int | None
                       ) -> tuple[set[int] | None, str]:
    """The forward nodes the backward pass keeps (ids; None: keep them all, nothing
    to rewrite) and a one-line summary.

    mode None:   the tf.checkpoint markers are the boundaries.
    mode "sqrt": segments of about sqrt(N) layers: the per-segment budget is
      sqrt(total activation bytes * mean boundary bytes), which minimises
      stored + one segment when all N layers are alike.
    mode int:  a byte budget for activations (stored plus the largest recomputed
      segment): the choice that keeps the most and fits; the smallest if none fits.
    Markers are always boundaries; fetched outputs are always kept.
    """
    nodes = graph.nodes
    forward = _recomputable(nodes)
    read = _backward_reads(nodes)
    sizes = {id(n): node_nbytes(n) for n in forward if id(n) in read}
    total = sum(sizes.values())
    markers = {id(n) for n in forward if REGISTRY[n.op].checkpoint_marker}
    outputs = {id(o) for o in graph.outputs}
    cuts = _cut_points(forward)
    if mode is None:
        boundaries, label = markers, "manual checkpoints"
    elif mode == "sqrt":
        cut_sizes = [node_nbytes(n) for n in forward if id(n) in cuts]
        budget = math.sqrt(total * sum(cut_sizes) / max(len(cut_sizes), 1))
        boundaries = _boundaries_for(forward, cuts, sizes, budget) | markers
        label = f"sqrt rule (segments of {format_bytes(int(budget))})"
    elif isinstance(mode, int) and not isinstance(mode, bool) and mode > 0:
        if total <= mode:
            return None, (f"budget {format_bytes(mode)}: the activations "
                          f"({format_bytes(total)}) fit; nothing to do")
        boundaries, fits = _within_budget(forward, cuts, sizes, markers, outputs, mode)
        label = (f"budget {format_bytes(mode)} "
                 f"({'fits' if fits else 'cannot fit; smallest found'})")
    else:
        raise ValueError(f"checkpoint must be None, 'sqrt' or a positive byte budget, "
                         f"got {mode!r}")
    keep = _keep_for(forward, boundaries, outputs)
    if all(id(n) in keep for n in forward if id(n) in read):
        return None, f"{label}: too few layers to split; nothing to recompute"
    kept, worst = _segments(forward, boundaries, keep, sizes)
    return keep, (f"{label}: {len(boundaries)} boundaries; keep {format_bytes(kept)} of "
                  f"{format_bytes(total)} activations, recompute at most "
                  f"{format_bytes(worst)} at a time")


def _within_budget(forward: list[Node], cuts: set[int], sizes: dict[int, int],
                   markers: set[int], outputs: set[int], budget: int) -> tuple[set[int], bool]:
    """The boundaries that keep the most activations while stored + the largest
    recomputed segment fit in `budget` (the smallest such total if none fits), and
    whether they fit. Tries per-segment budgets from everything down to ~nothing."""
    total = sum(sizes.values())
    options = []
    for k in range(40):
        chosen = _boundaries_for(forward, cuts, sizes, total / 1.5 ** k) | markers
        kept, worst = _segments(forward, chosen, _keep_for(forward, chosen, outputs), sizes)
        options.append((kept + worst, kept, chosen))
    fitting = [o for o in options if o[0] <= budget]
    if fitting:
        return max(fitting, key=lambda o: o[1])[2], True
    return min(options, key=lambda o: o[0])[2], False


def recompute(graph: Graph, keep: set[int], ctx: Any = None) -> Graph:
    """Rewrite `graph` so that backward nodes read recomputed clones of every
    recomputable forward value not in `keep` (ids). Clones are named
    ``<node>/recompute``, have phase "backward", and read kept values or clones.
    A RewriteRecord per recomputed segment goes to `ctx` when given."""
    nodes = graph.nodes
    forward = _recomputable(nodes)
    needed = _needed_clones(nodes, forward, keep)
    if not needed:
        return graph
    clone_of = _make_clones(forward, keep, needed, ctx)
    # Rebuild the nodes downstream of a changed input (nodes are shared between
    # graphs, so the original graph, and every earlier snapshot, stays as it was).
    rebuilt: dict[int, Node] = {}
    for node in nodes:
        swap = clone_of if node.phase == "backward" else {}
        inputs = [rebuilt.get(id(i), swap.get(id(i), i)) for i in node.inputs]
        if any(a is not b for a, b in zip(inputs, node.inputs)):
            rebuilt[id(node)] = Node(node.op, inputs, node.attrs, name=node.name,
                                     shape=node.shape, dtype=node.dtype, where=node.where,
                                     provenance=node.provenance, phase=node.phase,
                                     grad_of=node.grad_of)
    return Graph([rebuilt.get(id(o), o) for o in graph.outputs])


def _needed_clones(nodes: list[Node], forward: list[Node], keep: set[int]) -> set[int]:
    """ids of the forward values to recompute: the movable (not kept) values that
    backward nodes read, and, transitively, the movable values those read."""
    movable = {id(n) for n in forward} - keep
    needed = {id(i) for n in nodes if n.phase == "backward" for i in n.inputs
              if id(i) in movable}
    for node in reversed(forward):          # consumers come after their inputs
        if id(node) in needed:
            needed.update(id(i) for i in node.inputs if id(i) in movable)
    return needed


def _make_clones(forward: list[Node], keep: set[int], needed: set[int], ctx: Any
                 ) -> dict[int, Node]:
    """{id(forward node): its backward-phase clone}, each clone reading kept values
    or other clones; a record per segment between kept boundaries goes to `ctx`."""
    clone_of: dict[int, Node] = {}
    segment: list[Node] = []     # clones since the last kept boundary, for the records
    anchor = "the inputs"
    for node in forward:
        if id(node) in keep:
            if segment and ctx is not None:
                _record_segment(ctx, segment, anchor)
            segment, anchor = [], node.name
        if id(node) not in needed:
            continue
        name = f"{node.name}/recompute"
        clone = Node(node.op, [clone_of.get(id(i), i) for i in node.inputs], node.attrs,
                     name=ctx.unique_name(name) if hasattr(ctx, "unique_name") else name,
                     shape=node.shape, dtype=node.dtype,
                     where=node.where, provenance=node.provenance, phase="backward")
        clone_of[id(node)] = clone
        segment.append(clone)
    if segment and ctx is not None:
        _record_segment(ctx, segment, anchor)
    return clone_of


def _record_segment(ctx: Any, clones: list[Node], anchor: str) -> None:
    size = sum(node_nbytes(c) for c in clones)
    first, last = clones[0].name, clones[-1].name
    span = first if len(clones) == 1 else f"{first} .. {last}"
    ctx.record([], clones, f"recompute {len(clones)} forward nodes ({span}, "
                           f"{format_bytes(size)}) from {anchor} in the backward pass "
                           "instead of keeping them")


def checkpoint_pass(graph: Graph, ctx: Any) -> Graph:
    """The gradient-checkpointing pass (register it last, as "checkpoint": CSE would
    merge the recomputed clones back into the forward values).

    Reads ``ctx.options.get("checkpoint")``: None (only tf.checkpoint markers, if
    any, are honoured), "sqrt" (Chen et al.'s sqrt(N) segments) or an int byte budget
    (see `choose_checkpoints`). Graphs without backward nodes are left alone.
    """
    mode = ctx.options.get("checkpoint") if ctx.options else None
    nodes = graph.nodes
    has_markers = any(REGISTRY[n.op].checkpoint_marker for n in nodes)
    if (mode is None and not has_markers) or not any(n.phase == "backward" for n in nodes):
        return graph
    if not getattr(ctx, "current_pass", ""):
        ctx.current_pass = "checkpoint"
    keep, summary = choose_checkpoints(graph, mode)
    ctx.record([], [], summary)
    return graph if keep is None else recompute(graph, keep, ctx)
