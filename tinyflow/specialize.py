"""Specialization: the user's graph cloned with the concrete shapes of one run.

A TF1 graph may hold unknown dims (a placeholder of shape (None, 784)); a run knows
them all (the fed arrays and the variables' values). `specialize` clones the part of
the graph the fetches need, with every shape and dtype inferred by the op rules, so
that the passes, the memory planner and the executor work on concrete sizes, as
tqchen/tinyflow's session re-infers shapes per run. Its result is the first snapshot
of the pass pipeline ("input", passes.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinyflow.graph import FeedError, Graph, Node, topological_order
from tinyflow.memory import SCRATCH_SUFFIX
from tinyflow.ops import infer_node
from tinyflow.registry import mutated_input, source_kind, written_variable


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
    plan and the DebugRecord refer to nodes by name; for the same reason none ends in
    ":scratch", the plan's suffix for a kernel's scratch ("c:scratch" becomes
    "c:scratch_1").
    """
    leaves = frozenset(id(n) for n in sources)
    clones: dict[Node, Node] = {}
    taken: dict[str, int] = {}
    unique: dict[int, str] = {}   # id(node) -> its clone's name
    order = topological_order(fetches, leaves)
    first_written = _first_written(order, fetches, sources)
    first_writers = set(first_written.values())   # (a set: asked once per node)
    for node in order:
        name = unique[id(node)] = _unique_name(node.name, taken)
        if node in sources:
            clones[node] = _source_clone(node, sources[node], id(node) in fed, name)
        elif source_kind(node) in ("feed", "variable"):
            # unfed, or a variable only written here: then it is cloned below, with
            # the shape of the value its first writer writes
            _check_unset(node, fetches, first_written)
        else:
            if id(node) in first_writers:
                target = node.inputs[0]
                clones[target] = _written_variable(target, clones[node.inputs[1]],
                                                   unique[id(target)])
            inputs = [clones[i] for i in node.inputs]
            clone = Node(node.op, inputs, node.attrs, name=name, where=node.where,
                         provenance=node.provenance, phase=node.phase,
                         grad_of=node.grad_of)   # (the user's node: see below)
            clone.shape, clone.dtype = infer_node(node.op, inputs, node.attrs, node.where)
            clones[node] = clone
    for clone in clones.values():   # a gradient's forward op, as its clone
        if clone.grad_of is not None:
            clone.grad_of = clones.get(clone.grad_of)
    # The clones mirror the nodes (a source or a fed node has no inputs in either
    # graph), so a depth-first walk of the clones visits them in `order`, unless
    # variable writers add ordering edges, which a fed variable (a placeholder in
    # the clone) changes. Without writers, that order is handed on, not recomputed.
    if any(written_variable(node) is not None for node in order):
        return Graph([clones[f] for f in fetches]), clones
    return Graph([clones[f] for f in fetches], order=[clones[n] for n in order]), clones


def _unique_name(name: str, taken: dict[str, int]) -> str:
    """`name`, or `name_1`, `name_2`... when taken (and recorded as taken). Never one
    ending in ":scratch", the memory plan's name for a kernel's scratch
    (memory.scratch_name): a user's "c:scratch" would be taken for conv c's."""
    unique = name
    while unique in taken or unique.endswith(SCRATCH_SUFFIX):
        taken[name] = taken.get(name, 0) + 1
        unique = f"{name}_{taken[name]}"
    taken[unique] = 0
    return unique


def _source_clone(node: Node, layout: tuple[tuple, Any], fed: bool, name: str) -> Node:
    """The clone of a fed node or a variable with a value: a placeholder (fed) or a
    variable of this run's (shape, dtype)."""
    shape, dtype = layout
    op = "variable" if source_kind(node) == "variable" and not fed else "placeholder"
    return Node(op, (), {"shape": tuple(shape), "dtype": dtype.name}, name=name,
                shape=shape, dtype=dtype, where=node.where, provenance=node.provenance,
                phase=node.phase)


def _check_unset(node: Node, fetches: list[Node], first_written: dict[int, int]) -> None:
    """A placeholder not fed, or a variable with no value that nothing writes first,
    is a FeedError naming it."""
    if source_kind(node) == "feed":
        needed = ", ".join(f.name for f in fetches[:3])
        raise FeedError(f"placeholder {node.name!r} (created at {node.where}) must be "
                        f"fed: computing {needed} needs it")
    if id(node) not in first_written:
        raise FeedError(f"variable {node.name!r} (created at {node.where}) has no "
                        "value and no known shape; run "
                        "tf.global_variables_initializer() or assign it first")


def _written_variable(target: Node, value: Node, name: str) -> Node:
    """The clone of a variable that its first writer gives its shape: `value`'s."""
    dtype = target.dtype or value.dtype
    return Node("variable", (), {"shape": value.shape, "dtype": np.dtype(dtype).name},
                name=name, shape=value.shape, dtype=dtype, where=target.where,
                provenance=target.provenance, phase=target.phase)


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
