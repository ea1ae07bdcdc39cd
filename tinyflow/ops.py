"""The op registry: for each op, its compute, gradient, shape/dtype rule and flags.

The registry is data (NNVM's lesson): a dict from op name to an `OpDef`. Every layer
above asks the registry, never a chain of `if op == ...`:

* the executor calls ``compute(xp, *arrays, out=None, **attrs)``; `xp` is numpy or
  cupy. The kernel contract, stated once: a kernel writes into `out` when it can
  (a ufunc's own ``out=``, a fill) and returns it; otherwise it returns its result,
  and the caller (executor, eager, a fused kernel) copies that into `out` when the
  result is not `out`. So a kernel never needs an ``if out is None`` epilogue;
* autodiff calls ``gradient(node, grad) -> [grad of each input, as a Node, or None]``;
  gradients are built from ordinary ops, so the gradient graph can be differentiated
  again (grad-of-grad);
* shape inference calls ``infer(shapes, dtypes, attrs) -> (shape, dtype)``. Shapes may
  hold ``None`` dims (a batch size not fed yet): rules treat them as "any";
* passes read the flags: `elementwise`, `inplace` (which input may share the output's
  memory), `pure` (same inputs give the same result: safe to merge and fold),
  `commutative`; the executor reads `random` (the kernel draws from the Session's
  random streams); `make` runs `check(attrs, dtypes)` (attributes or dtypes no
  input shape could make valid) even before shapes are known.

The user-facing builders (``add``, ``matmul``, ...) live here too, since a builder is
just "check shapes with the rule, make the Node". Neural-network ops (bias_add,
softmax, losses, normalisation, dropout) are in `nn_ops.py`, convolution and pooling
in `image_ops.py`, shape ops in `shape_ops.py`; all register into the same registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tinyflow import backend
from tinyflow.errors import ArgumentError
from tinyflow.graph import OPERATOR_BUILDERS, Node, ShapeError, format_shape, user_source_line
from tinyflow.registry import REGISTRY, OpDef, register, source_kind

# ----------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------


class Mismatch(Exception):
    """Raised by an infer rule; `make` turns it into a ShapeError with context.

    Part of the op-author API (with `OpDef`, `register`, `make`, `infer_same`,
    `result_dtype`): an op module outside this file raises it for inputs its rule
    cannot accept."""


def _fmt_attrs(attrs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in attrs.items()) or "none"


def check_dims(shape: Sequence | None) -> None:
    """Raise Mismatch for a negative dimension (None dims are unknown, fine)."""
    if shape is not None and any(d is not None and d < 0 for d in shape):
        raise Mismatch(f"negative dimension in shape {format_shape(tuple(shape))}")


def require_shape(shape: Sequence, expected: Sequence, what: str, source: str) -> None:
    """Raise Mismatch unless `shape` can be `expected`: the same rank, and the same
    size wherever both dims are known (None is unknown and agrees with any size).
    For gradient helpers, whose g must be what the forward op (`source`) gives."""
    if tuple(shape) == tuple(expected):   # (the usual case, and the cheap test)
        return
    if len(shape) != len(expected) or any(
            a is not None and b is not None and a != b for a, b in zip(shape, expected)):
        raise Mismatch(f"{what} must have the shape of {source}, "
                       f"{format_shape(tuple(expected))}; got {format_shape(tuple(shape))}")


def require_broadcastable(small: Sequence, big: Sequence, what: str) -> None:
    """Raise Mismatch unless `small` broadcasts to `big` by numpy's rules: no more
    dims, and each known dim 1 or the size of `big`'s (None agrees with any size)."""
    if tuple(small) == tuple(big):   # (the usual case: gradient graphs hold thousands)
        return
    fits = len(small) <= len(big) and all(
        s is None or b is None or s in (1, b) for s, b in zip(small[::-1], big[::-1]))
    if not fits:
        raise Mismatch(f"{what} {format_shape(tuple(small))} does not broadcast to "
                       f"{format_shape(tuple(big))}")


def shape_error(op: str, shapes: Sequence, why: str, where: str) -> ShapeError:
    """The one format of a shape error: op, every input shape, reason, user's line."""
    shown = ", ".join(format_shape(s) for s in shapes)
    return ShapeError(f"{op}: incompatible shapes {shown}: {why} (at {where})")


def infer_node(op: str, inputs: Sequence[Node], attrs: dict, where: str,
               shapes: Sequence | None = None, dtypes: Sequence | None = None) -> tuple:
    """Run `op`'s rule on the inputs' shapes; raise a ShapeError naming everything.

    Returns (shape, dtype). When any input's rank is unknown, the shape is unknown
    (None) and no check is possible yet: it happens when a feed fixes the shapes.
    """
    opdef = REGISTRY[op]
    shapes = [i.shape for i in inputs] if shapes is None else list(shapes)
    dtypes = [i.dtype for i in inputs] if dtypes is None else list(dtypes)
    if opdef.check is not None:
        try:
            opdef.check(attrs, dtypes)
        except Mismatch as why:
            raise ShapeError(f"{op}: {why}; attributes {_fmt_attrs(attrs)} "
                             f"(at {where})") from None
    if any(s is None for s in shapes):
        try:
            _, dtype = opdef.infer([s if s is not None else () for s in shapes],
                                   dtypes, attrs)
        except Exception:
            dtype = next((d for d in dtypes if d is not None), None)
        return None, dtype
    try:
        return opdef.infer(shapes, dtypes, attrs)
    except Mismatch as why:
        raise shape_error(op, shapes, str(why), where) from None


# Eager mode (eager.py) registers here how to run an op at once on its Tensors:
# (apply function, its one-input shortcut, Tensor class, apply_over for make_over).
# ops.py sits below eager.py, so it is told, not told of.
_eager_dispatch: tuple[Callable[..., Any], Callable[..., Any], type,
                        Callable[..., Any]] | None = None


def set_eager_dispatch(apply: Callable[..., Any], apply_unary: Callable[..., Any],
                       tensor_type: type, apply_over: Callable[..., Any]) -> None:
    """Route `make` calls that have an eager Tensor among their inputs to `apply`,
    or, for one input and no attributes (`tanh(x)`), to `apply_unary(op, x)`; and
    `make_over` calls to `apply_over(op, inputs, 0)`."""
    global _eager_dispatch
    _eager_dispatch = (apply, apply_unary, tensor_type, apply_over)


# What a builder takes as an input: a Node, or a Python number or list or a numpy
# array (`make` turns those into constants); in eager mode, a Tensor. Builders return
# a Node (in eager mode, a Tensor).
Operand = Any
Shape = int | Sequence[int]
Axis = int | Sequence[int] | None
DType = Any  # anything np.dtype() takes: np.float32, "float32", float


def make(op: str, *inputs: Any, name: str | None = None, **attrs: Any) -> Any:
    """Build a Node for `op`, checking shapes now wherever they are already known.

    Python numbers and lists, and numpy arrays, among `inputs` become constant nodes
    (see `literal_dtype`: `x * 2` stays float32, `int32 + 1.5` is a float). When an
    input is an eager Tensor (eager.py), the op runs at once instead and a Tensor
    comes back: every builder in TinyFlow works in both modes.
    """
    if _eager_dispatch is not None:
        apply, apply_unary, tensor_type, _ = _eager_dispatch
        for i in inputs:  # a loop, not any(...): a generator costs more than the test
            if isinstance(i, tensor_type):
                if len(inputs) == 1 and not attrs and name is None:
                    return apply_unary(op, i)
                return apply(op, inputs, attrs, name)
    where = user_source_line()
    like = literal_like(i.dtype for i in inputs if isinstance(i, Node))
    nodes = [i if isinstance(i, Node) else _literal(op, i, like, where) for i in inputs]
    node = Node(op, nodes, attrs, name=name, where=where)
    node.shape, node.dtype = infer_node(op, nodes, node.attrs, node.where)
    return node


