"""Graph passes: rewrites that explain themselves.

A pass is a plain function ``(graph, ctx) -> Graph`` that returns a new graph and
appends a `RewriteRecord` to ``ctx.records`` for every rewrite it makes. The pipeline
runs the registered passes in order and keeps a snapshot of the graph after each one,
so the debugger can step through them. This follows NNVM's pass manager: each pass
says what it needs and what it provides, and the pipeline documents its own order.

The first pass, `infer_shapes`, is special: it *specializes* the user's graph to the
shapes that were fed, cloning every node with concrete shapes and dtypes. Every later
pass (and the planner, and the executor) can then trust ``node.shape``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinyflow.graph import FeedError, Graph, Node, topological_order
from tinyflow.ops import infer_node


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
    """What passes share: the records they append, and per-pass timing/snapshots."""

    records: list[RewriteRecord] = field(default_factory=list)
    snapshots: list[tuple[str, Graph, float]] = field(default_factory=list)
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)
    current_pass: str = ""

    def record(self, removed: list[Node], added: list[Node], reason: str) -> None:
        self.records.append(RewriteRecord(self.current_pass, [n.name for n in removed],
                                          [n.name for n in added], reason))


def specialize(fetches: list[Node], sources: dict[Node, tuple[tuple, Any]]
               ) -> tuple[Graph, dict[Node, Node]]:
    """Clone the graph under `fetches` with concrete shapes (the infer_shapes pass).

    `sources` maps each fed node and each variable to its (shape, dtype) for this
    run. Fed nodes become placeholders in the clone (feeding an intermediate tensor
    cuts the graph there, as in TF1). Returns the specialized graph and a map from
    each user node to its clone. Raises FeedError for a placeholder that is needed
    but not fed, and ShapeError (op, shapes, user's line) for shapes that disagree.
    """
    leaves = frozenset(id(n) for n in sources)
    clones: dict[Node, Node] = {}
    for node in topological_order(fetches, leaves):
        if node in sources:
            shape, dtype = sources[node]
            op = "variable" if node.op == "variable" else "placeholder"
            clone = Node(op, (), {"shape": tuple(shape), "dtype": dtype.name}, name=node.name,
                         shape=shape, dtype=dtype, where=node.where, provenance=node.provenance,
                         phase=node.phase)
        elif node.op == "placeholder":
            needed = ", ".join(f.name for f in fetches[:3])
            raise FeedError(f"placeholder {node.name!r} (created at {node.where}) must be "
                            f"fed: computing {needed} needs it")
        elif node.op == "variable":
            raise FeedError(f"variable {node.name!r} (created at {node.where}) has no value "
                            "and no known shape; run tf.global_variables_initializer() "
                            "or assign it first")
        else:
            inputs = [clones[i] for i in node.inputs]
            clone = Node(node.op, inputs, node.attrs, name=node.name, where=node.where,
                         provenance=node.provenance, phase=node.phase)
            clone.shape, clone.dtype = infer_node(node.op, inputs, node.attrs, node.where)
        clones[node] = clone
    return Graph([clones[f] for f in fetches]), clones


# A pass: (graph, ctx) -> graph. The pipeline is a list of (name, function), in order.
Pass = Callable[[Graph, PassContext], Graph]
PIPELINE: list[tuple[str, Pass]] = []


def run_pipeline(graph: Graph, ctx: PassContext, passes: list[str] | None = None,
                 disable: tuple[str, ...] | list[str] = ()) -> Graph:
    """Run the passes named in `passes` (default: all of PIPELINE) minus `disable`.

    Keeps a (name, graph, seconds) snapshot after each pass in ``ctx.snapshots``;
    the first snapshot is the specialized input graph, named "infer_shapes".
    """
    known = {name for name, _ in PIPELINE}
    for name in list(passes or []) + list(disable):
        if name not in known:
            raise ValueError(f"unknown pass {name!r}; passes are {sorted(known)}")
    chosen = [p for p in PIPELINE if (passes is None or p[0] in passes)
              and p[0] not in disable]
    ctx.snapshots.append(("infer_shapes", graph, 0.0))
    for name, fn in chosen:
        ctx.current_pass = name
        start = time.perf_counter()
        graph = fn(graph, ctx)
        ctx.snapshots.append((name, graph, time.perf_counter() - start))
    return graph
