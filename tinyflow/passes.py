"""Graph passes: rewrites that explain themselves.

The compiler half of TinyFlow: the optimizations a course teaches (pattern-matching
simplification, common subexpression elimination, constant folding, dead code
elimination, operator fusion, shape inference), each one short function a student
can read, switch off, and watch in the debugger.

A pass is a plain function ``(graph, ctx) -> Graph``. It returns a new graph (nodes
that did not change are shared, never mutated: the pipeline keeps a snapshot after
every pass, so the debugger can step through them) and appends a `RewriteRecord` to
``ctx.records`` for every rewrite: the nodes it removed, the nodes it added, and one
line a person understands ("mul(x, 1) -> x", "same op, inputs and attrs as
matmul_12"). This follows NNVM's pass manager (the IR under the original TinyFlow):
each pass states what it needs and what it provides, and `PIPELINE` lists them in
order; `compile(..., passes=[...], disable=[...])` chooses among them by name.

The simplification rules are a table of their own, in `rules.py`, with `new_node`,
the helper every pass uses to build a replacement.

Every pass is a sweep in topological order built on `_rewrite`: a node's inputs are
first pointed at their replacements, then the pass may replace the node itself. As
inputs are final before their consumers are visited, one sweep reaches the pass's
fixed point (a second run rewrites nothing; the tests check it).

Two invariants every pass keeps:

* a node that replaces another keeps that node's `phase` and merges its
  `provenance`, so checkpointing and the debugger still know what it stands for;
* variables and their updates keep TF1's meaning: `graph.topological_order` runs
  every direct reader of a variable before the `assign` that writes it. No rewrite
  may make a node read a variable directly while it also depends on an assign to
  that variable (that would be a cycle, or a read of the wrong value), so rules,
  merges and fusions that would do so are skipped (see `_AfterAssign`). Impure ops
  (variables, random draws, assign, group) are never merged or folded, and DCE
  keeps everything with an effect.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyflow import fusion, rules
from tinyflow.graph import (
    FeedError,
    Graph,
    Node,
    TinyFlowError,
    next_node_id,
    topological_order,
)
from tinyflow.ops import REGISTRY, ConstValue, infer_node
from tinyflow.registry import mutated_input
from tinyflow.rules import (RULES, RULES_BY_OP, Rule, add_rule, clone,  # noqa: F401
                            is_bound_source, merged_phase, merged_provenance, new_node,
                            same_type)

# A rewrite: (node as it was, node with its inputs already rewritten) -> replacement.
Rewrite = Callable[[Node, Node], Node]

# ----------------------------------------------------------------------------------
# Records and context
# ----------------------------------------------------------------------------------


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
        name, k = base, 0
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name


def specialize(fetches: list[Node], sources: dict[Node, tuple[tuple, Any]],
               fed: frozenset[int] = frozenset()) -> tuple[Graph, dict[Node, Node]]:
    """Clone the graph under `fetches` with concrete shapes (shape inference).

    `sources` maps each fed node and each variable to its (shape, dtype) for this
    run; `fed` holds the ids of those that are fed. Fed nodes become placeholders in
    the clone (feeding an intermediate tensor cuts the graph there, as in TF1; a fed
    Variable is read from the feed in that run, its stored value untouched).
    Returns the specialized graph and a map from each user node to its clone.
    Raises FeedError for a placeholder that is needed but not fed, and ShapeError
    (op, shapes, user's line) for shapes that disagree.

    The passes below never clone a placeholder or variable of this graph again: the
    executor binds feeds and variables to exactly these nodes. Clones get unique names
    (a user may name two nodes alike: the second "W" becomes "W_1"), since the memory
    plan and the DebugRecord refer to nodes by name.
    """
    leaves = frozenset(id(n) for n in sources)
    clones: dict[Node, Node] = {}
    taken: dict[str, int] = {}
    order = topological_order(fetches, leaves)
    first_written = _first_written(order, fetches, sources)
    for node in order:
        name = node.name
        while name in taken:
            taken[node.name] += 1
            name = f"{node.name}_{taken[node.name]}"
        taken[name] = 0
        if node in sources:
            shape, dtype = sources[node]
            op = "variable" if node.op == "variable" and id(node) not in fed else "placeholder"
            clone = Node(op, (), {"shape": tuple(shape), "dtype": dtype.name}, name=name,
                         shape=shape, dtype=dtype, where=node.where, provenance=node.provenance,
                         phase=node.phase)
        elif node.op == "placeholder":
            needed = ", ".join(f.name for f in fetches[:3])
            raise FeedError(f"placeholder {node.name!r} (created at {node.where}) must be "
                            f"fed: computing {needed} needs it")
        elif node.op == "variable":
            if id(node) not in first_written:
                raise FeedError(f"variable {node.name!r} (created at {node.where}) has no "
                                "value and no known shape; run "
                                "tf.global_variables_initializer() or assign it first")
            continue  # only written here: cloned with the shape of the value written
        else:
            if id(node) in first_written.values():
                target = node.inputs[0]
                value = clones[node.inputs[1]]
                clones[target] = Node("variable", (), {"shape": value.shape,
                                      "dtype": np.dtype(target.dtype or value.dtype).name},
                                      name=target.name, shape=value.shape,
                                      dtype=target.dtype or value.dtype, where=target.where,
                                      provenance=target.provenance, phase=target.phase)
            inputs = [clones[i] for i in node.inputs]
            clone = Node(node.op, inputs, node.attrs, name=name, where=node.where,
                         provenance=node.provenance, phase=node.phase)
            clone.shape, clone.dtype = infer_node(node.op, inputs, node.attrs, node.where)
        clones[node] = clone
    return Graph([clones[f] for f in fetches]), clones


def _first_written(order: list[Node], fetches: list[Node], sources: dict) -> dict[int, int]:
    """{id of variable: id of its first writer} for the variables with no value and no
    known shape that this graph only writes (an optimizer slot made as zeros_like of a
    variable whose shape was unknown at minimize time): they take the shape of the
    value written, as a first tf.assign does."""
    fetched = {id(f) for f in fetches}
    readers: set[int] = set()
    writers: dict[int, int] = {}
    for node in order:
        targets = node.inputs[:1] if mutated_input(node) is not None else ()
        for inp in node.inputs:
            if inp.op == "variable" and inp not in sources:
                if any(inp is t for t in targets) and inp not in node.inputs[1:]:
                    writers.setdefault(id(inp), id(node))
                else:
                    readers.add(id(inp))
    return {v: w for v, w in writers.items() if v not in readers and v not in fetched}


# ----------------------------------------------------------------------------------
# The machinery every pass shares
# ----------------------------------------------------------------------------------


def _rewrite(graph: Graph, rewrite: Rewrite) -> Graph:
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


class _Adoptions:
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
        return _add_provenance(graph, self.pending)


def _add_provenance(graph: Graph, extra: dict[int, list[Node]]) -> Graph:
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
    return _rewrite(graph, merge)


def _finish(before: Graph, after: Graph, ctx: PassContext, first_record: int) -> Graph:
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


class _AfterAssign:
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



def simplify(graph: Graph, ctx: PassContext) -> Graph:
    """Apply the rules of `RULES` wherever they match, until none does.

    Needs: shapes (rules check that a replacement has the node's shape and dtype).
    Provides: a graph with the identities removed; records "mul(x, 1) -> x" & co.
    A node is rewritten again until no rule matches it (neg(neg(neg(neg x))) -> x),
    and its inputs are already simplified, so one sweep reaches the fixed point.
    """
    first = len(ctx.records)
    names_before = {n.name for n in graph.nodes}  # a rule's result named otherwise is new
    after_assign = _AfterAssign()
    adoptions = _Adoptions()  # surviving node -> the nodes it now stands for
    added: set[int] = set()

    def apply(old: Node, node: Node) -> Node:
        for _ in range(16):  # each rule makes the graph smaller; 16 is a safety net
            for rule in rules.RULES_BY_OP.get(node.op, ()):  # read at run time: add_rule
                new = rule.rewrite(node)
                if new is None or new is node:
                    continue
                if not after_assign.fresh_read_is_safe(new.inputs, [node], new):
                    continue
                built = new.name not in names_before and id(new) not in added
                ctx.record([node], [new] if built else [], rule.pattern)
                if built:
                    added.add(id(new))
                else:
                    adoptions.add(new, [node])
                node = new
                break
            else:
                return node
        return node
    result = adoptions.finish(_rewrite(graph, apply))
    return _finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# cse: common subexpression elimination by hash-consing
# ----------------------------------------------------------------------------------

def _cse_key(node: Node, inputs: list[Node]) -> tuple | None:
    """(op, inputs, attrs) as a hashable key; commutative ops sort their inputs.
    None when an attribute is not hashable (then the node is never merged)."""
    inputs = [id(i) for i in inputs]
    if REGISTRY[node.op].commutative:
        inputs.sort()
    key = (node.op, tuple(inputs), tuple(sorted(node.attrs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def cse(graph: Graph, ctx: PassContext) -> Graph:
    """Merge nodes that compute the same thing: same op, same inputs, same attrs.

    Needs: nothing. Provides: at most one node per (op, inputs, attrs).
    Hash-consing (as in NNVM and XLA): in topological order each node's inputs are
    already merged, so one dictionary lookup finds its twin. Impure ops (variables,
    placeholders, random draws, dropout masks, assign, group: OpDef.pure False) are
    never merged: two random draws are two different values. Equal constants merge
    (a constant's value hashes by content). The twins are found first, on the input
    graph; one sweep then builds the merged graph, the survivor standing for all.
    """
    first = len(ctx.records)
    seen: dict[tuple, Node] = {}
    twin_of: dict[int, Node] = {}         # id(duplicate) -> the node it merges into
    merged: dict[int, list[Node]] = {}    # id(survivor) -> its duplicates
    for node in graph.nodes:
        if not REGISTRY[node.op].pure:
            continue
        canonical = [twin_of.get(id(i), i) for i in node.inputs]
        key = _cse_key(node, canonical)
        if key is None:
            continue
        twin = seen.setdefault(key, node)
        if twin is not node:
            twin_of[id(node)] = twin
            merged.setdefault(id(twin), []).append(node)
            ctx.record([node], [], f"same op, inputs and attrs as {twin.name}")
    if not twin_of:
        return graph
    built: dict[int, Node] = {}

    def merge(old: Node, node: Node) -> Node:
        twin = twin_of.get(id(old))
        if twin is not None:
            return built[id(twin)]
        duplicates = merged.get(id(old))
        if duplicates:
            node = clone(node, node.inputs, merged_provenance(node, *duplicates),
                          merged_phase(node, *duplicates))
        built[id(old)] = node
        return node
    return _finish(graph, _rewrite(graph, merge), ctx, first)


# ----------------------------------------------------------------------------------
# fold: constant folding with the op's own compute
# ----------------------------------------------------------------------------------

# Folding never makes a constant larger than this (in bytes): a folded
# zeros((4096, 4096)) * 2 would put 128 MiB into the graph and the debug record.
FOLD_MAX_BYTES = 1 << 16


def _nbytes(node: Node) -> int:
    return math.prod(node.shape) * node.dtype.itemsize


def fold(graph: Graph, ctx: PassContext) -> Graph:
    """Replace every node computed only from constants by a constant.

    Needs: shapes. Provides: no pure node whose inputs are all constants.
    The value comes from the op's own compute (the kernel the executor would run,
    on numpy), so folding cannot disagree with running. Impure ops are never folded
    (a random draw must differ per run), nor nodes above `FOLD_MAX_BYTES`, nor a
    node whose kernel raises (the run will raise the proper error, with its line).
    One record per surviving constant: "folded 3 constant nodes into one".
    """
    first = len(ctx.records)
    values: dict[int, np.ndarray] = {}   # id(node) -> value, for constant-like nodes
    cone: dict[int, list[Node]] = {}     # id(folded constant) -> old nodes it replaces

    def try_fold(old: Node, node: Node) -> Node:
        opdef = REGISTRY[node.op]
        if node.op == "constant":
            values[id(node)] = node.attrs["value"].array
            return node
        if (not opdef.pure or node.shape is None or node.dtype is None
                or _nbytes(node) > FOLD_MAX_BYTES):
            return node
        if node.inputs and not all(id(i) in values for i in node.inputs):
            return node
        try:
            with np.errstate(all="ignore"):  # the run would give the same inf/nan
                value = opdef.compute(np, *[values[id(i)] for i in node.inputs],
                                      **node.attrs)
            value = np.asarray(value)
        except Exception:
            return node
        if value.shape != tuple(node.shape):
            return node
        value = value.astype(node.dtype, copy=False)
        if not node.inputs:  # zeros/ones: usable by consumers, not worth a record
            values[id(node)] = value
            return node
        const = new_node("constant", [], {"value": ConstValue(value)}, node,
                          name=ctx.unique_name(f"folded_{node.name}"))
        values[id(const)] = value
        cone[id(const)] = [old] + [n for i in node.inputs for n in cone.get(id(i), [i])]
        return const
    result = _rewrite(graph, try_fold)
    if result is not graph:
        kept = {n.name for n in result.nodes}
        for node in result.nodes:
            if id(node) in cone:
                gone = list(dict.fromkeys(n.name for n in cone[id(node)]
                                          if n.name not in kept))
                shape = "x".join(map(str, node.shape)) or "scalar"
                ctx.records.append(RewriteRecord(
                    ctx.current_pass, gone, [node.name],
                    f"folded {len(gone)} constant nodes into one ({shape} {node.dtype})"))
    return _finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# dce: dead code elimination
# ----------------------------------------------------------------------------------

def dce(graph: Graph, ctx: PassContext) -> Graph:
    """Remove work whose value nobody needs and which has no effect.

    Needs: nothing. Provides: every `group` input has an effect.
    A Graph holds only what its outputs reach, so a node nobody uses is already
    gone (each pass's records name the nodes its rewrites left unused). What is left
    is `tf.group`: it runs its inputs for their effects and ignores their values, so
    an input with no effect above it is dead. Effects are the impure computed ops:
    assign (a variable update) and random draws (each draw advances a generator the
    next run continues from). Duplicate group inputs are dropped too.
    """
    first = len(ctx.records)
    effect: dict[int, bool] = {}

    def sweep(old: Node, node: Node) -> Node:
        opdef = REGISTRY[node.op]
        has_effect = (not opdef.pure and not is_bound_source(node)) or any(
            effect[id(i)] for i in node.inputs)
        if node.op == "group":
            keep = list(dict.fromkeys(i for i in node.inputs if effect[id(i)]))
            dead = [i for i in node.inputs if not effect[id(i)]]
            if len(keep) < len(node.inputs):
                new = clone(node, tuple(keep))
                for i in dict.fromkeys(dead):
                    ctx.record([i], [], f"{node.name} runs {i.name} only for its effect, "
                                        "and it has none")
                if len(dead) < len(node.inputs) - len(keep):
                    ctx.record([], [], f"{node.name} listed an input twice")
                node = new
        effect[id(node)] = has_effect
        return node
    result = _rewrite(graph, sweep)
    return _finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# fuse_dense: matmul + bias + activation as one node
# ----------------------------------------------------------------------------------

def _only_consumer(node: Node, users: dict[Node, list[Node]], outputs: set[int]
                   ) -> Node | None:
    """The one node that reads `node` (possibly twice), or None (several, or fetched)."""
    if id(node) in outputs:
        return None
    readers = users.get(node, [])
    if not readers or any(r is not readers[0] for r in readers):
        return None
    return readers[0]


def fuse_dense(graph: Graph, ctx: PassContext) -> Graph:
    """matmul(a, w) + bias, then an optional activation -> one `fused_dense` node.

    Needs: shapes. Provides: fused_dense nodes (fusion.py).
    The bias is an `add` (either operand) that does not broadcast the product, or a
    `bias_add` on a 2-D product; the matmul must have no other reader. The
    activation (relu, tanh, sigmoid, gelu) joins when it is the sum's only reader.
    In a training graph relu's gradient reads the sum too, so there the relu stays
    outside; tanh and sigmoid gradients read the activation's output, so they join.
    """
    first = len(ctx.records)
    users = graph.consumers()
    outputs = {id(o) for o in graph.outputs}
    after_assign = _AfterAssign()
    plans: dict[int, tuple[int, int, bool]] = {}  # root id -> (matmul pos, bias pos, act)
    for node in graph.nodes:
        if node.op != "matmul":
            continue
        adder = _only_consumer(node, users, outputs)
        if adder is None or adder.op not in ("add", "bias_add") or adder.inputs.count(node) != 1:
            continue
        pos = adder.inputs.index(node)
        if adder.op == "bias_add" and (pos != 0 or len(node.shape) != 2):
            continue
        if not same_type(adder, node):
            continue
        root, act = adder, False
        reader = _only_consumer(adder, users, outputs)
        if (reader is not None and REGISTRY[reader.op].dense_activation
                and same_type(reader, adder)):
            root, act = reader, True
        if not after_assign.fresh_read_is_safe([*node.inputs, *adder.inputs], [root], root):
            continue
        plans[id(root)] = (pos, 1 - pos, act)

    def fuse(old: Node, node: Node) -> Node:
        plan = plans.get(id(old))
        if plan is None:
            return node
        pos, bias_pos, act = plan
        adder = node.inputs[0] if act else node
        matmul = adder.inputs[pos]
        attrs = {"transpose_a": bool(matmul.attrs.get("transpose_a", False)),
                 "transpose_b": bool(matmul.attrs.get("transpose_b", False)),
                 "activation": node.op if act else None}
        members = [matmul, adder] + ([node] if act else [])
        fused = new_node("fused_dense", [*matmul.inputs, adder.inputs[bias_pos]], attrs,
                          node, tuple(members[:-1]), name=ctx.unique_name(f"fused_{node.name}"),
                          same_value=True)
        ctx.record(members, [fused], " + ".join(m.op for m in members) + " -> fused_dense")
        return fused
    result = _rewrite(graph, fuse)
    return _finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# fuse_elementwise: trees of elementwise ops -> one node with a small program
# ----------------------------------------------------------------------------------

def _fusable(node: Node) -> bool:
    opdef = REGISTRY[node.op]
    return opdef.elementwise and opdef.pure and node.op != "fused_elementwise"


def fuse_elementwise(graph: Graph, ctx: PassContext) -> Graph:
    """A tree of elementwise ops, each with one consumer inside it -> one node.

    Needs: shapes. Provides: fused_elementwise nodes holding their program.
    Walking from the outputs back, an elementwise node joins the group of its only
    consumer when that consumer is elementwise too; a node read by several nodes (or
    fetched) starts a group of its own, since its value must exist anyway. As every
    member but the root has its one reader inside the group, fusing cannot create a
    cycle; the one exception, a member that reads a variable while the group waits
    on an assign, is refused (see `_AfterAssign`). Groups of one stay as they are.
    """
    first = len(ctx.records)
    users = graph.consumers()
    outputs = {id(o) for o in graph.outputs}
    after_assign = _AfterAssign()
    root_of: dict[int, Node] = {}          # member id -> its group's root (old nodes)
    members: dict[int, list[Node]] = {}    # root id -> members, root first
    for node in reversed(graph.nodes):
        if not _fusable(node):
            continue
        root = node
        reader = _only_consumer(node, users, outputs)
        if reader is not None and id(reader) in root_of:
            candidate = root_of[id(reader)]
            if after_assign.fresh_read_is_safe(node.inputs, [], candidate):
                root = candidate
        root_of[id(node)] = root
        members.setdefault(id(root), []).append(node)

    current_of: dict[int, Node] = {}      # member id -> its rebuilt copy in this sweep

    def fuse(old: Node, node: Node) -> Node:
        group = members.get(id(root_of.get(id(old), old)))
        if group is None or len(group) < 2:
            return node
        current_of[id(old)] = node
        if group[0] is not old:
            return node  # a member: its value lives on inside the root's program
        ordered = list(reversed(group))  # topological order, root last
        register_of = {id(current_of[id(m)]): f"t{k}" for k, m in enumerate(ordered)}
        inputs: list[Node] = []
        input_index: dict[int, int] = {}  # id -> position in inputs (a list scan
        program = []                      # per operand was quadratic in wide groups)
        for m in ordered:
            operands = []
            for i in current_of[id(m)].inputs:
                name = register_of.get(id(i))
                if name is None:
                    name = f"x{input_index.setdefault(id(i), len(inputs))}"
                    if len(input_index) > len(inputs):
                        inputs.append(i)
                operands.append(name)
            program.append((m.op, tuple(operands), tuple(sorted(m.attrs.items()))))
        fused = new_node("fused_elementwise", inputs, {"program": tuple(program)}, node,
                          tuple(ordered[:-1]), name=ctx.unique_name(f"fused_{node.name}"),
                          same_value=True)
        ctx.sources[fused.name] = tuple((m.name, m.where) for m in ordered)
        ops = ", ".join(m.op for m in ordered)
        ctx.record(ordered, [fused], f"fused {len(ordered)} elementwise ops ({ops}), each "
                                     "read only by the next, into one kernel")
        return fused
    result = _rewrite(graph, fuse)
    return _finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# fuse_assign: an optimizer's update computed straight into its variable
# ----------------------------------------------------------------------------------

def _update_program(value: Node) -> tuple[fusion.Program, list[Node]] | None:
    """(program, inputs) computing `value`: a fused node's own, or one instruction
    for a single elementwise op; None for anything else."""
    if value.op == "fused_elementwise":
        return value.attrs["program"], list(value.inputs)
    if not _fusable(value):
        return None
    inputs: list[Node] = []
    for i in value.inputs:
        if i not in inputs:
            inputs.append(i)
    operands = tuple(f"x{inputs.index(i)}" for i in value.inputs)
    return ((value.op, operands, tuple(sorted(value.attrs.items()))),), inputs


def _last_op_may_overwrite(program: fusion.Program, register: str) -> bool:
    """Can the program's last instruction write the buffer that holds `register`?
    Yes when it does not read it, or when its op may overwrite exactly that operand
    (OpDef.inplace: each element is read before it is written)."""
    op, operands, _ = program[-1]
    if register not in operands:
        return True
    inplace = REGISTRY[op].inplace
    return (inplace is not None and inplace < len(operands)
            and operands[inplace] == register and operands.count(register) == 1)


def fuse_assign(graph: Graph, ctx: PassContext) -> Graph:
    """assign(v, elementwise update) -> one `fused_assign` node that writes v in place.

    Needs: shapes; fused_elementwise nodes. Provides: fused_assign nodes (fusion.py).
    An optimizer's update (``v - lr * g``, Adam's moments) is an elementwise program
    whose value exists only to be copied into the variable: computed straight into
    the variable's buffer, it needs neither a temporary nor the copy. Fused when
    * the value is a fused_elementwise (or one elementwise op) that nothing else
      reads or fetches, with the variable's shape and dtype;
    * the program reads no variable but v, and this assign is v's only writer: the
      fused node is a writer (OpDef.mutates) and runs where the assign ran,
      after every other reader of v, so it still reads v's value from before the
      run; a read of another variable, or a second writer of v, would lose its order;
    * the last instruction may overwrite v where it reads it (`_last_op_may_overwrite`);
      earlier instructions read v freely, since only the last one writes it.
    """
    first = len(ctx.records)
    users = graph.consumers()
    outputs = {id(o) for o in graph.outputs}
    writers = Counter(id(n.inputs[0]) for n in graph.nodes
                      if mutated_input(n) is not None and n.inputs)
    updates: set[int] = set()  # ids of the assigns to fuse
    for node in graph.nodes:
        if node.op != "assign" or len(node.inputs) != 2:
            continue
        var, value = node.inputs
        if (var.op != "variable" or writers[id(var)] != 1 or not same_type(value, var)
                or _only_consumer(value, users, outputs) is not node):
            continue
        found = _update_program(value)
        if found is None:
            continue
        program, inputs = found
        if any(i.op == "variable" and i is not var for i in inputs):
            continue
        if var in inputs and not _last_op_may_overwrite(program, f"x{inputs.index(var)}"):
            continue
        updates.add(id(node))

    def fuse(old: Node, node: Node) -> Node:
        if id(old) not in updates:
            return node
        var, value = node.inputs
        program, inputs = _update_program(value)  # the value's inputs as rewritten
        fused = new_node("fused_assign", [var, *inputs], {"program": program}, node,
                         (value,), name=ctx.unique_name(f"fused_{node.name}"),
                         same_value=True)
        ctx.sources[fused.name] = ctx.sources.get(value.name, ((value.name, value.where),))
        ctx.record([value, node], [fused],
                   f"{value.op} read only by assign({var.name}, ...) -> fused_assign: "
                   f"the update is computed straight into {var.name}'s buffer (no "
                   "temporary, no copy)")
        return fused
    result = _rewrite(graph, fuse)
    return _finish(graph, result, ctx, first)


# ----------------------------------------------------------------------------------
# infer_shapes: the op rules, once more, over the rewritten graph
# ----------------------------------------------------------------------------------

def infer_shapes(graph: Graph, ctx: PassContext) -> Graph:
    """Re-infer every node's shape and dtype from its op's rule and its inputs.

    Needs: a graph. Provides: shapes and dtypes that agree with the op rules.
    `specialize` inferred the input graph's shapes; every node a pass builds is
    inferred when it is built. This pass checks the whole rewritten graph once
    more against the rules, the one source of truth, so a pass that changed what
    a node computes is caught at compile time, named, instead of as a wrong
    answer at run time.
    """
    original = {n.name: n for n in ctx.snapshots[0][1].nodes} if ctx.snapshots else {}
    for node in graph.nodes:
        if is_bound_source(node) or _unchanged(node, original.get(node.name)):
            continue
        shape, dtype = infer_node(node.op, node.inputs, node.attrs, node.where)
        if tuple(shape) != node.shape or dtype != node.dtype:
            made = "the user's graph" if node.name in original else "a pass"
            raise TinyFlowError(
                f"infer_shapes: {node.op} {node.name} (created at {node.where}, by {made}) "
                f"holds shape {node.shape} {node.dtype}, but its rule gives {tuple(shape)} "
                f"{dtype}; a pass before this one changed what it computes")
    return graph


def _unchanged(node: Node, was: Node | None) -> bool:
    """Same op, attrs, shape and input shapes as `was` (the input graph's node of the
    same name), whose shape specialize inferred: the rule would give the same again."""
    if was is None or was.op != node.op or was.shape != node.shape or \
            was.dtype != node.dtype or len(was.inputs) != len(node.inputs):
        return False
    for a, b in zip(was.inputs, node.inputs):
        if a is not b and (a.shape != b.shape or a.dtype != b.dtype):
            return False
    return was.attrs == node.attrs


# ----------------------------------------------------------------------------------
# The pipeline
# ----------------------------------------------------------------------------------

Pass = Callable[[Graph, PassContext], Graph]

# In order. simplify first: it turns zeros_like/count_ratio into constants that fold
# can use, and CSE then merges what the rules made equal. fuse_dense runs before
# fuse_elementwise, which would otherwise take the bias add into an elementwise group.
PIPELINE: list[tuple[str, Pass]] = [
    ("simplify", simplify),                  # needs shapes; provides identities removed
    ("cse", cse),                            # provides one node per (op, inputs, attrs)
    ("fold", fold),                          # provides no pure node of constants only
    ("dce", dce),                            # provides group inputs with effects only
    ("fuse_dense", fuse_dense),              # provides fused_dense nodes
    ("fuse_elementwise", fuse_elementwise),  # provides fused_elementwise nodes
    ("fuse_assign", fuse_assign),            # provides updates written in place
    ("infer_shapes", infer_shapes),          # provides shapes checked against the rules
]


def run_pipeline(graph: Graph, ctx: PassContext, passes: list[str] | None = None,
                 disable: tuple[str, ...] | list[str] = (),
                 pipeline: list[tuple[str, Pass]] | None = None) -> Graph:
    """Run the passes named in `passes` (default: all of `pipeline`, which defaults
    to PIPELINE; layers above add their own passes to it) minus `disable`.

    Passes run in the pipeline's order whatever the order of the names. Keeps a
    (name, graph, seconds) snapshot after each pass in ``ctx.snapshots``; the first
    snapshot is the specialized input graph, named "input" (the DebugRecord's
    graphs[0]). Raises ValueError for an unknown pass name.
    """
    pipeline = PIPELINE if pipeline is None else pipeline
    known = {name for name, _ in pipeline}
    for name in list(passes or []) + list(disable):
        if name not in known:
            raise ValueError(f"unknown pass {name!r}; passes are {sorted(known)}")
    chosen = [p for p in pipeline if (passes is None or p[0] in passes)
              and p[0] not in disable]
    ctx.snapshots.append(("input", graph, 0.0))
    ctx.names.update(n.name for n in graph.nodes)
    # Passes build tens of thousands of small objects that form no reference cycles
    # (a graph is a DAG); Python's cycle collector would walk all of them again and
    # again for nothing, which costs a third of the pipeline's time on big graphs.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for name, fn in chosen:
            ctx.current_pass = name
            start = time.perf_counter()
            graph = fn(graph, ctx)
            ctx.snapshots.append((name, graph, time.perf_counter() - start))
    finally:
        if collecting:
            gc.enable()
        ctx.current_pass = ""
    return graph


def run_pass(name: str, graph: Graph, ctx: PassContext | None = None) -> Graph:
    """Run one pass of PIPELINE by name (for tests, lessons and the debugger)."""
    ctx = ctx if ctx is not None else PassContext()
    fn = dict(PIPELINE)[name]
    ctx.current_pass = name
    ctx.names.update(n.name for n in graph.nodes)
    return fn(graph, ctx)


# ----------------------------------------------------------------------------------
# explain: the printable report
# ----------------------------------------------------------------------------------

def explain(program_or_ctx: Any, max_rewrites: int = 40) -> str:
    """What the passes did to a compiled program, as text.

    Accepts a Program (anything with a ``ctx``) or a PassContext. Lists the node
    count after each pass (with the change and the time taken), the rewrite records
    (the first `max_rewrites`, then a tally of the rest by reason), and every fused
    node of the final graph with its program and the nodes it stands for.
    """
    ctx = getattr(program_or_ctx, "ctx", program_or_ctx)
    per_pass = Counter(r.pass_name for r in ctx.records)
    lines = ["passes (nodes after each pass):"]
    previous = None
    for name, graph, seconds in ctx.snapshots:
        count = len(graph.nodes)
        change = "" if previous is None else f"{count - previous:+d}"
        rewrites = "" if previous is None else f"{per_pass.get(name, 0)} rewrites"
        lines.append(f"  {name:<17}{count:>7} nodes {change:>7}  {rewrites:<13}"
                     f"{seconds * 1e3:8.2f} ms")
        previous = count
    lines.append(f"rewrites ({len(ctx.records)}):")
    for record in ctx.records[:max_rewrites]:
        removed = ", ".join(record.removed) or "-"
        added = ", ".join(record.added) or "-"
        lines.append(f"  [{record.pass_name}] {record.reason}: removed {removed}; "
                     f"added {added}")
    rest = ctx.records[max_rewrites:]
    if rest:
        lines.append(f"  ... and {len(rest)} more:")
        tally = Counter((r.pass_name, _reason_kind(r.reason)) for r in rest)
        for (pass_name, reason), n in tally.most_common():
            lines.append(f"    {n:5d} x [{pass_name}] {reason}")
    fused = [n for n in ctx.snapshots[-1][1].nodes if n.op.startswith("fused_")] \
        if ctx.snapshots else []
    lines.append(f"fused nodes ({len(fused)}):")
    for node in fused:
        program_inputs = node.inputs
        if node.op == "fused_elementwise":
            body = fusion.format_program(node.attrs["program"])
        elif node.op == "fused_assign":  # input 0 is the variable written
            program = node.attrs["program"]
            body = (f"{node.inputs[0].name} <- t{len(program) - 1}, where "
                    + fusion.format_program(program))
            program_inputs = node.inputs[1:]
        else:
            act = node.attrs.get("activation")
            body = "matmul + bias" + (f" + {act}" if act else "")
        inputs = ", ".join(f"x{k}={i.name}" for k, i in enumerate(program_inputs))
        lines.append(f"  {node.name} ({node.op}): {body}")
        lines.append(f"      inputs {inputs}; stands for {', '.join(node.provenance)}")
    return "\n".join(lines)


def _reason_kind(reason: str) -> str:
    """A reason with node names cut off, for tallies ("same op, ... as matmul_3")."""
    for prefix in ("same op, inputs and attrs as", "folded", "fused"):
        if reason.startswith(prefix):
            return prefix + " ..."
    return reason
