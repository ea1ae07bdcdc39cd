"""The simplification rules, as a table.

`passes.simplify` walks the graph and, at each node, tries the rules listed for its
op in `RULES_BY_OP`. A rule is data: a pattern string (also the reason the
RewriteRecord gives, "mul(x, 1) -> x"), the op it starts at, and a small function
that returns the replacement or None. Adding an identity is adding a row
(`add_rule`); tinygrad's pattern matcher and TVM's arithmetic simplifier are
tables for the same reason.

A rule builds its replacement with `rewrite.new_node`, as every pass does (it keeps
the replaced node's phase and provenance, and takes its shape from the op's rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyflow import image_ops, nn_ops, shape_ops  # noqa: F401  (registered before the table reads REGISTRY)
from tinyflow.graph import Node
from tinyflow.ops import REGISTRY, ConstValue
from tinyflow.registry import source_kind
from tinyflow.rewrite import new_node


# ----------------------------------------------------------------------------------
# simplify: algebraic identities, a table of pattern rules
# ----------------------------------------------------------------------------------

def _const_value(node: Node) -> float | None:
    """The one value of a constant-like node (every element equal), else None."""
    if source_kind(node) == "constant":
        array = node.attrs["value"].array
        if array.size == 0 or array.dtype.kind not in "biuf":
            return None
        first = array.flat[0]
        if array.size == 1 or (array == first).all():
            return float(first)
        return None
    return {"zeros": 0.0, "ones": 1.0}.get(node.op)


def _is(node: Node, value: float) -> bool:
    return _const_value(node) == value


def same_type(node: Node, x: Node) -> bool:
    """`x` can stand in for `node`: same shape and dtype (no broadcast, no promotion)."""
    return x.shape == node.shape and x.dtype == node.dtype


def _keep(node: Node, x: Node) -> Node | None:
    """`x` replaces `node` when it has node's shape and dtype. Never a variable: a
    consumer of `node` that also depends on an assign to that variable would then
    read it directly (see `rewrite.AfterAssign`); a reader node in between is cheap."""
    return x if same_type(node, x) and source_kind(x) != "variable" else None


def _other_operand(node: Node, value: float) -> Node | None:
    """For a binary `node` with the constant `value` as one operand: the other one."""
    a, b = node.inputs
    if _is(b, value):
        return a
    if REGISTRY[node.op].commutative and _is(a, value):
        return b
    return None


def _rule_identity(value: float) -> Callable[[Node], Node | None]:
    """op(x, value) -> x, e.g. mul(x, 1)."""
    def rule(node: Node) -> Node | None:
        x = _other_operand(node, value)
        return None if x is None else _keep(node, x)
    return rule


def _is_integer(node: Node) -> bool:
    return node.dtype is not None and node.dtype.kind in "biu"


def _rule_add_zero(integer: bool) -> Callable[[Node], Node | None]:
    """add(x, 0) -> x: for integers any zero; for floats only -0.0, since
    x + -0.0 is x for every x but the float -0.0 + +0.0 is +0.0."""
    def rule(node: Node) -> Node | None:
        x = _other_operand(node, 0.0)
        if x is None or _is_integer(node) != integer:
            return None
        zero = node.inputs[1] if x is node.inputs[0] else node.inputs[0]
        return _keep(node, x) if integer or _negative_zero(zero) else None
    return rule


def _rule_sub_zero(node: Node) -> Node | None:
    """sub(x, 0) -> x: for integers any zero; for floats only +0.0, since x - +0.0
    is x for every x but the float -0.0 - -0.0 is +0.0 (x - -0.0 is x + +0.0)."""
    x, zero = node.inputs
    if not _is(zero, 0.0):
        return None
    if _is_integer(node) or _positive_zero(zero):
        return _keep(node, x)
    return None


def _positive_zero(node: Node) -> bool:
    """A float constant with no negative sign bit (after `_is(node, 0.0)`: every
    element +0.0)."""
    if node.op != "constant":
        return False
    array = node.attrs["value"].array
    return array.dtype.kind == "f" and not bool(np.any(np.signbit(array)))


def _negative_zero(node: Node) -> bool:
    """A constant whose every element is -0.0."""
    if node.op != "constant":
        return False
    array = node.attrs["value"].array
    return array.dtype.kind == "f" and bool(np.all(np.signbit(array)))


def _rule_zero_minus(node: Node) -> Node | None:
    """sub(0, x) -> neg(x), integers only: for floats 0 - 0 is +0 but neg(0) is -0."""
    a, x = node.inputs
    if _is(a, 0.0) and _is_integer(node) and same_type(node, x):
        return new_node("neg", [x], {}, node)
    return None


def _rule_times_minus_one(node: Node) -> Node | None:
    x = _other_operand(node, -1.0)
    if x is not None and same_type(node, x):
        return new_node("neg", [x], {}, node)
    return None


# The dtypes whose numpy power(x, 0.5) is sqrt(x), bit for bit (numpy's float32 and
# float64 loops call sqrt for that exponent). float16's loop is C's powf on the
# widened value, rounded: pow(-inf, 0.5) = +inf where sqrt gives NaN, and
# pow(-0.0, 0.5) = +0.0 where sqrt keeps -0.0.
_SQRT_POWERS = (np.dtype(np.float32), np.dtype(np.float64))


def _rule_pow(exponent: float, op: str | None) -> Callable[[Node], Node | None]:
    """pow(x, exponent) -> x (op None), mul(x, x) or sqrt(x).

    Only for an exponent of one element (broadcast): numpy's power takes its exact
    shortcuts (x*x, sqrt) only for a scalar exponent; against an array of 2s (or of
    0.5s, or 1s) it runs its general pow, which differs from x*x in the last bit for
    about one float32 in ten."""
    def rule(node: Node) -> Node | None:
        x, p = node.inputs
        if not _is(p, exponent) or not same_type(node, x) or p.shape is None \
                or math.prod(p.shape) != 1:
            return None
        if op == "sqrt" and node.dtype not in _SQRT_POWERS:
            return None
        if op is None:
            return _keep(node, x)
        return new_node(op, [x, x] if op == "mul" else [x], {}, node, (p,))
    return rule


def _rule_inverse(inner_op: str) -> Callable[[Node], Node | None]:
    """f(g(x)) -> x where g undoes f: neg(neg x)."""
    def rule(node: Node) -> Node | None:
        inner = node.inputs[0]
        if inner.op != inner_op:
            return None
        return _keep(node, inner.inputs[0])
    return rule


def _negated(node: Node, operand: Node) -> Node | None:
    """y when `operand` is neg(y) in `node`'s own dtype. (neg(y) of another dtype
    wraps in y's dtype before the promotion: -uint8(1) is 255, so int8 0 + neg(y)
    is 255 where 0 - y is -1.)"""
    if operand.op == "neg" and operand.inputs[0].dtype == node.dtype:
        return operand.inputs[0]
    return None


def _rule_add_neg(node: Node) -> Node | None:
    """add(x, neg(y)) -> sub(x, y) (either order)."""
    a, b = node.inputs
    if _negated(node, b) is not None:
        return new_node("sub", [a, _negated(node, b)], {}, node, (b,))
    if _negated(node, a) is not None:
        return new_node("sub", [b, _negated(node, a)], {}, node, (a,))
    return None


def _rule_sub_neg(node: Node) -> Node | None:
    a, b = node.inputs
    if _negated(node, b) is not None:
        return new_node("add", [a, _negated(node, b)], {}, node, (b,))
    return None


def _rule_bias_last_axis(node: Node) -> Node | None:
    """bias_add(x, b) along x's last axis -> add(x, b): numpy broadcasts a (C,) bias
    from the right, so the two compute the same (the same ufunc on the same
    operands), and the elementwise passes know an add (a (B, T, C) layer's bias
    would otherwise stop fuse_elementwise's chain)."""
    if node.shape is None or not nn_ops.bias_along_last_axis(node):
        return None
    return new_node("add", list(node.inputs), {}, node)


def _permutation(node: Node) -> tuple[int, ...]:
    axes = node.attrs.get("axes")
    rank = len(node.inputs[0].shape)
    return tuple(reversed(range(rank))) if axes is None else tuple(a % rank for a in axes)


def _rule_transpose(node: Node) -> Node | None:
    """transpose(transpose(x, p), q) -> transpose(x, p then q); identity -> x."""
    inner = node.inputs[0]
    perm = _permutation(node)
    if inner.op == "transpose":
        first = _permutation(inner)
        combined = tuple(first[a] for a in perm)
        if combined == tuple(range(len(combined))):
            return _keep(node, inner.inputs[0])
        return new_node("transpose", [inner.inputs[0]], {"axes": combined}, node, (inner,))
    if perm == tuple(range(len(perm))):
        return _keep(node, inner)
    return None


def _rule_reshape(node: Node) -> Node | None:
    """reshape of a reshape -> one reshape; a reshape to the same shape -> x."""
    x = node.inputs[0]
    if x.shape == node.shape:
        return _keep(node, x)
    if REGISTRY[x.op].reshape and _spellable(node.shape):  # (the elements keep their order)
        return new_node("reshape", [x.inputs[0]], {"shape": tuple(node.shape)}, node, (x,))
    return None


def _spellable(shape: tuple) -> bool:
    """Whether reshape's shape attr can say `shape`: a 0 there copies a dim of the
    input, so an empty dim (a batch of 0) cannot be written as a literal target."""
    return 0 not in shape


def _rule_by_shape(op: str, spellable: Callable[[tuple], bool] = lambda shape: True
                   ) -> Callable[[Node], Node | None]:
    """reshape_like(x, ref) -> reshape(x, shape): after specialization the shape of
    ref is a constant, and its value no longer has to stay alive until here (where
    `op`'s shape attribute can say that shape: `spellable`)."""
    def rule(node: Node) -> Node | None:
        if not spellable(node.shape):
            return None
        return new_node(op, [node.inputs[0]], {"shape": tuple(node.shape)}, node)
    return rule


def _rule_same_shape(node: Node) -> Node | None:
    """broadcast or sum to the shape the input already has -> the input."""
    return _keep(node, node.inputs[0])


def _rule_cast(node: Node) -> Node | None:
    return _keep(node, node.inputs[0])


def _rule_same_operands(node: Node) -> Node | None:
    """f(x, x) -> x for f in maximum, minimum; where(c, x, x) -> x."""
    a, b = node.inputs[-2:]
    return _keep(node, a) if a is b else None


def _rule_fill_like(op: str) -> Callable[[Node], Node | None]:
    """zeros_like(x) -> zeros(shape): the shape is known now, x's value is not needed."""
    def rule(node: Node) -> Node | None:
        return new_node(op, [], {"shape": tuple(node.shape), "dtype": node.dtype.name}, node)
    return rule


def _rule_count_ratio(node: Node) -> Node | None:
    """count_ratio(y, x) -> constant size(y)/size(x): only the shapes matter."""
    y, x = node.inputs
    size_x = math.prod(x.shape)
    ratio = math.prod(y.shape) / size_x if size_x else 0.0
    return new_node("constant", [], {"value": ConstValue(np.asarray(ratio, node.dtype))}, node)


def _rule_single_concat(node: Node) -> Node | None:
    return _keep(node, node.inputs[0]) if len(node.inputs) == 1 else None


def _rule_full_slice(node: Node) -> Node | None:
    """x[:, :] -> x."""
    full = all(item[0] == "slice" and item[1] in (None, 0) and item[2] is None
               and item[3] in (None, 1) for item in node.attrs["index"])
    return _keep(node, node.inputs[0]) if full else None


def _rule_mask_before_pool_grad(node: Node) -> Node | None:
    """mul(max_pool2d_grad(g, y, p), cmp(y, c)) -> max_pool2d_grad(mul(g, cmp(p, c)), y, p)
    for a scalar c and windows that do not overlap: a ReLU's gradient mask applied
    to the pooled gradient, a quarter of the elements under 2x2 pooling, instead of
    the full-size one. Exact: the full-size gradient is g at each window's first
    max, where y equals p (or both are NaN), so a comparison (OpDef.comparison)
    cmp(y, c) there is cmp(p, c); and +0 elsewhere, which times a 0-or-1 mask stays
    +0 either way. (Overlapping windows add several g into one element, and mask *
    sum is not the sum of masked terms for inf or -0.) A rule sees no consumers: if
    the full-size gradient has another (a fetch of it), both are computed."""
    grad, mask = node.inputs
    if grad.op != "max_pool2d_grad":
        grad, mask = mask, grad
    if not _masks_pooled_input(grad, mask):
        return None
    g, y, peak = grad.inputs
    small_mask = new_node(mask.op, [peak, mask.inputs[1]], {}, mask)
    operands = [g, small_mask] if node.inputs[0] is grad else [small_mask, g]
    masked = new_node("mul", operands, {}, node)
    replacement = new_node("max_pool2d_grad", [masked, y, peak], dict(grad.attrs), node,
                           (grad, mask))
    return replacement if same_type(node, replacement) else None


def _masks_pooled_input(grad: Node, mask: Node) -> bool:
    """Whether `grad` is max_pool2d_grad(g, y, p) of disjoint windows, with p the
    pool's own max of y, and `mask` is cmp(y, c) of y's own shape (c of one element,
    of no higher rank). (A fed p that no tap equals sends g to a window's last tap,
    where y and p may compare otherwise.)"""
    if grad.op != "max_pool2d_grad" or len(grad.inputs) != 3 \
            or not REGISTRY[mask.op].comparison:
        return False
    _, y, peak = grad.inputs
    value, c = mask.inputs
    own_max = peak.op == "max_pool2d" and peak.inputs[0] is y and peak.attrs == grad.attrs
    scalar = c.shape is not None and math.prod(c.shape) == 1 and mask.shape == y.shape
    disjoint = image_ops.windows_disjoint(grad.attrs["ksize"], grad.attrs["stride"])
    return value is y and own_max and scalar and disjoint


@dataclass(frozen=True)
class Rule:
    """One simplification: `pattern` (also the record's reason), the op it starts at,
    and `rewrite(node) -> replacement or None`. A rule only returns a replacement of
    the node's shape and dtype."""

    pattern: str
    op: str
    rewrite: Callable[[Node], Node | None]


# The rule table. Every rule gives bitwise the value of the graph it replaces, for
# every input: +-0, +-inf, NaN, subnormals (which is why x * 0 -> 0, x - x -> 0,
# log(exp(x)) -> x (inf at x = 200, 1 ulp off for many float32 values), exp(log(x))
# -> x and float x + 0 -> x (-0.0 + 0.0 is +0.0) are not here). Where a rule holds
# only for some dtypes, its pattern says so. tests/test_rules_exact.py checks every
# row on such values; a new row needs a case there.
RULES: list[Rule] = [
    Rule("add(x, -0.0) -> x", "add", _rule_add_zero(integer=False)),
    Rule("add(x, 0) -> x, x integer", "add", _rule_add_zero(integer=True)),
    Rule("sub(x, +0.0) -> x; sub(x, 0) -> x, x integer", "sub", _rule_sub_zero),
    Rule("mul(x, 1) -> x", "mul", _rule_identity(1.0)),
    Rule("div(x, 1) -> x", "div", _rule_identity(1.0)),
    Rule("pow(x, 1) -> x", "pow", _rule_pow(1.0, None)),
    Rule("pow(x, 2) -> mul(x, x)", "pow", _rule_pow(2.0, "mul")),
    Rule("pow(x, 0.5) -> sqrt(x)", "pow", _rule_pow(0.5, "sqrt")),
    Rule("sub(0, x) -> neg(x), x integer", "sub", _rule_zero_minus),
    Rule("mul(x, -1) -> neg(x)", "mul", _rule_times_minus_one),
    Rule("add(x, neg(y)) -> sub(x, y)", "add", _rule_add_neg),
    Rule("sub(x, neg(y)) -> add(x, y)", "sub", _rule_sub_neg),
    Rule("neg(neg(x)) -> x", "neg", _rule_inverse("neg")),
    Rule("bias_add(x, b) along x's last axis -> add(x, b)", "bias_add", _rule_bias_last_axis),
    # (gradients are built before the passes run: after that it is a copy)
    Rule("stop_gradient(x) -> x", "stop_gradient", lambda node: _keep(node, node.inputs[0])),
    Rule("maximum(x, x) -> x", "maximum", _rule_same_operands),
    Rule("minimum(x, x) -> x", "minimum", _rule_same_operands),
    Rule("where(c, x, x) -> x", "where", _rule_same_operands),
    Rule("cast(x) to x's dtype -> x", "cast", _rule_cast),
    Rule("transpose(transpose(x)) -> one transpose, or x", "transpose", _rule_transpose),
    *[Rule(f"{op} of a reshape -> one reshape; to x's own shape -> x", op, _rule_reshape)
      for op, opdef in REGISTRY.items() if opdef.reshape],
    *[Rule(f"{op}(x) to x's own shape -> x", op, _rule_same_shape)
      for op in ("broadcast_to", "broadcast_like", "sum_to_like")],
    Rule("reshape_like(x, ref) -> reshape(x, shape of ref)", "reshape_like",
         _rule_by_shape("reshape", _spellable)),
    Rule("broadcast_like(x, ref) -> broadcast_to(x, shape of ref)", "broadcast_like",
         _rule_by_shape("broadcast_to")),
    Rule("x[:, ...] (every slice full) -> x", "getitem", _rule_full_slice),
    Rule("concat([x]) -> x", "concat", _rule_single_concat),
    Rule("zeros_like(x) -> zeros(shape of x)", "zeros_like", _rule_fill_like("zeros")),
    Rule("ones_like(x) -> ones(shape of x)", "ones_like", _rule_fill_like("ones")),
    Rule("count_ratio(y, x) -> constant size(y) / size(x)", "count_ratio", _rule_count_ratio),
    Rule("mul(max_pool2d_grad(g, y, p), cmp(y, c)) -> "
         "max_pool2d_grad(mul(g, cmp(p, c)), y, p), disjoint windows", "mul",
         _rule_mask_before_pool_grad),
]
RULES_BY_OP: dict[str, list[Rule]] = {}  # the table indexed by op, as simplify reads it
for _rule in RULES:
    RULES_BY_OP.setdefault(_rule.op, []).append(_rule)


def add_rule(rule: Rule) -> None:
    """Add `rule` to the table (and its index): simplify applies it from now on."""
    RULES.append(rule)
    RULES_BY_OP.setdefault(rule.op, []).append(rule)
