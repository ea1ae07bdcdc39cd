"""The IR: Node, Graph and topological order.

A program is a directed acyclic graph of Nodes. Each Node is one application of an
op from the registry (ops.py) to input Nodes; a Graph is the list of output Nodes,
and everything else is whatever those outputs reach. This follows NNVM (the IR under
the original TinyFlow): nodes carry plain attributes, passes return new graphs.

Two details make the IR safe for real programs:

* every node remembers the user's ``file:line`` that built it (``where``), so an
  error in a pass, the planner or a kernel can point at the user's source line;
* topological order is computed with an explicit stack, never recursion, so a
  10,000-node chain does not hit Python's recursion limit.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tinyflow.errors import FeedError, ShapeError, TinyFlowError  # noqa: F401  (public here too)
from tinyflow.registry import mutated_input, source_kind, written_variable


# The op builders behind Node's Python operators (`x + y` is OPERATOR_BUILDERS["add"]
# (x, y)), filled in by ops.py and shape_ops.py, the layer above, when they load.
OPERATOR_BUILDERS: dict[str, Callable[..., Any]] = {}


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# numpy's own frames are skipped too: `np.allclose(t, 1)` reaches a Tensor through
# numpy's code, and the line to name is the user's call, not numpy's numeric.py.
_SKIPPED_DIRS = (_PACKAGE_DIR + os.sep, os.path.dirname(os.path.abspath(np.__file__)) + os.sep)
_ids = itertools.count()


def format_shape(shape: Sequence | None) -> str:
    """(2, ?) for a shape with an unknown dim, (3,) for one dim, (?) when even the
    rank is unknown: the one way TinyFlow's messages write a shape."""
    if shape is None:
        return "(?)"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + \
        ("," if len(shape) == 1 else "") + ")"


