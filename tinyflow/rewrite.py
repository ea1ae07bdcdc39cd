"""The rewrite machinery every graph pass shares: records, context, and the sweep.

A pass (passes.py, fusion_passes.py, sublinear.py) is a plain function
``(graph, ctx) -> Graph`` built from the pieces here:

* `sweep` visits the nodes in topological order, points each node's inputs at their
  replacements (cloning the node when one changed), then asks the pass for the node's
  own replacement. As inputs are final before their consumers are visited, one sweep
  reaches the pass's fixed point. Nodes that did not change are shared, never mutated:
  the pipeline keeps a snapshot after every pass, for the debugger.
* `new_node` builds a node that stands for others: it keeps their phase
  (forward/backward), merges their provenance (so the debugger can say which user
  nodes a fused node came from), and takes its shape from the op's rule.
* `PassContext` collects a `RewriteRecord` per rewrite (removed, added, and one line a
  person understands: "mul(x, 1) -> x"); `finish` makes sure every node that
  disappeared is named in some record.
* `AfterAssign` guards TF1's variable semantics: no rewrite may make a node read a
  variable directly while it also waits on an assign.

This is the part of NNVM's pass manager (the IR under the original TinyFlow) that
every pass uses; the passes themselves, and the pipeline that orders them, are in
passes.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinyflow.graph import Graph, Node, next_node_id, unique_name
from tinyflow.ops import infer_node
from tinyflow.registry import mutated_input, source_kind

# A rewrite: (node as it was, node with its inputs already rewritten) -> replacement.
Rewrite = Callable[[Node, Node], Node]



def is_bound_source(node: Node) -> bool:
    """A feed or a variable: the executor binds it by identity, so it is never cloned."""
    return source_kind(node) in ("feed", "variable")


@dataclass
class RewriteRecord:
    """One rewrite: which pass, the nodes it removed and added, and why (one line)."""

    pass_name: str
    removed: list[str]
    added: list[str]
    reason: str

    def to_dict(self) -> dict:
        return {"pass": self.pass_name, "removed": self.removed, "added": self.added,
                "reason": self.reason}


@dataclass
class PassContext:
    """What passes share: the records they append, and per-pass timing/snapshots.

    snapshots  (pass name, graph after it, seconds); the first is ("input", the
               specialized graph, 0.0)
    """

    records: list[RewriteRecord] = field(default_factory=list)
    snapshots: list[tuple[str, Graph, float]] = field(default_factory=list)
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)
    current_pass: str = ""
    names: set[str] = field(default_factory=set)  # every node name used so far
    # fused node name -> (name, line) of the node each instruction of its program
    # came from, so that a kernel error inside it names the op that raised
    sources: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def record(self, removed: list[Node], added: list[Node], reason: str) -> None:
        self.records.append(RewriteRecord(self.current_pass, [n.name for n in removed],
                                          [n.name for n in added], reason))

    def unique_name(self, base: str) -> str:
        """`base`, or `base_1`, `base_2`... : a name no node of this compile has had,
        so a pass-made node ("fused_" + y.name) never takes a user node's name (the
        memory plan and the DebugRecord refer to nodes by name)."""
        return unique_name(base, self.names)


def merged_phase(*nodes: Node) -> str:
    """A value needed in the forward pass is a forward value (an activation)."""
    return "forward" if any(n.phase == "forward" for n in nodes) else nodes[0].phase


def merged_provenance(*nodes: Node) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p for n in nodes for p in n.provenance))


def clone(node: Node, inputs: tuple[Node, ...] | None = None,
           provenance: tuple[str, ...] | None = None, phase: str | None = None) -> Node:
    """A copy of `node` (same name, op, attrs, shape) with new inputs or provenance."""
    return Node(node.op, node.inputs if inputs is None else inputs, node.attrs,
                name=node.name, shape=node.shape, dtype=node.dtype, where=node.where,
                provenance=node.provenance if provenance is None else provenance,
                phase=node.phase if phase is None else phase, grad_of=node.grad_of)


def new_node(op: str, inputs: list[Node] | tuple[Node, ...], attrs: dict, replaces: Node,
              absorbed: tuple[Node, ...] = (), name: str | None = None,
              same_value: bool = False) -> Node:
    """A node built by a pass to stand for `replaces` (and the `absorbed` nodes):
    it keeps their phase, merges their provenance, and its shape comes from the op's
    rule (the one source of truth). A fused node computes exactly the value of the
    node it replaces (`same_value`): it takes that shape, and the infer_shapes pass
    checks it against the rule once, at the end."""
    node = Node(op, inputs, attrs, name=name, where=replaces.where,
                provenance=merged_provenance(replaces, *absorbed),
                phase=merged_phase(replaces, *absorbed) if absorbed else replaces.phase,
                grad_of=replaces.grad_of)
    if same_value:
        node.shape, node.dtype = replaces.shape, replaces.dtype
    else:
        node.shape, node.dtype = infer_node(op, node.inputs, node.attrs, node.where)
    return node


def sweep(graph: Graph, rewrite: Rewrite) -> Graph:
    """The sweep under every pass: visit the nodes in topological order; point each
    node's inputs at their replacements (cloning it when one changed), then let
    ``rewrite(old, current)`` return the node's own replacement (`current` when it
    keeps it). Returns `graph` itself when nothing changed."""
    replaced: dict[int, Node] = {}
    changed = False
    for node in graph.nodes:
        current = node
        if node.inputs:
            inputs = tuple([replaced[id(i)] for i in node.inputs])
            for a, b in zip(inputs, node.inputs):
                if a is not b:
                    current = clone(node, inputs)
                    break
        result = rewrite(node, current)
        replaced[id(node)] = result
        if result is not node:
            changed = True
    if not changed:
        return graph
    return Graph([replaced[id(o)] for o in graph.outputs])


class Adoptions:
    """Provenance (and phase) a surviving node takes over from nodes merged into it.

    A node built during this pass is updated at once: no snapshot holds it yet. A
    node shared with the previous graph must not change (that graph is a snapshot),
    so it is copied by a second sweep, `finish`, which only runs when needed.
    """

    def __init__(self) -> None:
        self.first_new_id = next_node_id()
        self.pending: dict[int, list[Node]] = {}

    def add(self, target: Node, merged: list[Node]) -> None:
        if is_bound_source(target):
            return  # the executor binds placeholders and variables by identity
        if target.id >= self.first_new_id:
            target.provenance = merged_provenance(target, *merged)
            target.phase = merged_phase(target, *merged)
        else:
            self.pending.setdefault(id(target), []).extend(merged)

    def finish(self, graph: Graph) -> Graph:
        return add_provenance(graph, self.pending)


def add_provenance(graph: Graph, extra: dict[int, list[Node]]) -> Graph:
    """Let the nodes with ids in `extra` also stand for the nodes listed there (their
    provenance and phase merge). Done as a second sweep, so that every consumer of a
    node sees the same, merged copy. Sources keep theirs (they are never cloned)."""
    if not extra:
        return graph

    def merge(old: Node, node: Node) -> Node:
        others = extra.get(id(old))
        if not others or is_bound_source(node):
            return node
        return clone(node, node.inputs, merged_provenance(node, *others),
                      merged_phase(node, *others))
    return sweep(graph, merge)


def finish(before: Graph, after: Graph, ctx: PassContext, first_record: int) -> Graph:
    """Close a pass: every node that disappeared is named in some record. Nodes the
    pass's own records do not name (an input only the rewritten node used) are
    listed in one last record, so the debugger can explain every change."""
    if after is before:
        return after
    kept = {n.name for n in after.nodes}
    told = {name for r in ctx.records[first_record:] for name in r.removed}
    silent = [n.name for n in before.nodes if n.name not in kept and n.name not in told]
    if silent:
        ctx.records.append(RewriteRecord(ctx.current_pass, silent, [],
                                         "no longer used after the rewrites above"))
    return after


class AfterAssign:
    """Which nodes depend on a variable update (an assign among their ancestors).

    The executor runs every direct reader of a variable before the assigns that
    write it. A rewrite that makes a node read a variable directly, where before
    only one of the nodes it replaces did, moves that read later: to the time the
    new node runs. That is only safe when the new node waits on no assign at all:
    then no update can be ordered before it, so the read cannot see a new value nor
    close a cycle (a path from any assign into the node would have to enter through
    one of its inputs, which then depends on an assign). `fresh_read_is_safe` asks
    exactly that; the rewrites that fail it are skipped.
    """

    def __init__(self) -> None:
        self.memo: dict[int, bool] = {}

    def __call__(self, node: Node) -> bool:
        """True when an assign is among `node`'s ancestors (itself included)."""
        memo = self.memo
        stack = [node]
        while stack:  # iterative post-order: deep graphs must not recurse
            top = stack[-1]
            if id(top) in memo:
                stack.pop()
                continue
            missing = [i for i in top.inputs if id(i) not in memo]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            memo[id(top)] = (mutated_input(top) is not None
                             or any(memo[id(i)] for i in top.inputs))
        return memo[id(node)]

    def fresh_read_is_safe(self, new_inputs: Sequence[Node], old_readers: Sequence[Node],
                           root: Node) -> bool:
        """May a node with `new_inputs`, replacing `old_readers` (whose result `root`
        is), read the variables among its inputs?"""
        already = {id(i) for n in old_readers for i in n.inputs if i.op == "variable"}
        fresh = [i for i in new_inputs if i.op == "variable" and id(i) not in already]
        return not fresh or not self(root)