def make_unary(op: str, x: Any) -> Any:
    """`make(op, x)` for a one-input op without attributes (`tanh(x)`): an eager
    Tensor goes straight to `apply_unary`, without make's packing of its arguments
    and its loop over them, which cost a tiny eager op about 15% of its time
    (`tanh(y)` on one element: 1.35 -> 1.15 us; benchmarks/eager_bench.py)."""
    if _eager_dispatch is not None and isinstance(x, _eager_dispatch[2]):
        return _eager_dispatch[1](op, x)
    return make(op, x)


def make_over(op: str, dying: Any, *others: Any) -> Any:
    """`make(op, dying, *others)`, for a caller that made `dying` itself and drops it
    after this call: nn.Linear's product, before its bias is added; a Linear's
    output in nn.Sequential (nn.MLP), before the activation after it.

    In eager mode the result may then be written over `dying` (eager.apply_over):
    an eager op cannot know by itself that nothing else holds its operand. That is
    the caller's promise, and nothing checks it but for numpy views: a `dying`
    Tensor that someone still holds silently takes the result's value. A graph
    needs no such hint (its planner sees every reader, memory.py), so in graph mode
    this is `make`, and the graph is the same."""
    if _eager_dispatch is not None and isinstance(dying, _eager_dispatch[2]):
        return _eager_dispatch[3](op, (dying, *others), 0)
    return make(op, dying, *others)


def literal_like(dtypes: Any) -> np.dtype | None:
    """The dtype that literals among an op's inputs are typed beside: numpy's
    promotion of the tensor inputs' known dtypes (None when there are none).

    Not the first tensor's dtype: in ``where(x > 0, x, 0)`` that is the condition's
    bool, beside which 0 became int32, and int32 promoted the float32 x to float64
    (numpy keeps float32). Eager mode (eager.py) asks the same."""
    like = None
    for dtype in dtypes:
        if like is None:      # (not `dtype != like`: numpy reads None as float64)
            like = dtype
        elif dtype is not None and dtype != like:
            like = np.promote_types(like, dtype)
    return like


def literal_dtype(value: Any, like: Any) -> np.dtype:
    """The dtype a literal operand takes beside a tensor of dtype `like`.

    Literals are weakly typed (numpy's NEP 50, and TF1's conversion of Python
    numbers to the other operand's dtype): a literal of the same kind as `like`, or
    of a lower one (bool < int < float), takes `like` (`x * 2` stays float32,
    `int8 + 1` stays int8); a literal of a higher kind keeps its own kind, in
    TF1's default dtype for Python numbers (float32, int32) or, for a numpy array,
    its own dtype, and the op's numpy rule promotes (`int32 + [1.5, 2.5]` is a
    float, `bool + 1` an int).
    """
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{value!r} is not a number, a list of numbers or an array")
    kinds = "biuf"
    if like is not None and (like.kind not in kinds or kinds.index(array.dtype.kind)
                             <= kinds.index("i" if like.kind == "u" else like.kind)):
        return np.dtype(like)
    if isinstance(value, (np.ndarray, np.generic)):
        return array.dtype
    return python_dtype(array)


def python_dtype(array: np.ndarray) -> np.dtype:
    """TF1's dtype for Python numbers: float32 for floats, int32 for ints (int64 when
    a value does not fit), bool for bools."""
    if array.dtype.kind == "f":
        return np.dtype(np.float32)
    if array.dtype.kind in "iu":
        info = np.iinfo(np.int32)
        fits = array.size == 0 or (info.min <= array.min() and array.max() <= info.max)
        return np.dtype(np.int32 if fits else np.int64)
    return array.dtype


def _literal(op: str, value: Any, like: Any, where: str) -> Node:
    """A literal operand of `op` as a constant node; a named error if it cannot be one."""
    try:
        if value.__class__ is int and like is not None and like.kind == "f" \
                and not -2**63 <= value < 2**63:
            value = float(value)   # 10**30 beside float32: a float (numpy: an object)
        dtype = literal_dtype(value, like)
        array = np.asarray(value)
        if dtype.kind in "iu" and array.dtype.kind in "iu" and array.size:
            info = np.iinfo(dtype)
            if array.min() < info.min or array.max() > info.max:
                raise TypeError(f"{array.max() if array.max() > info.max else array.min()}"
                                f" is out of range for {dtype}")
        with np.errstate(over="ignore"):
            converted = array.astype(dtype)
        if dtype.kind == "f" and array.dtype.kind in "iuf" and \
                np.any(np.isfinite(array) & ~np.isfinite(converted)):
            # (as a feed of 1e300 into float32 is refused: inf is not the number meant)
            raise TypeError(f"{value!r} is too large for {dtype} (it would be inf)")
        array = converted
    except (TypeError, ValueError, OverflowError) as err:
        raise ShapeError(f"{op}: operand {value!r} cannot be a tensor beside "
                         f"{like or 'the other inputs'}: {err} (at {where})") from None
    return make("constant", value=ConstValue(array))


# ----------------------------------------------------------------------------------
# Shape rules shared by many ops
# ----------------------------------------------------------------------------------

def broadcast_shapes(*shapes: tuple) -> tuple:
    """numpy broadcasting where a dim may be None (unknown): the result is None only
    when it cannot be decided yet."""
    ndim = max(len(s) for s in shapes)
    result = []
    for axis in range(ndim):
        dims = [s[axis - ndim + len(s)] for s in shapes if axis - ndim + len(s) >= 0]
        known = {d for d in dims if d is not None and d != 1}
        if len(known) > 1:
            sizes = " vs ".join(map(str, sorted(known)))
            raise Mismatch(f"dimension {axis} cannot broadcast ({sizes})")
        if known:
            result.append(known.pop())
        elif any(d is None for d in dims):
            result.append(None)
        else:
            result.append(1)
    return tuple(result)


def result_dtype(dtypes: Sequence) -> Any:
    """numpy's promotion of the known input dtypes (None when none is known yet)."""
    known = [d for d in dtypes if d is not None]
    return np.result_type(*known) if known else None


def ufunc_dtype(ufunc_name: str, dtypes: Sequence) -> Any:
    """The dtype numpy's ufunc `ufunc_name` produces for inputs of `dtypes`.

    Rules infer with numpy's own casting rules so that they name the dtype the
    kernel really produces: exp of int32 is float64, true division of ints is
    float64. Raises `Mismatch` where numpy has no kernel (minus of booleans).
    """
    if any(d is None for d in dtypes):
        return result_dtype(dtypes)
    try:
        resolved = getattr(np, ufunc_name).resolve_dtypes(tuple(dtypes) + (None,))
    except TypeError as err:
        raise Mismatch(str(err)) from None
    return np.dtype(resolved[-1])


def float_dtype(dtype: Any) -> Any:
    """`dtype` itself if it is a float; else the float numpy computes exp() in."""
    if dtype is None or np.dtype(dtype).kind in "fc":
        return dtype
    return ufunc_dtype("exp", [np.dtype(dtype)])


def _infer_compare(shapes, dtypes, attrs):
    return broadcast_shapes(*shapes), np.dtype(bool)


def infer_same(shapes, dtypes, attrs):
    """The shape rule of an op whose output is shaped and typed like its first input."""
    return tuple(shapes[0]), dtypes[0]


