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
each `Pass` entry of `PIPELINE` states what it needs and what it provides, and the
runner checks them; `compile(..., passes=[...], disable=[...])` chooses among them by
name.

Where things live: the machinery every pass shares (records, context, the sweep,
`new_node`) is rewrite.py; the simplification rules are a table in rules.py; the
fusion passes are fusion_passes.py; gradient checkpointing is sublinear.py; the
pipeline's input, the user's graph cloned with concrete shapes, is made by
specialize.py. This file holds simplify, cse, fold, dce, infer_shapes, the pipeline
and `explain`.

Every pass is a sweep in topological order built on `rewrite.sweep`: a node's inputs
are first pointed at their replacements, then the pass may replace the node itself.
As inputs are final before their consumers are visited, one sweep reaches the pass's
fixed point (a second run rewrites nothing; the tests check it).

Two invariants every pass keeps:

* a node that replaces another keeps that node's `phase` and merges its
  `provenance`, so checkpointing and the debugger still know what it stands for;
* variables and their updates keep TF1's meaning: `graph.topological_order` runs
  every direct reader of a variable before the `assign` that writes it. No rewrite
  may make a node read a variable directly while it also depends on an assign to
  that variable (that would be a cycle, or a read of the wrong value), so rules,
  merges and fusions that would do so are skipped (see `rewrite.AfterAssign`).
  Impure ops (variables, random draws, assign, group) are never merged or folded,
  and DCE keeps everything with an effect.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyflow import fusion_passes, rules, sublinear
from tinyflow.fusion_passes import fuse_assign, fuse_dense, fuse_elementwise  # noqa: F401
from tinyflow.graph import (
    Graph,
    Node,
    TinyFlowError,
)
from tinyflow.ops import REGISTRY, ConstValue, infer_node
from tinyflow.rewrite import (  # noqa: F401  (RewriteRecord, PassContext: public here too)
    Adoptions,
    AfterAssign,
    PassContext,
    RewriteRecord,
    clone,
    finish,
    is_bound_source,
    merged_phase,
    merged_provenance,
    new_node,
    sweep,
)
from tinyflow.rules import RULES, RULES_BY_OP, Rule, add_rule, same_type  # noqa: F401
from tinyflow.specialize import specialize  # noqa: F401  (the pipeline's input)


def simplify(graph: Graph, ctx: PassContext) -> Graph:
    """Apply the rules of `RULES` wherever they match, until none does.

    Needs: shapes (rules check that a replacement has the node's shape and dtype).
    Provides: a graph with the identities removed; records "mul(x, 1) -> x" & co.
    A node is rewritten again until no rule matches it (neg(neg(neg(neg x))) -> x),
    and its inputs are already simplified, so one sweep reaches the fixed point.
    """
    first = len(ctx.records)
    names_before = {n.name for n in graph.nodes}  # a rule's result named otherwise is new
    after_assign = AfterAssign()
    adoptions = Adoptions()  # surviving node -> the nodes it now stands for
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
    result = adoptions.finish(sweep(graph, apply))
    return finish(graph, result, ctx, first)


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
    return finish(graph, sweep(graph, merge), ctx, first)


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
        if opdef.source == "constant":
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
            # C order, as the executor holds every result (see executor._materialize):
            # a folded transpose kept as a Fortran-ordered view made the sum over it
            # add in another order than the unfolded run.
            value = np.asarray(value, order="C")
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
    result = sweep(graph, try_fold)
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
    return finish(graph, result, ctx, first)


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

    def visit(old: Node, node: Node) -> Node:
        opdef = REGISTRY[node.op]
        has_effect = (not opdef.pure and not is_bound_source(node)) or any(
            effect[id(i)] for i in node.inputs)
        if opdef.effect_only:   # tf.group: only its inputs' effects matter
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
    result = sweep(graph, visit)
    return finish(graph, result, ctx, first)


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

PassFn = Callable[[Graph, PassContext], Graph]


class PipelineError(TinyFlowError):
    """A pass was chosen whose need no pass before it provides."""


@dataclass(frozen=True)
class Pass:
    """One pipeline entry: the pass function, the facts about the graph it needs
    before it runs, and the facts it provides after. The runner checks every need
    (NNVM's pass manager states the same for each pass)."""

    name: str
    fn: PassFn
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()


# What the pipeline's input, the graph `specialize` made, already provides.
INPUT_PROVIDES = ("shapes",)

# In order. simplify first: it turns zeros_like/count_ratio into constants that fold
# can use, and CSE then merges what the rules made equal. fuse_dense runs before
# fuse_elementwise, which would otherwise take the bias add into an elementwise group.
# checkpoint (sublinear.py) runs last: CSE would merge its recomputed clones back
# into the forward values.
PIPELINE: list[Pass] = [
    Pass("simplify", simplify, ("shapes",), ("identities removed",)),
    Pass("cse", cse, (), ("one node per (op, inputs, attrs)",)),
    Pass("fold", fold, ("shapes",), ("no pure node of constants only",)),
    Pass("dce", dce, (), ("group inputs with effects only",)),
    Pass("fuse_dense", fusion_passes.fuse_dense, ("shapes",), ("fused_dense nodes",)),
    Pass("fuse_elementwise", fusion_passes.fuse_elementwise, ("shapes",),
         ("fused_elementwise nodes",)),
    Pass("fuse_assign", fusion_passes.fuse_assign, ("shapes",),
         ("updates written in place",)),
    Pass("infer_shapes", infer_shapes, (), ("shapes checked against the rules",)),
    Pass("checkpoint", sublinear.checkpoint_pass, ("shapes",),
         ("recomputed activations",)),
]