def tensor_nbytes(shape: Sequence | None, dtype: Any) -> int | None:
    """Bytes of a tensor of `shape` and `dtype`; None when either is not fully known."""
    if shape is None or dtype is None or None in shape:
        return None
    return math.prod(shape) * np.dtype(dtype).itemsize


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base_1`, `base_2`...: the first not in `taken`, which it joins."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def next_node_id() -> int:
    """A fresh id, smaller than the id of every node built after this call."""
    return next(_ids)


def user_source_line() -> str:
    """Return ``file:line`` of the innermost stack frame outside the tinyflow package.

    That frame is the user's code that asked for the node (a tutorial, a test, a
    script). Frames inside tinyflow itself (layers, optimizers, autodiff) are skipped
    so that a gradient node points at the line that called `tf.gradients`; so are
    numpy's (a numpy function the user called with a Tensor).
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_SKIPPED_DIRS):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<tinyflow>"


class Node:
    """One op application.

    Fields (see shared/DESIGN.md):
      op      name of the op in the registry (``ops.REGISTRY``)
      inputs  tuple of input Nodes
      attrs   dict of plain, hashable values (ints, floats, strings, tuples)
      name    unique, human-readable name (``matmul_12``)
      shape   tuple of ints; ``None`` entries are dims unknown until a feed fixes
              them; the whole shape is ``None`` when even the rank is unknown
      dtype   a numpy dtype, or None when unknown
      where   the user's ``file:line`` that created the node
      provenance  names of the user-level nodes this node stands for (a fused or
              rewritten node lists all of them; the debugger shows it)
      phase   "forward", or "backward" for nodes that `gradients` built; gradient
              checkpointing and the debugger read it, and passes that replace a node
              keep its phase
      grad_of the forward Node whose gradient rule built this one (backward nodes
              only; the debugger puts a gradient in its forward op's layer)

    Nodes compare and hash by identity, so they can key a `feed_dict`.
    """

    __slots__ = ("op", "inputs", "attrs", "name", "shape", "dtype", "where",
                 "provenance", "phase", "grad_of", "id", "__weakref__")

    def __init__(self, op: str, inputs: Sequence[Node] = (), attrs: dict | None = None,
                 name: str | None = None, shape: tuple | None = None,
                 dtype: Any = None, where: str | None = None,
                 provenance: tuple[str, ...] | None = None, phase: str = "forward",
                 grad_of: Node | None = None) -> None:
        self.id = next(_ids)
        self.op = op
        self.inputs = tuple(inputs)
        self.attrs = dict(attrs or {})
        self.name = name or f"{op}_{self.id}"
        self.shape = None if shape is None else tuple(shape)
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.where = where or user_source_line()
        self.provenance = provenance if provenance is not None else (self.name,)
        self.phase = phase
        self.grad_of = grad_of

    def __repr__(self) -> str:
        shape = "?" if self.shape is None else "x".join(
            "?" if d is None else str(d) for d in self.shape)
        return f"<{self.name}: {self.op} {shape} {self.dtype} @ {self.where}>"

    # -- Python operators: sugar over the op builders in ops.py ---------------------
    # graph.py sits below ops.py and imports nothing above it: the op modules put
    # their builders into OPERATOR_BUILDERS when they load.
    def _apply(self, name: str, *args: Any) -> Node:
        return OPERATOR_BUILDERS[name](*args)

    def __add__(self, other): return self._apply("add", self, other)
    def __radd__(self, other): return self._apply("add", other, self)
    def __sub__(self, other): return self._apply("sub", self, other)
    def __rsub__(self, other): return self._apply("sub", other, self)
    def __mul__(self, other): return self._apply("mul", self, other)
    def __rmul__(self, other): return self._apply("mul", other, self)
    def __truediv__(self, other): return self._apply("div", self, other)
    def __rtruediv__(self, other): return self._apply("div", other, self)
    def __pow__(self, other): return self._apply("pow", self, other)
    def __rpow__(self, other): return self._apply("pow", other, self)
    def __matmul__(self, other): return self._apply("matmul", self, other)
    def __rmatmul__(self, other): return self._apply("matmul", other, self)
    def __neg__(self): return self._apply("neg", self)
    def __abs__(self): return self._apply("abs", self)
    def __lt__(self, other): return self._apply("less", self, other)
    def __le__(self, other): return self._apply("less_equal", self, other)
    def __gt__(self, other): return self._apply("greater", self, other)
    def __ge__(self, other): return self._apply("greater_equal", self, other)
    def __getitem__(self, index): return self._apply("getitem", self, index)

    # numpy defers to Node's operators: `np.ones(3) + x` calls x.__radd__ and builds
    # an add node, instead of an object array of one node per element.
    __array_ufunc__ = None

    # Identity semantics: a Node is a dict key, and `==` builds no graph (TF1 too).
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __bool__(self) -> bool:
        # `if node:` would silently be True; make the mistake loud instead.
        raise TypeError(f"the truth value of graph node {self.name} is not known until "
                        "the graph runs; use tf.where / tf.greater inside the graph")

    @property
    def ndim(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def __iter__(self):
        # Python's fallback loop over __getitem__ built getitem nodes until one was
        # out of range (a ShapeError), or forever for an unknown shape. TF1 refuses.
        raise TypeError(f"graph node {self.name} is not iterable: it has no value until the "
                        "graph runs; index it (x[i]) instead")

    # -- TF1's Tensor and Variable methods, each handed to the layer that owns it ----
    def get_shape(self) -> TensorShape:
        """TF1's x.get_shape(): the static shape, None where not known yet."""
        return TensorShape(self.shape)

    def eval(self, feed_dict: dict | None = None, session: Any = None) -> Any:
        """TF1's x.eval(): its value, run in `session` or the default Session (the
        innermost `with tf.Session() as sess:`; session.py)."""
        return OPERATOR_BUILDERS["eval"](self, feed_dict, session)

    def run(self, feed_dict: dict | None = None, session: Any = None) -> None:
        """TF1's op.run(): run it (a training step, an initializer) for its effect."""
        OPERATOR_BUILDERS["eval"](self, feed_dict, session)

    def assign(self, value: Any) -> Node:
        """TF1's v.assign(value) on a Variable: tf.assign(v, value)."""
        return self._apply("assign", self, value)

    def assign_add(self, value: Any) -> Node:
        return self._apply("assign_add", self, value)

    def assign_sub(self, value: Any) -> Node:
        return self._apply("assign_sub", self, value)


class TensorShape(tuple):
    """A static shape as TF1's get_shape() gives it: a tuple of ints and Nones (None
    where the dimension is not known yet) with TF1's as_list() and ndims. An unknown
    rank is the empty tuple with `ndims` None, and as_list() refuses it, as TF1's."""

    def __new__(cls, dims: Sequence[int | None] | None) -> TensorShape:
        shape = super().__new__(cls, () if dims is None else tuple(dims))
        shape.known_rank = dims is not None
        return shape

    @property
    def ndims(self) -> int | None:
        return len(self) if self.known_rank else None

    def as_list(self) -> list[int | None]:
        if not self.known_rank:
            raise ValueError("as_list() is not defined on an unknown TensorShape")
        return list(self)


def ordering_dependencies(nodes: Iterable[Node]) -> dict[Node, list[Node]]:
    """Extra ordering edges: every other reader of a variable runs before its writers.

    Returns {writer: [readers that must run first]}. Without these edges, a
    `tf.assign(W, ...)` could run before another op that reads W in the same
    step, and that op would see the updated value. A writer (an op whose OpDef
    `mutates` an input: tf.assign, fused_assign) does not read its target; its
    other inputs are reads like any node's, so `tf.assign(U, W)` runs before W's
    writer and copies W's old value. Writers of the same variable are not ordered
    among themselves (TF1 leaves two updates of one variable in one run unordered
    too).
    """
    writers = [(node, target) for node in nodes
               if (target := written_variable(node)) is not None]
    if not writers:      # (most graphs: no reader needs listing, no edge is added)
        return {}
    readers: dict[Node, list[Node]] = {}
    for node in nodes:
        target = mutated_input(node)
        for k, inp in enumerate(node.inputs):
            if k != target and source_kind(inp) == "variable":
                readers.setdefault(inp, []).append(node)
    return {node: [r for r in readers.get(target, ()) if r is not node
                   and written_variable(r) is not target] for node, target in writers}


def reachable(outputs: Iterable[Node], leaves: frozenset[int] = frozenset()) -> list[Node]:
    """All nodes reachable from `outputs` (inputs followed, but not past the nodes
    whose ids are in `leaves`), in no particular order."""
    seen: set[Node] = set()      # (nodes hash by identity)
    result: list[Node] = []
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        result.append(node)
        if not leaves or id(node) not in leaves:
            stack.extend(node.inputs)
    return result


def _deps(node: Node, leaves: frozenset[int], extra: dict[Node, list[Node]]
          ) -> Sequence[Node]:
    if leaves and id(node) in leaves:
        return ()
    more = extra.get(node)
    return node.inputs if more is None else node.inputs + tuple(more)


def topological_order(outputs: Sequence[Node],
                      leaves: frozenset[int] = frozenset()) -> list[Node]:
    """Every node reachable from `outputs`, each after all of its inputs.

    Iterative depth-first search (an explicit stack of (node, next input index)),
    so a graph of any depth works. The order is deterministic: inputs are visited
    left to right, outputs in the order given. Variable writers additionally run
    after the other readers of the same variable (see `ordering_dependencies`).
    Nodes whose ids are in `leaves` are treated as having no inputs (a fed
    intermediate tensor cuts the graph there). Raises TinyFlowError on a cycle
    (which only those ordering edges can create).
    """
    nodes = reachable(outputs, leaves)
    extra = ordering_dependencies(nodes)
    order: list[Node] = []
    state: dict[Node, int] = {}  # 1 while on the stack, 2 when emitted
    for root in outputs:
        if state.get(root) == 2:
            continue
        stack: list[tuple[Node, Sequence[Node], int]] = []
        deps = _deps(root, leaves, extra)
        stack.append((root, deps, 0))
        state[root] = 1
        while stack:
            node, deps, i = stack[-1]
            if i < len(deps):
                stack[-1] = (node, deps, i + 1)
                child = deps[i]
                mark = state.get(child)
                if mark == 2:
                    continue
                if mark == 1:
                    raise TinyFlowError(
                        f"cycle through {child.name} ({child.where}): every read of a "
                        "variable must run before its assign, and here that is "
                        "impossible: a node both reads a variable and depends on an "
                        "assign to it, or two assigns each read the other's variable "
                        "(for a swap, copy one first: tf.assign(v, w * 1.0))")
                state[child] = 1
                stack.append((child, _deps(child, leaves, extra), 0))
            else:
                stack.pop()
                state[node] = 2
                order.append(node)
    return order


class Graph:
    """A value: the output Nodes of a program. Everything else is reachable.

    `nodes` is the topological order, computed once per Graph and cached here (not
    on the nodes, which many graphs may share). Passes return new Graphs. A caller
    that already holds `topological_order(outputs)` may hand it over as `order`.
    """

    def __init__(self, outputs: Sequence[Node], order: list[Node] | None = None) -> None:
        self.outputs: list[Node] = list(outputs)
        self._order: list[Node] | None = order

    @property
    def nodes(self) -> list[Node]:
        if self._order is None:
            self._order = topological_order(self.outputs)
        return self._order

    def consumers(self) -> dict[Node, list[Node]]:
        """Map each node to the nodes that take it as an input (in order)."""
        users: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for node in self.nodes:
            for inp in node.inputs:
                users[inp].append(node)
        return users

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"<Graph {len(self.nodes)} nodes, outputs {[o.name for o in self.outputs]}>"
