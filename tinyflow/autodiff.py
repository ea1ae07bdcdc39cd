"""Reverse-mode automatic differentiation, as new graph nodes.

`gradients(ys, xs)` walks the graph from the outputs back to the inputs (reverse
topological order) and asks each op's registered `gradient` for the gradients of its
inputs, given the gradient of its output. A node used by several consumers receives
one contribution from each; they are summed. This is the same algorithm as the
original TinyFlow (NNVM's Gradient pass), CSE 599W's assignment 1 and micrograd,
except that every gradient is itself a graph node: the result is an ordinary graph,
which the passes optimise, the planner plans, and `gradients` can differentiate
again (grad-of-grad, Hessian-vector products).

Only nodes on a path from some x to some y are visited, and the walk is iterative,
so a 10,000-node chain works.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyflow.graph import Node, TinyFlowError, next_node_id, topological_order
from tinyflow.ops import REGISTRY, add, argument_error, ones_like


def _depends_on(order: list[Node], xs: Sequence[Node]) -> set[int]:
    """ids of the nodes (in `order`) a gradient can flow through to some x: those
    with an x among their ancestors, less boolean values. A boolean (the mask in
    `x * (x > 0)`) does not move when x moves a little, so no gradient flows through
    it: as in PyTorch, where a bool tensor cannot require grad, and as eager mode
    does (a comparison is not on its tape)."""
    marked = {id(x) for x in xs}
    for node in order:  # inputs come first in a topological order
        if (node.dtype is None or node.dtype.kind != "b") and any(
                id(i) in marked for i in node.inputs):
            marked.add(id(node))
    return marked


def gradients(ys: Node | Sequence[Node], xs: Node | Sequence[Node],
              grad_ys: Sequence[Node] | None = None) -> list[Node | None]:
    """Return [d(sum of ys)/dx for x in xs], each a Node (None where y ignores x).

    `grad_ys` seeds the backward pass (default: ones, i.e. the gradient of the sum
    of each y; a None entry means ones for that y, as in TF1). Raises TinyFlowError
    naming the op and its source line when the path from x to y passes through an op
    that has no gradient.
    """
    first_new_id = next_node_id()  # every node built from here on is backward
    ys = _nodes("ys", ys)
    xs = _nodes("xs", xs)
    grad_ys = _seeds(ys, grad_ys)
    order = topological_order(ys)
    on_path = _depends_on(order, xs)

    # Contributions to each node's gradient, summed lazily when the node is reached.
    pending: dict[int, list[Node]] = {}
    for y, gy in zip(ys, grad_ys):
        pending.setdefault(id(y), []).append(gy)

    grads: dict[int, Node] = {}
    for node in reversed(order):
        contributions = pending.pop(id(node), None)
        if not contributions or id(node) not in on_path:
            continue
        total = contributions[0]
        for extra in contributions[1:]:
            total = add(total, extra)
        grads[id(node)] = total
        if not node.inputs or not any(id(i) in on_path for i in node.inputs):
            continue
        # (the sum of the contributions above stays unmarked: it joins the gradients
        # of node's consumers, which may lie in another layer)
        first = next_node_id()   # what the rule builds from here on is node's gradient
        input_grads = _input_gradients(node, total)
        _mark_grad_of(input_grads, first, node)
        for inp, g in zip(node.inputs, input_grads):
            if g is not None and id(inp) in on_path:
                pending.setdefault(id(inp), []).append(g)

    # An integer or boolean x has no gradient (TF1 gives None): its values cannot move
    # a little. (It was the ints the backward pass summed, an int64 "gradient".)
    result = [None if x.dtype is not None and x.dtype.kind in "biu" else grads.get(id(x))
              for x in xs]
    _mark_backward([g for g in result if g is not None], first_new_id)
    return result


def _nodes(arg: str, value: Node | Sequence[Node]) -> list[Node]:
    """A node or a sequence of nodes as a list. Anything else is an ArgumentError:
    a number had Python say "'float' object is not iterable", and a number among
    the xs was taken as a tensor nothing depends on (its gradient None)."""
    if isinstance(value, Node):
        return [value]
    try:
        nodes = list(value)   # a list, a tuple, dict values, a generator ...
    except TypeError:
        nodes = None
    if nodes is None or not all(isinstance(n, Node) for n in nodes):
        raise argument_error("gradients", f"{arg} must be a graph node or a list of "
                                          f"them, got {value!r}")
    return nodes


def _seeds(ys: list[Node], grad_ys: Sequence[Node | None] | None) -> list[Node]:
    """The gradient each y starts with: `grad_ys`, or ones where it says None."""
    if grad_ys is None:
        return [ones_like(y) for y in ys]
    if isinstance(grad_ys, Node):   # one seed for one y, bare (as TF1 takes it)
        grad_ys = [grad_ys]
    try:
        grad_ys = list(grad_ys)
    except TypeError:   # (len() of a number was Python's TypeError from here)
        raise argument_error("gradients", "grad_ys must be a graph node, a list of "
                                          f"them (None for ones), got {grad_ys!r}") from None
    if len(grad_ys) != len(ys):  # zip would silently drop the extra ones
        raise TinyFlowError(f"gradients: {len(ys)} ys but {len(grad_ys)} grad_ys")
    return [ones_like(y) if gy is None else gy for y, gy in zip(ys, grad_ys)]


def _input_gradients(node: Node, grad: Node) -> list[Node | None]:
    """The gradient of each input of `node`, from its op's rule and the gradient
    `grad` of its output; an op with no rule on the path is an error naming it."""
    opdef = REGISTRY[node.op]
    if opdef.gradient is None:
        raise TinyFlowError(
            f"op {node.op} ({node.name}, created at {node.where}) has no gradient, "
            "but it lies between the variables and the loss")
    input_grads = opdef.gradient(node, grad)
    if len(input_grads) != len(node.inputs):
        raise TinyFlowError(f"gradient of {node.op} returned {len(input_grads)} "
                            f"values for {len(node.inputs)} inputs")
    return input_grads


def _mark_grad_of(grads: list[Node | None], first_new_id: int, forward: Node) -> None:
    """Note `forward` as the op whose gradient the nodes built since `first_new_id`
    (those `grads` reach) compute: the debugger draws them in that op's layer."""
    stack = [g for g in grads if g is not None]
    while stack:
        node = stack.pop()
        if node.id < first_new_id or node.grad_of is not None:
            continue
        node.grad_of = forward
        stack.extend(node.inputs)


def _mark_backward(grads: list[Node], first_new_id: int) -> None:
    """Set phase="backward" on the nodes this call built (ids from first_new_id on),
    so checkpointing can tell activations (forward) from their consumers."""
    stack, seen = list(grads), set()
    while stack:
        node = stack.pop()
        if id(node) in seen or node.id < first_new_id:
            continue
        seen.add(id(node))
        node.phase = "backward"
        stack.extend(node.inputs)