def _choose(pipeline: list[Pass], passes: list[str] | None,
            disable: tuple[str, ...] | list[str]) -> list[Pass]:
    """The entries named in `passes` (all by default) minus `disable`, in pipeline
    order; ValueError for an unknown name, PipelineError for an unmet need."""
    known = {p.name for p in pipeline}
    for name in list(passes or []) + list(disable):
        if name not in known:
            raise ValueError(f"unknown pass {name!r}; passes are {sorted(known)}")
    chosen = [p for p in pipeline if (passes is None or p.name in passes)
              and p.name not in disable]
    provided = {fact: "the input graph" for fact in INPUT_PROVIDES}
    for entry in chosen:
        for need in entry.needs:
            if need not in provided:
                raise PipelineError(f"pass {entry.name!r} needs {need!r}, which no pass "
                                    f"before it provides (provided so far: "
                                    f"{sorted(provided)})")
        provided.update((fact, entry.name) for fact in entry.provides)
    return chosen


def run_pipeline(graph: Graph, ctx: PassContext, passes: list[str] | None = None,
                 disable: tuple[str, ...] | list[str] = (),
                 pipeline: list[Pass] | None = None) -> Graph:
    """Run the passes named in `passes` (default: all of `pipeline`, which defaults
    to PIPELINE; layers above may pass a longer list) minus `disable`.

    Passes run in the pipeline's order whatever the order of the names. Keeps a
    (name, graph, seconds) snapshot after each pass in ``ctx.snapshots``; the first
    snapshot is the specialized input graph, named "input" (the DebugRecord's
    graphs[0]). Raises ValueError for an unknown pass name and PipelineError (naming
    the pass and its need) when a chosen pass needs what no earlier one provides.
    """
    chosen = _choose(PIPELINE if pipeline is None else pipeline, passes, disable)
    ctx.snapshots.append(("input", graph, 0.0))
    ctx.names.update(n.name for n in graph.nodes)
    # Passes build tens of thousands of small objects that form no reference cycles
    # (a graph is a DAG); Python's cycle collector would walk all of them again and
    # again for nothing, which costs a third of the pipeline's time on big graphs.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for entry in chosen:
            ctx.current_pass = entry.name
            start = time.perf_counter()
            graph = entry.fn(graph, ctx)
            ctx.snapshots.append((entry.name, graph, time.perf_counter() - start))
    finally:
        if collecting:
            gc.enable()
        ctx.current_pass = ""
    return graph


def run_pass(name: str, graph: Graph, ctx: PassContext | None = None) -> Graph:
    """Run one pass of PIPELINE by name (for tests, lessons and the debugger)."""
    ctx = ctx if ctx is not None else PassContext()
    fn = {p.name: p.fn for p in PIPELINE}[name]
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
    node of the final graph with its program and the nodes it stands for
    (`fusion_passes.describe`).
    """
    ctx = getattr(program_or_ctx, "ctx", program_or_ctx)
    lines = ["passes (nodes after each pass):", *_pass_table(ctx),
             f"rewrites ({len(ctx.records)}):", *_rewrite_lines(ctx, max_rewrites)]
    fused = [n for n in ctx.snapshots[-1][1].nodes if n.op in fusion_passes.DESCRIBE] \
        if ctx.snapshots else []
    lines.append(f"fused nodes ({len(fused)}):")
    for node in fused:
        lines.extend(fusion_passes.describe(node))
    return "\n".join(lines)


def _pass_table(ctx: PassContext) -> list[str]:
    """One line per snapshot: nodes after the pass, the change, rewrites, time."""
    per_pass = Counter(r.pass_name for r in ctx.records)
    lines, previous = [], None
    for name, graph, seconds in ctx.snapshots:
        count = len(graph.nodes)
        change = "" if previous is None else f"{count - previous:+d}"
        rewrites = "" if previous is None else f"{per_pass.get(name, 0)} rewrites"
        lines.append(f"  {name:<17}{count:>7} nodes {change:>7}  {rewrites:<13}"
                     f"{seconds * 1e3:8.2f} ms")
        previous = count
    return lines


def _rewrite_lines(ctx: PassContext, max_rewrites: int) -> list[str]:
    """The first `max_rewrites` records, then a tally of the rest by reason."""
    lines = []
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
    return lines


def _reason_kind(reason: str) -> str:
    """A reason with node names cut off, for tallies ("same op, ... as matmul_3")."""
    for prefix in ("same op, inputs and attrs as", "folded", "fused"):
        if reason.startswith(prefix):
            return prefix + " ..."
    return reason