def normalize_axes(axes: Any, ndim: int) -> tuple[int, ...]:
    """axes given as None (all), int or sequence -> sorted tuple of non-negative ints."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = (axes,)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise Mismatch(f"axis {a} is out of range for rank {ndim}")
        if a % ndim in out:
            raise Mismatch(f"axis {a} is given twice (axes {tuple(axes)} for rank {ndim})")
        out.append(a % ndim)
    return tuple(sorted(out))


# ----------------------------------------------------------------------------------
# Sources: placeholders, variables, constants, initializers
# ----------------------------------------------------------------------------------

class ConstValue:
    """A constant's array, hashable by content so constant nodes can be CSE'd."""

    __slots__ = ("array", "_key")

    def __init__(self, array: np.ndarray) -> None:
        # A private copy, C-ordered: the executor makes every computed array
        # C-contiguous, and a folded transpose kept in Fortran order made sums and
        # products over it run in another order (other last bits) than unfolded.
        self.array = np.array(array, order="C")
        self.array.flags.writeable = False    # ... nobody may change behind our back
        self._key = (self.array.shape, self.array.dtype.str, self.array.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstValue) and self._key == other._key

    def __repr__(self) -> str:
        if self.array.size <= 4:
            return repr(self.array.tolist())
        return f"array{format_shape(self.array.shape)}"


def _source_infer(shapes, dtypes, attrs):
    check_dims(attrs.get("shape"))
    return attrs.get("shape"), np.dtype(attrs["dtype"])


def _no_compute(xp, *arrays, out=None, **attrs):
    raise RuntimeError("placeholders and variables get their values from the executor")


for _name, _kind, _doc in [
        ("placeholder", "feed", "A value fed at run time (feed_dict)."),
        ("variable", "variable", "State that lives across runs (in the Session).")]:
    register(OpDef(_name, _no_compute, _source_infer, None, pure=False,
                   differentiable=False, source=_kind, doc=_doc))


def _constant_compute(xp, out=None, value=None):
    # On a GPU, one device copy per constant, made on first use (not every run).
    return value.array if xp is np else backend.device_copy(xp, value, value.array)


register(OpDef("constant", _constant_compute,
               lambda s, d, a: (a["value"].array.shape, a["value"].array.dtype),
               None, differentiable=False, source="constant",
               doc="A fixed array baked into the graph."))


def number_array(op: str, value: Any, dtype: Any = None) -> np.ndarray:
    """`value` as an array of numbers (of `dtype`, when given), or an ArgumentError
    naming `op`: a ragged list (numpy's "inhomogeneous shape"), strings, objects,
    None. (An object array in an eager Tensor's recycled memory crashed Python.)"""
    if getattr(value, "__tinyflow_tensor__", False):
        # An eager Tensor's values, read as .numpy() reads them: numpy's own route
        # (__array__) refuses a Tensor that requires grad, whose history a copy drops
        # (a constant has none to keep, as torch.tensor(t) copies t's values).
        value = value.numpy()
    try:
        array = np.asarray(value, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as err:
        raise argument_error(op, f"value is not an array of numbers: {err}") from None
    if array.dtype.kind not in "biufc":   # strings, objects (a variable of them, too)
        raise argument_error(op, f"needs numbers or an array of numbers, got {value!r} "
                                 f"(dtype {array.dtype})")
    return array


def constant(value: Any, dtype: Any = None, name: str | None = None) -> Node:
    """A constant node, as TF1's tf.constant: of `dtype` when given; else a numpy
    array keeps its dtype (float64 stays float64), and Python numbers and lists
    take TF1's defaults (floats float32, ints int32)."""
    if isinstance(value, Node):
        return value
    array = number_array("constant", value)
    if dtype is not None:
        dtype = dtype_attr("constant", dtype)
        converted = array.astype(dtype)
        # A value the dtype cannot hold is refused (TF1 too), not truncated or
        # wrapped: astype made tf.constant(1.5, tf.int32) a 1, and 300 an int8 44.
        if dtype.kind in "biu" and not np.array_equal(converted, array):
            raise argument_error("constant", f"value {value!r} cannot be held exactly "
                                             f"in {dtype}")
        array = converted
    elif not isinstance(value, (np.ndarray, np.generic)):
        array = array.astype(python_dtype(array))
    return make("constant", value=ConstValue(array), name=name)


def _fill_compute(fill):
    def compute(xp, out=None, shape=(), dtype="float32"):
        if out is None:
            return xp.full(shape, fill, dtype=dtype)
        out.fill(fill)
        return out
    return compute


for _name, _fill in [("zeros", 0.0), ("ones", 1.0)]:
    register(OpDef(_name, _fill_compute(_fill), _source_infer, None, differentiable=False,
                   doc=f"An array of {_fill:g}s of a fixed shape."))

# Random sources draw from one generator per seed, kept here, so a seeded program
# gives the same sequence of values in every fresh process.
_generators: dict[int, np.random.Generator] = {}


def generator(seed: int | tuple, generators: dict | None = None) -> np.random.Generator:
    """The random stream of one op, whose seed attribute is `seed` (graph seed, op
    seed, k), in `generators` (a Session's own dict, so each Session replays the same
    values, as TF1 sessions do; the module's otherwise). The first op of an op seed
    under graph seed 0 draws what numpy's default_rng(op seed) draws."""
    generators = _generators if generators is None else generators
    if seed not in generators:
        graph_seed, op_seed, k = seed if isinstance(seed, tuple) else (0, seed, 0)
        entropy = op_seed if graph_seed == 0 and k == 0 else [graph_seed, op_seed, k]
        generators[seed] = np.random.default_rng(entropy)
    return generators[seed]


def _random_compute(kind):
    def compute(xp, out=None, shape=(), dtype="float32", a=0.0, b=1.0, seed=0,
                generators=None):
        rng = generator(seed, generators)
        draw = backend.draw_random(xp, rng, kind, shape, dtype, a, b)
        return draw
    return compute


for _name, _kind in (("random_normal", "normal"), ("random_uniform", "uniform"),
                     ("truncated_normal", "truncated")):
    register(OpDef(_name, _random_compute(_kind), _source_infer, None,
                   pure=False, differentiable=False, random=True,
                   doc="Random values (normal: mean a, std b; uniform: [a, b); "
                       "truncated: normal, redrawn beyond 2 std)."))


# State: tf.assign writes a variable; tf.group runs several ops for their effects.
# The executor treats "assign" specially (it writes the Session's copy of the
# variable); graph.topological_order runs every other reader of the variable first.

def _assign_compute(xp, var, value, out=None):
    var[...] = value
    return var


def _assign_infer(shapes, dtypes, attrs):
    # TF1's validate_shape: the value has the variable's shape (a None dimension on
    # either side matches anything). A value of another rank used to be written
    # as is, silently changing the variable's shape (and every later result).
    var, value = shapes
    if len(var) != len(value) or any(
            a is not None and b is not None and a != b for a, b in zip(var, value)):
        raise Mismatch(f"the value's shape {format_shape(value)} differs from the "
                       f"variable's {format_shape(var)}")
    shape = tuple(a if a is not None else b for a, b in zip(var, value))
    return shape, dtypes[0] if dtypes[0] is not None else dtypes[1]


def _group_compute(xp, *arrays, out=None):
    return xp.zeros((), dtype=np.float32)


register(OpDef("assign", _assign_compute, _assign_infer, None, pure=False,
               differentiable=False, mutates=0, doc="write input 1 into variable input 0"))
register(OpDef("group", _group_compute, lambda s, d, a: ((), np.dtype(np.float32)), None,
               pure=False, differentiable=False, effect_only=True,
               doc="run every input for its effect (tf.group); the value is 0"))


# ----------------------------------------------------------------------------------
# Gradient helpers: reduce a broadcast gradient back to its input's shape
# ----------------------------------------------------------------------------------

def _sum_to_like_compute(xp, g, ref, out=None):
    """Sum `g` down to `ref.shape` (undo numpy broadcasting)."""
    if g.shape == ref.shape:
        return g
    lead = g.ndim - ref.ndim
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(ref.shape) if d == 1 and g.shape[lead + i] != 1)
    summed = g.sum(axis=axes, keepdims=True, dtype=g.dtype)  # g's dtype, as the rule says
    summed = summed.reshape(ref.shape)
    return summed


def _broadcast_like_compute(xp, x, ref, out=None):
    return xp.broadcast_to(x, ref.shape)


def _sum_to_like_infer(shapes, dtypes, attrs):
    """Shape of input 1 (ref), dtype of input 0 (g): ref must broadcast to g, as
    the input that broadcast to g's shape in the forward op did."""
    g, ref = shapes
    require_broadcastable(ref, g, "ref")
    return tuple(ref), dtypes[0]


def _broadcast_like_infer(shapes, dtypes, attrs):
    """Shape of input 1 (ref), dtype of input 0 (x), which must broadcast to ref."""
    x, ref = shapes
    require_broadcastable(x, ref, "x")
    return tuple(ref), dtypes[0]


register(OpDef("sum_to_like", _sum_to_like_compute, _sum_to_like_infer,
               lambda node, g: [broadcast_like(g, node.inputs[0]), None],
               doc="Sum input 0 down to the shape of input 1 (gradient of broadcasting).",
               shape_inputs=(1,)))
register(OpDef("broadcast_like", _broadcast_like_compute, _broadcast_like_infer,
               lambda node, g: [sum_to_like(g, node.inputs[0]), None],
               doc="Broadcast input 0 to the shape of input 1.", shape_inputs=(1,)))


def sum_to_like(g: Node, ref: Node) -> Node:
    return make("sum_to_like", g, ref)


def broadcast_like(x: Node, ref: Node) -> Node:
    return make("broadcast_like", x, ref)


def unbroadcast(grad: Node, x: Node) -> Node:
    """`grad` reduced to x's shape. Skipped when both shapes are known and equal."""
    if grad.shape is not None and grad.shape == x.shape and None not in x.shape:
        return grad
    return sum_to_like(grad, x)


# ----------------------------------------------------------------------------------
# Elementwise ops. Each: compute, gradient (as Nodes), registered with flags.
# ----------------------------------------------------------------------------------

def _binary(name, ufunc_name, grad, commutative=False, doc=""):
    def compute(xp, a, b, out=None):
        return getattr(xp, ufunc_name)(a, b, out=out)

    def infer(shapes, dtypes, attrs):
        return broadcast_shapes(*shapes), ufunc_dtype(ufunc_name, dtypes)
    register(OpDef(name, compute, infer, grad, elementwise=True, inplace=0,
                   commutative=commutative, doc=doc, ufunc=ufunc_name))


def _unary(name: str, compute: Callable | str, grad: Callable | None, doc: str = "",
           inplace: int | None = 0, dtype_like: str | None = None,
           dense_activation: bool = False) -> None:
    """An elementwise op of one input; `compute` is a function, or the name of the
    ufunc that is the whole computation. Its dtype follows numpy's ufunc `dtype_like`
    (exp: integers give floats), or stays the input's when that is None.
    `dense_activation`: fuse_dense may fold it into a dense layer."""
    def infer(shapes, dtypes, attrs):
        dtype = dtypes[0] if dtype_like is None else ufunc_dtype(dtype_like, dtypes)
        return tuple(shapes[0]), dtype
    ufunc = compute if isinstance(compute, str) else None
    register(OpDef(name, _ufunc_compute(ufunc) if ufunc else compute, infer, grad,
                   elementwise=True, inplace=inplace, doc=doc,
                   dense_activation=dense_activation, ufunc=ufunc))


# Gradients read the forward node's inputs (a, b) and, where it is cheaper, the
# node's own output (exp, tanh, sigmoid reuse y instead of recomputing).
_binary("add", "add", lambda n, g: [unbroadcast(g, n.inputs[0]), unbroadcast(g, n.inputs[1])],
        commutative=True, doc="a + b")
_binary("sub", "subtract",
        lambda n, g: [unbroadcast(g, n.inputs[0]), unbroadcast(neg(g), n.inputs[1])],
        doc="a - b")
_binary("mul", "multiply",
        lambda n, g: [unbroadcast(g * n.inputs[1], n.inputs[0]),
                      unbroadcast(g * n.inputs[0], n.inputs[1])],
        commutative=True, doc="a * b")
_binary("div", "divide",
        lambda n, g: [unbroadcast(g / n.inputs[1], n.inputs[0]),
                      unbroadcast(neg(g) * n / n.inputs[1], n.inputs[1])],
        doc="a / b")
# maximum and minimum are not commutative: numpy's maximum(+0, -0) is -0 and
# maximum(-0, +0) is +0 (it returns its second input on ties), and the gradient of a
# tie goes to a. So CSE must not merge max(a, b) with max(b, a).
_binary("maximum", "maximum",
        lambda n, g: [unbroadcast(g * cast(n.inputs[0] >= n.inputs[1], g.dtype), n.inputs[0]),
                      unbroadcast(g * cast(n.inputs[0] < n.inputs[1], g.dtype), n.inputs[1])],
        doc="elementwise max (ties send the gradient to a)")
_binary("minimum", "minimum",
        lambda n, g: [unbroadcast(g * cast(n.inputs[0] <= n.inputs[1], g.dtype), n.inputs[0]),
                      unbroadcast(g * cast(n.inputs[0] > n.inputs[1], g.dtype), n.inputs[1])],
        doc="elementwise min (ties send the gradient to a)")


def _pow_grad(n, g):
    x, p = n.inputs
    exponent = p
    if not _nonzero_constant(p):
        # d/dx x^0 is 0, but p * x^(p-1) is 0 * inf = NaN at x = 0, which would
        # poison a polynomial's x^0 term (PyTorch gives 0). Where p is 0 the power
        # is taken with exponent 1 instead: p * x^0 = 0, and no inf on the way. A
        # constant exponent with no zero (x ** 2, the usual case) needs neither.
        exponent = make("where", equal(p, 0.0), ones_like(p), p)
    grad_x = unbroadcast(g * p * power(x, exponent - 1.0), x)
    # (Built for a constant p too, where tf.gradients may ask for it; when nothing
    # asks, autodiff never reaches it, and eager mode evaluates only what is needed.)
    # d/dp x^p = x^p log x. At x = 0, x^p is 0 (p > 0) and the limit of the product
    # is 0; log(0) = -inf would make it NaN, so log is taken of 1 there (PyTorch
    # gives the same 0).
    safe_log = log(make("where", equal(x, 0.0), ones_like(x), x))
    return [grad_x, unbroadcast(g * n * safe_log, p)]


def _nonzero_constant(node: Node) -> bool:
    """Whether `node` is a constant with no zero in it (known when the graph is built)."""
    value = node.attrs.get("value") if source_kind(node) == "constant" else None
    return isinstance(value, ConstValue) and bool(np.all(value.array != 0))


_binary("pow", "power", _pow_grad, doc="a ** b")


def _compare(name, ufunc_name):
    def compute(xp, a, b, out=None):
        return getattr(xp, ufunc_name)(a, b, out=out)
    register(OpDef(name, compute, _infer_compare, None, elementwise=True,
                   differentiable=False, comparison=True,
                   commutative=name in ("equal", "not_equal"),
                   doc=f"{ufunc_name}(a, b) as booleans", ufunc=ufunc_name))


for _name, _ufunc in [("less", "less"), ("less_equal", "less_equal"), ("greater", "greater"),
                      ("greater_equal", "greater_equal"), ("equal", "equal"),
                      ("not_equal", "not_equal")]:
    _compare(_name, _ufunc)


def _ufunc_compute(ufunc_name):
    def compute(xp, x, out=None):
        return getattr(xp, ufunc_name)(x, out=out)
    return compute


def _relu_compute(xp, x, out=None):
    # A zero of x's own dtype: a Python 0 would make booleans int64 under numpy 2.
    return xp.maximum(x, x.dtype.type(0), out=out)


def _sigmoid_compute(xp, x, out=None):
    # 1 / (1 + exp(-x)), written to stay finite for large |x|: exp(-|x|) <= 1.
    # Integers and booleans become floats first (-x wraps around in uint8).
    x = x.astype(float_dtype(x.dtype), copy=False)
    e = xp.exp(-xp.abs(x))
    pos = 1.0 / (1.0 + e)
    result = xp.where(x >= 0, pos, e * pos)
    return result.astype(x.dtype, copy=False)


# GELU, tanh form (Hendrycks & Gimpel 2016; GPT-2): numpy has no erf, and the tanh
# form is what most small transformers use. sqrt(2/pi) and 0.044715 are its constants.
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def _gelu_compute(xp, x, out=None):
    x = x.astype(float_dtype(x.dtype), copy=False)
    inner = _GELU_C * (x + _GELU_A * x * x * x)
    result = 0.5 * x * (1.0 + xp.tanh(inner))
    return result.astype(x.dtype, copy=False)


def _gelu_grad(n, g):
    x = n.inputs[0]
    t = tanh(_GELU_C * (x + _GELU_A * x * x * x))
    dinner = _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
    return [g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)]


_unary("neg", "negative", lambda n, g: [neg(g)], "-x", dtype_like="negative")
_unary("exp", "exp", lambda n, g: [g * n], "e ** x", dtype_like="exp")
_unary("log", "log", lambda n, g: [g / n.inputs[0]], "natural log",
       dtype_like="log")
_unary("sqrt", "sqrt", lambda n, g: [g / (2.0 * n)], "square root",
       dtype_like="sqrt")
_unary("tanh", "tanh", lambda n, g: [g * (1.0 - n * n)], "tanh",
       dtype_like="tanh", dense_activation=True)
_unary("sigmoid", _sigmoid_compute, lambda n, g: [g * n * (1.0 - n)], "1 / (1 + e^-x)",
       dtype_like="exp", dense_activation=True)
# relu's gradient reads its output: y > 0 exactly where x > 0 (for -0, NaN and ints
# too), and y is what the next layer keeps anyway, so x may die at the relu (the
# static plan then writes y over x, and eager mode may too: see nn.Sequential), as
# PyTorch's threshold_backward reads the result.
_unary("relu", _relu_compute,
       lambda n, g: [g * (n > 0.0)], "max(x, 0)",
       dense_activation=True)
_unary("gelu", _gelu_compute, _gelu_grad, "x * Phi(x), tanh approximation", dtype_like="exp",
       dense_activation=True)
_unary("abs", "absolute", lambda n, g: [g * sign(n.inputs[0])], "|x|")


def zero_gradient(node: Node, grad: Node) -> list[None]:
    """The gradient of an op whose value stays put when its inputs' values move a
    little (only their shapes or signs matter): None, i.e. zero, for every input.

    Such an op still needs this gradient rather than none at all: gradients of
    gradients pass through it (``ones_like`` seeds every backward pass).
    """
    return [None] * len(node.inputs)


# numpy's rule, not infer_same: numpy has no sign of booleans, which must be refused
# when built (as `-x` of booleans is), not fail inside the kernel at run time.
register(OpDef("sign", _ufunc_compute("sign"),
               lambda s, d, a: (tuple(s[0]), ufunc_dtype("sign", d)), zero_gradient,
               elementwise=True,
               inplace=0, doc="-1, 0 or 1 (zero gradient, as TF)", ufunc="sign"))


def _cast_compute(xp, x, out=None, dtype="float32"):
    if out is None:
        return x.astype(dtype)
    # (copyto casts as astype does; `out[...] = x` refused a NaN numpy scalar into an
    # int 0-d array, "cannot convert float NaN to integer", where astype gives the
    # int's minimum)
    xp.copyto(out, x, casting="unsafe")
    return out


def _cast_grad(n, g):
    src = n.inputs[0].dtype
    if src is None or src.kind != "f" or n.dtype.kind != "f":
        return [None]  # no gradient flows into, or out of, integers or booleans (TF1)
    return [cast(g, src)]


register(OpDef("cast", _cast_compute, lambda s, d, a: (tuple(s[0]), np.dtype(a["dtype"])),
               _cast_grad, elementwise=True, doc="change dtype"))


def _where_compute(xp, cond, a, b, out=None):
    result = xp.where(cond, a, b)
    return result


def _where_grad(n, g):
    cond, a, b = n.inputs
    zero = zeros_like(g)
    # The op's own numpy broadcasting (not the builder's TF1 row rule, which the
    # forward node already went through)
    return [None, unbroadcast(make("where", cond, g, zero), a),
            unbroadcast(make("where", cond, zero, g), b)]


def _where_check(attrs: dict, dtypes: list) -> None:
    """The condition is boolean, as TF1 requires: a float condition was read as
    "nonzero", where the user likely meant a comparison."""
    if dtypes[0] is not None and dtypes[0].kind != "b":
        raise Mismatch(f"the condition must be boolean, got {dtypes[0]} (compare it, "
                       "e.g. x > 0, or cast it to tf.bool)")


register(OpDef("where", _where_compute,
               lambda s, d, a: (broadcast_shapes(*s), result_dtype(d[1:])),
               _where_grad, elementwise=True, doc="cond ? a : b", check=_where_check))


def _zeros_like_compute(xp, x, out=None):
    if out is None:
        return xp.zeros_like(x)
    out.fill(0)
    return out


def _ones_like_compute(xp, x, out=None):
    if out is None:
        return xp.ones_like(x)
    out.fill(1)
    return out


# Both appear in gradient graphs (the seed of `gradients`, the zeros of `where`'s
# gradient), so a second derivative reaches them: they need their zero gradient.
register(OpDef("zeros_like", _zeros_like_compute, infer_same, zero_gradient,
               elementwise=True, doc="zeros of x's shape and dtype", shape_inputs=(0,)))
register(OpDef("ones_like", _ones_like_compute, infer_same, zero_gradient,
               elementwise=True, doc="ones of x's shape and dtype", shape_inputs=(0,)))


def _identity_compute(xp, x, out=None):
    if out is None:
        return x.copy()
    out[...] = x
    return out


# tf.stop_gradient: x's value, with no gradient flowing back through it. A trace of
# eager code (eager.py) puts it where eager mode records nothing on its tape: values
# made under no_grad, written in place, or copied (Tensor(x), x.detach()).
register(OpDef("stop_gradient", _identity_compute, infer_same, zero_gradient,
               elementwise=True, doc="x, with no gradient flowing back through it"))


# ----------------------------------------------------------------------------------
# Matrix multiply
# ----------------------------------------------------------------------------------

def _matmul_compute(xp, a, b, out=None, transpose_a=False, transpose_b=False):
    # Transposes are views: BLAS reads the strides, nothing is copied.
    if transpose_a:
        a = xp.swapaxes(a, -1, -2)
    if transpose_b:
        b = xp.swapaxes(b, -1, -2)
    return xp.matmul(a, b, out=out)


def _matmul_infer(shapes, dtypes, attrs):
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise Mismatch("matmul needs inputs of rank >= 2 (reshape vectors first)")
    if attrs.get("transpose_a"):
        a = a[:-2] + (a[-1], a[-2])
    if attrs.get("transpose_b"):
        b = b[:-2] + (b[-1], b[-2])
    if a[-1] is not None and b[-2] is not None and a[-1] != b[-2]:
        raise Mismatch(f"inner dimensions differ ({a[-1]} vs {b[-2]})")
    batch = broadcast_shapes(a[:-2], b[:-2]) if (a[:-2] or b[:-2]) else ()
    return batch + (a[-2], b[-1]), result_dtype(dtypes)


def _matmul_grad(n, g):
    a, b = n.inputs
    ta, tb = n.attrs.get("transpose_a", False), n.attrs.get("transpose_b", False)
    # For C = A B: dA = G B^T, dB = A^T G; the transpose flags permute these.
    if not ta:
        grad_a = matmul(g, b, transpose_b=not tb)
    else:
        grad_a = matmul(b, g, transpose_a=tb, transpose_b=True)
    if not tb:
        grad_b = matmul(a, g, transpose_a=not ta)
    else:
        grad_b = matmul(g, a, transpose_a=True, transpose_b=ta)
    if a.ndim == 2 and b.ndim == 2:
        return [grad_a, grad_b]  # no batch broadcasting in 2-D: shapes already match
    return [unbroadcast(grad_a, a), unbroadcast(grad_b, b)]


def matmul_cost(node: Node) -> float | None:
    """Flops of a matmul (or a fused dense layer): 2 * output size * inner dim."""
    if not node.inputs or not node.inputs[0].shape:
        return None
    a_shape = node.inputs[0].shape
    inner = a_shape[-2] if node.attrs.get("transpose_a") else a_shape[-1]
    return 2.0 * _known_size(node.shape) * (inner or 1)


def _known_size(shape: Sequence | None) -> int:
    """The number of elements, counting an unknown dim as 1 (a cost estimate)."""
    size = 1
    for d in shape or ():
        size *= d or 1
    return size


register(OpDef("matmul", _matmul_compute, _matmul_infer, _matmul_grad, cost=matmul_cost,
               doc="batched matrix product, batch dims broadcast like numpy"))


# ----------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------

def _reduce_infer(method, needs_an_element=False):
    """The shape rule of a reduction; `needs_an_element`: a reduction with no value
    over nothing (max: no identity), refused for an axis of size 0."""
    def infer(shapes, dtypes, attrs):
        shape = shapes[0]
        axes = normalize_axes(attrs.get("axis"), len(shape))
        if needs_an_element:
            _check_not_empty(method, shape, axes)
        if attrs.get("keepdims"):
            out = tuple(1 if i in axes else d for i, d in enumerate(shape))
        else:
            out = tuple(d for i, d in enumerate(shape) if i not in axes)
        # numpy's dtype for the reduction: a sum of booleans counts them (int64).
        dtype = dtypes[0]
        if dtype is not None:
            dtype = getattr(np.ones(1, dtype), method)().dtype
        return out, dtype
    return infer


def _check_not_empty(op: str, shape: tuple, axes: tuple) -> None:
    """A max or min (or argmax, argmin) over an axis of size 0 has no value: say so
    (numpy: 'zero-size array to reduction operation maximum which has no
    identity'). A sum or mean over nothing is 0 or NaN. Checked by the shape rule
    alone: a kernel runs only on shapes its rule has seen (a program is specialized
    to the fed shapes, and an eager op asks the rule first), so the kernels need
    not check again each run."""
    empty = [a for a in axes if shape[a] == 0]
    if empty:
        raise Mismatch(f"{op} over axis {empty[0]} of size 0 (shape {tuple(shape)}) has "
                       f"no value: there is no element to take the {op.removeprefix('arg')} "
                       "of")


def _reduce_compute(method):
    def compute(xp, x, out=None, axis=None, keepdims=False):
        if method == "mean" and x.size == 0:
            return _mean_of_nothing(xp, x, axis, keepdims)
        result = getattr(x, method)(axis=axis, keepdims=keepdims)
        return xp.asarray(result)
    return compute


def _mean_of_nothing(xp, x, axis, keepdims):
    """The mean of an empty array: NaN where nothing was averaged (as TF1 gives),
    without numpy's "Mean of empty slice" and "invalid value" RuntimeWarnings,
    which reached the user from deep inside numpy on an empty batch."""
    dtype = np.ones(1, x.dtype).mean().dtype
    total = x.sum(axis=axis, keepdims=keepdims, dtype=dtype)
    count = x.size if axis is None else math.prod(
        x.shape[a] for a in ((axis,) if isinstance(axis, int) else axis))
    with np.errstate(invalid="ignore", divide="ignore"):
        return xp.asarray(xp.true_divide(total, count), dtype=dtype)


def _expand_reduced(g: Node, n: Node) -> Node:
    """Gradient of a reduction, broadcast back to the input's shape."""
    axis, keepdims = n.attrs.get("axis"), n.attrs.get("keepdims", False)
    if not keepdims and axis is not None:
        g = make("expand_dims", g, axis=_axis_attr(axis))  # registered by shape_ops.py
    return broadcast_like(g, n.inputs[0])


def _mean_grad(n, g):
    # Divided by the count N (exact, as TF1 and the original TinyFlow), not times a
    # rounded 1/N: count_ratio(x, n) is size(x) / size(n), an integer.
    x = n.inputs[0]
    return [_expand_reduced(g, n) / count_ratio(x, n)]


def _extreme_grad(n, g):
    """The gradient of a max or a min: it goes to the elements equal to the result,
    split evenly among ties (TF1's rule)."""
    x = n.inputs[0]
    peak = _expand_reduced(n, n)
    mask = cast(equal(x, peak), x.dtype)
    share = mask / _expand_reduced(reduce_sum(mask, n.attrs.get("axis"), keepdims=n.attrs.get(
        "keepdims", False)), n)
    return [_expand_reduced(g, n) * share]


register(OpDef("sum", _reduce_compute("sum"), _reduce_infer("sum"),
               lambda n, g: [_expand_reduced(g, n)], doc="sum over axes"))
register(OpDef("mean", _reduce_compute("mean"), _reduce_infer("mean"), _mean_grad,
               doc="mean over axes"))
register(OpDef("max", _reduce_compute("max"), _reduce_infer("max", needs_an_element=True),
               _extreme_grad, doc="max over axes"))
register(OpDef("min", _reduce_compute("min"), _reduce_infer("min", needs_an_element=True),
               _extreme_grad, doc="min over axes"))


def _count_ratio_compute(xp, y, x, out=None):
    """size(y) / size(x) as a scalar of x's dtype: the 1/N of a mean's gradient."""
    ratio = (y.size / x.size) if x.size else 0.0
    return xp.asarray(ratio, dtype=x.dtype)


register(OpDef("count_ratio", _count_ratio_compute, lambda s, d, a: ((), d[1]),
               zero_gradient, doc="size(a) / size(b), for gradients of means",
               shape_inputs=(0, 1)))


def count_ratio(y: Node, x: Node) -> Node:
    return make("count_ratio", y, x)


def _arg_compute(method):
    def compute(xp, x, out=None, axis=None):
        return getattr(xp, method)(x, axis=axis)
    return compute


def _arg_infer(method):
    def infer(shapes, dtypes, attrs):
        shape = shapes[0]
        axis = attrs.get("axis")
        if shape is not None:
            _check_not_empty(method, shape, normalize_axes(axis, len(shape)))
        if axis is None:
            return (), np.dtype(np.int64)
        (ax,) = normalize_axes(axis, len(shape))
        return tuple(d for i, d in enumerate(shape) if i != ax), np.dtype(np.int64)
    return infer


for _name in ("argmax", "argmin"):
    register(OpDef(_name, _arg_compute(_name), _arg_infer(_name), None, differentiable=False,
                   doc=f"index of the {_name[3:]} along an axis (the first of ties)"))


# ----------------------------------------------------------------------------------
# Builders: the functions users (and gradients) call
# ----------------------------------------------------------------------------------

def add(a: Operand, b: Operand) -> Node: return make("add", a, b)
def sub(a: Operand, b: Operand) -> Node: return make("sub", a, b)
def mul(a: Operand, b: Operand) -> Node: return make("mul", a, b)
def div(a: Operand, b: Operand) -> Node: return make("div", a, b)
def power(a: Operand, b: Operand) -> Node: return make("pow", a, b)
def maximum(a: Operand, b: Operand) -> Node: return make("maximum", a, b)
def minimum(a: Operand, b: Operand) -> Node: return make("minimum", a, b)
def neg(x: Operand) -> Node: return make_unary("neg", x)
def exp(x: Operand) -> Node: return make_unary("exp", x)
def log(x: Operand) -> Node: return make_unary("log", x)
def sqrt(x: Operand) -> Node: return make_unary("sqrt", x)
def tanh(x: Operand) -> Node: return make_unary("tanh", x)
def sigmoid(x: Operand) -> Node: return make_unary("sigmoid", x)
def relu(x: Operand) -> Node: return make_unary("relu", x)
def gelu(x: Operand) -> Node: return make_unary("gelu", x)
def sign(x: Operand) -> Node: return make_unary("sign", x)
def less(a: Operand, b: Operand) -> Node: return make("less", a, b)
def less_equal(a: Operand, b: Operand) -> Node: return make("less_equal", a, b)
def greater(a: Operand, b: Operand) -> Node: return make("greater", a, b)
def greater_equal(a: Operand, b: Operand) -> Node: return make("greater_equal", a, b)
def equal(a: Operand, b: Operand) -> Node: return make("equal", a, b)
def not_equal(a: Operand, b: Operand) -> Node: return make("not_equal", a, b)
def zeros_like(x: Operand, dtype: DType | None = None) -> Node:
    """Zeros of x's shape, in x's dtype or `dtype` (TF1's argument)."""
    zeros = make("zeros_like", x)
    return zeros if dtype is None else cast(zeros, dtype)


def ones_like(x: Operand, dtype: DType | None = None) -> Node:
    """Ones of x's shape, in x's dtype or `dtype` (TF1's argument)."""
    ones = make("ones_like", x)
    return ones if dtype is None else cast(ones, dtype)
def stop_gradient(x: Operand) -> Node: return make_unary("stop_gradient", x)
def where(cond: Operand, a: Operand, b: Operand) -> Node:
    """tf.where(cond, a, b): a where cond holds, else b, broadcasting as numpy does;
    and TF1's rule for a vector condition beside values of higher rank: it picks
    whole rows, cond[i] choosing a[i] or b[i] (read as shaped (n, 1, ..., 1)).
    Broadcasting alone would have matched it against the last axis instead."""
    if isinstance(cond, (bool, np.bool_, list, tuple, np.ndarray)):
        # A literal condition is a boolean constant of its own (typed beside the
        # values, [True, False] would become float32 ones and zeros).
        cond = constant(np.asarray(cond), np.asarray(cond).dtype)
    rank = max(_rank(a), _rank(b))
    if _rank(cond) == 1 and rank > 1:
        length = cond.shape[0] if hasattr(cond, "shape") else len(cond)   # (a list)
        rows = {v.shape[0] for v in (a, b) if _rank(v) == rank and v.shape[0] is not None}
        if length is not None and rows - {length}:
            raise shape_error("where", [(length,), *(getattr(v, "shape", ()) for v in (a, b))],
                              f"a condition of shape {format_shape((length,))} picks whole "
                              f"rows (TF1's rule), but the values have {rows.pop()} rows",
                              user_source_line())
        cond = make("reshape", cond, shape=(-1,) + (1,) * (rank - 1))
    return make("where", cond, a, b)


def _rank(value: Any) -> int:
    """The rank of a node, eager Tensor or literal; -1 when not known yet."""
    if hasattr(value, "shape"):
        return -1 if value.shape is None else len(value.shape)
    return np.ndim(value)


def abs(x: Operand) -> Node:  # noqa: A001 - tf.abs
    return make_unary("abs", x)


pow = power  # noqa: A001 - the `**` operator and tf.pow


def cast(x: Operand, dtype: DType) -> Node:
    dtype = dtype_attr("cast", dtype)
    # A cast to x's own dtype is x itself, for a Node and an eager Tensor alike (as
    # PyTorch's x.to(x.dtype) is x): a no-op cast in eager mode but not in the graph
    # gave backward another summation order, and its gradient another dtype traced.
    if (isinstance(x, Node) or getattr(x, "__tinyflow_tensor__", False)) \
            and x.dtype == dtype:
        return x
    return make("cast", x, dtype=dtype.name)


def matmul(a: Operand, b: Operand, transpose_a: bool = False, transpose_b: bool = False
           ) -> Node:
    attrs = {}
    if transpose_a:
        attrs["transpose_a"] = True
    if transpose_b:
        attrs["transpose_b"] = True
    return make("matmul", a, b, **attrs)


# Builders normalize their attribute arguments here, before `make`, so that a value
# of the wrong type is refused with the op, the argument and the user's line, and is
# never coerced: int(1.5) silently built a reduction over axis 1, int("1") accepted a
# string, bool("no") kept the dims, and the rest escaped as numpy's or Python's own
# errors from inside tinyflow ("invalid literal for int()").

def argument_error(op: str, what: str) -> ArgumentError:
    """The one format of a bad-argument error: op, what is wrong, user's line."""
    return ArgumentError(f"{op}: {what} (at {user_source_line()})")


def int_like(value: Any) -> bool:
    # bool is an int to Python, but axis=True or a stride of True is a slip (a
    # keepdims passed by position), not a 1.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_attr(op: str, arg: str, value: Any) -> int:
    """`value` as an int attribute: a Python or numpy int; anything else (a float,
    even 2.0, as numpy refuses for an axis; a string; None) is an ArgumentError."""
    if not int_like(value):
        raise argument_error(op, f"{arg} must be an int, got {value!r}")
    return int(value)


def ints_attr(op: str, arg: str, values: Any) -> tuple[int, ...]:
    """A sequence of ints (a list, tuple or 1-D integer array) as a tuple attribute."""
    sequence = isinstance(values, Sequence) and not isinstance(values, (str, bytes)) or \
        isinstance(values, np.ndarray) and values.ndim == 1
    if not sequence or not all(int_like(v) for v in values):
        raise argument_error(op, f"{arg} must be a sequence of ints, got {values!r}")
    return tuple(int(v) for v in values)


def bool_attr(op: str, arg: str, value: Any) -> bool:
    """A flag: True, False (or None, TF1's "not given"); not a truthy string or int."""
    if value is None:
        return False
    if not isinstance(value, (bool, np.bool_)):
        raise argument_error(op, f"{arg} must be True or False, got {value!r}")
    return bool(value)


def dtype_attr(op: str, dtype: Any) -> np.dtype:
    """`dtype` as a numpy dtype a tensor can hold: bool, an int, a float or a complex.
    An unknown name ("floaty") or a dtype of Python objects or strings is refused
    here: np.dtype raised its own TypeError, and an object placeholder or cast
    built, only to fail (or compute on objects) later."""
    try:
        result = np.dtype(dtype)
    except TypeError:
        raise argument_error(op, f"dtype {dtype!r} is not a dtype numpy knows") from None
    if dtype is None or result.kind not in "biufc":
        raise argument_error(op, f"dtype {dtype!r} is not a numeric dtype (bool, int, "
                                 "float or complex)")
    return result


def float_attr(op: str, arg: str, value: Any, low: float | None = None) -> float:
    """A finite real number (int or float, Python or numpy) as a float attribute,
    and >= `low` if given (a scale or epsilon that only fails, or NaNs, below it)."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or \
            isinstance(value, (bool, np.bool_)) or not math.isfinite(value):
        raise argument_error(op, f"{arg} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise argument_error(op, f"{arg} must be >= {low:g}, got {value!r}")
    return float(value)


def _axis_attr(axis: Axis, op: str = "axis") -> int | tuple[int, ...] | None:
    if axis is None:
        return None
    if isinstance(axis, (list, tuple, np.ndarray)):
        return ints_attr(op, "axis", axis)
    return int_attr(op, "axis", axis)


def reduce_sum(x: Operand, axis: Axis = None, keepdims: bool = False) -> Node:
    return make("sum", x, axis=_axis_attr(axis, "reduce_sum"),
                keepdims=bool_attr("reduce_sum", "keepdims", keepdims))


def reduce_mean(x: Operand, axis: Axis = None, keepdims: bool = False) -> Node:
    axis = _axis_attr(axis, "reduce_mean")
    keepdims = bool_attr("reduce_mean", "keepdims", keepdims)
    # The mean of booleans or ints is a fraction (accuracy): in float32, as TinyFlow
    # always did, for a Node and an eager Tensor alike (testing for a Node alone left
    # eager means in numpy's float64 while the traced graph gave float32).
    dtype = getattr(x, "dtype", None)
    if dtype is None and not isinstance(x, Node):   # a Python number or list
        dtype = np.asarray(x).dtype
    if dtype is not None and np.dtype(dtype).kind in "biu":
        x = cast(x, np.float32)
    return make("mean", x, axis=axis, keepdims=keepdims)


def reduce_max(x: Operand, axis: Axis = None, keepdims: bool = False) -> Node:
    return make("max", x, axis=_axis_attr(axis, "reduce_max"),
                keepdims=bool_attr("reduce_max", "keepdims", keepdims))


def reduce_min(x: Operand, axis: Axis = None, keepdims: bool = False) -> Node:
    return make("min", x, axis=_axis_attr(axis, "reduce_min"),
                keepdims=bool_attr("reduce_min", "keepdims", keepdims))


def argmax(x: Operand, axis: int | None = None) -> Node:
    return make("argmax", x, axis=None if axis is None else int_attr("argmax", "axis", axis))


def argmin(x: Operand, axis: int | None = None) -> Node:
    return make("argmin", x, axis=None if axis is None else int_attr("argmin", "axis", axis))


def _shape_attr(shape: Shape, op: str = "shape") -> tuple:
    if int_like(shape):
        return (int(shape),)
    return ints_attr(op, "shape", shape)


def zeros(shape: Shape, dtype: DType = np.float32, name: str | None = None) -> Node:
    return make("zeros", shape=_shape_attr(shape, "zeros"), dtype=dtype_attr("zeros", dtype).name,
                name=name)


def ones(shape: Shape, dtype: DType = np.float32, name: str | None = None) -> Node:
    return make("ones", shape=_shape_attr(shape, "ones"), dtype=dtype_attr("ones", dtype).name,
                name=name)


# Random streams (TF1: graph seed + op seed). Every random op gets a seed attribute
# (graph seed, op seed, k) where k counts the earlier random ops built with the same
# op seed: two dropouts with seed=42 draw from two streams, and an op's numbers never
# depend on which other random op happens to run first (streams, memory plans and
# passes change that order). Unseeded ops get distinct op seeds in build order.
_graph_seed = 0
_seed_counter = iter(range(10**9))
_seed_uses: dict[int, int] = {}


def set_random_seed(seed: int) -> None:
    """tf.set_random_seed: the graph-level seed of the random ops built from now on.
    The per-seed counts restart, so a program that calls it first builds the same
    streams whatever ran before it in the process."""
    global _graph_seed, _seed_counter
    _graph_seed = int(seed)
    _seed_counter = iter(range(10**9))
    _seed_uses.clear()


def _next_seed(seed) -> tuple[int, int, int]:
    op_seed = int(seed) if seed is not None else 1_000_003 + next(_seed_counter)
    k = _seed_uses.get(op_seed, 0)
    _seed_uses[op_seed] = k + 1
    return (_graph_seed, op_seed, k)


def random_normal(shape: Shape, mean: float = 0.0, stddev: float = 1.0,
                  dtype: DType = np.float32, seed: int | None = None,
                  name: str | None = None, op: str = "random_normal") -> Node:
    # (A negative stddev built, then failed in every run as numpy's "scale < 0".)
    return make(op, shape=_shape_attr(shape, op), dtype=dtype_attr(op, dtype).name,
                a=float_attr(op, "mean", mean), b=float_attr(op, "stddev", stddev, low=0),
                seed=_next_seed(seed), name=name)


def truncated_normal(shape: Shape, mean: float = 0.0, stddev: float = 1.0,
                     dtype: DType = np.float32, seed: int | None = None,
                     name: str | None = None) -> Node:
    """tf.truncated_normal: normal values, those more than 2 stddev from the mean
    drawn again (TF1's favourite weight initializer)."""
    return random_normal(shape, mean, stddev, dtype, seed, name, op="truncated_normal")


def random_uniform(shape: Shape, minval: float = 0.0, maxval: float = 1.0,
                   dtype: DType = np.float32, seed: int | None = None,
                   name: str | None = None) -> Node:
    low = float_attr("random_uniform", "minval", minval)
    high = float_attr("random_uniform", "maxval", maxval)
    # minval > maxval (or a range wider than a float) built, then failed in every
    # run as numpy's "high - low < 0" (or an OverflowError).
    if low > high:
        raise argument_error("random_uniform", f"minval must be <= maxval, got minval="
                                               f"{minval!r}, maxval={maxval!r}")
    if not math.isfinite(high - low):
        raise argument_error("random_uniform", f"maxval - minval must be a finite number, "
                                               f"got minval={minval!r}, maxval={maxval!r}")
    return make("random_uniform", shape=_shape_attr(shape, "random_uniform"),
                dtype=dtype_attr("random_uniform", dtype).name,
                a=low, b=high, seed=_next_seed(seed), name=name)


# The shape ops' builders (shape_ops.py, the layer above, adds them as it loads), so
# that ``ops.reshape`` & co. keep working without ops.py importing shape_ops.py.
SHAPE_OP_BUILDERS: dict[str, Callable[..., Node]] = {}


def __getattr__(name: str) -> Any:
    """``ops.reshape`` -> shape_ops.reshape (PEP 562: called for names not found)."""
    try:
        return SHAPE_OP_BUILDERS[name]
    except KeyError:
        raise AttributeError(f"module 'tinyflow.ops' has no attribute {name!r}") from None


# Node's Python operators (`x + y`, `x @ w`, `-x`, `x < y`...) build these ops.
OPERATOR_BUILDERS.update(
    add=add, sub=sub, mul=mul, div=div, pow=power, matmul=matmul, neg=neg, abs=abs,
    less=less, less_equal=less_equal, greater=greater, greater_equal=greater_equal)


# ----------------------------------------------------------------------------------
# erf: the Gauss error function (ONNX's Erf, and GELU's exact form x * Phi(x)).
# numpy has none, so it is written here in float64 and rounded to the input's dtype:
# below |x| = 2.5 the Maclaurin series (40 terms reach 1e-17 there), above it
# 1 - erfc(|x|) with the Chebyshev fit of Numerical Recipes (erfcc: relative error
# below 1.2e-7, on an erfc below 4.1e-4, so erf is right to ~5e-11 there).
# ----------------------------------------------------------------------------------

_ERFC_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
             0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erf_compute(xp, x, out=None):
    x64 = x.astype(np.float64)
    z = xp.abs(x64)
    small = xp.minimum(z, 2.5)
    term, series, square = small.copy(), small.copy(), small * small
    for n in range(1, 41):
        term *= -square / n
        series += term / (2 * n + 1)
    series *= 2.0 / math.sqrt(math.pi)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = xp.zeros_like(t)
    for coeff in reversed(_ERFC_FIT[1:]):
        poly = t * (poly + coeff)
    tail = 1.0 - t * xp.exp(-z * z + _ERFC_FIT[0] + poly)
    result = xp.sign(x64) * xp.where(z < 2.5, series, tail)
    result = result.astype(float_dtype(x.dtype), copy=False)
    return result


# Not flagged elementwise, though it is: fuse_elementwise would then take it into
# fused kernels, which need a CUDA template per op (gpu.TEMPLATES). Its own step runs
# on every device with the compute above.
register(OpDef("erf", _erf_compute,
               lambda s, d, a: (tuple(s[0]), ufunc_dtype("exp", d)),
               lambda n, g: [g * (2.0 / math.sqrt(math.pi))
                             * exp(neg(n.inputs[0] * n.inputs[0]))],
               doc="the Gauss error function"))


def erf(x: Operand) -> Node: return make_unary("erf", x)
